"""The ucx transport plugin (in progress)."""
