"""A transport that fails on purpose (see :mod:`.transport`)."""
