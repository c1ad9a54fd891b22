"""mpcomm-example-loopback: a small, complete mpcomm transport to copy from.

Installing this distribution is all it takes: mpcomm finds the plugin through
the ``example_pipe`` entry point in the ``mpcomm.transports`` group
(``mpcomm plugins`` lists it) and ``python -m mpcomm.testing example_pipe``
runs the conformance kit on it.
"""

__version__ = "0.1.0"
