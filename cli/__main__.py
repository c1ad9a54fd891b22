"""``python -m mpcomm.cli`` runs the ``mpcomm`` command."""

from .app import main

main()
