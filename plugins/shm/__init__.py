"""The shm transport plugin (in progress)."""
