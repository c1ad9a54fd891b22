"""The mpcomm command line."""
