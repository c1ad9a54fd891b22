"""``python -m mpcomm.cli`` runs the ``mpcomm`` command."""

from . import main

main()
