"""In-tree transport plugins; each registers through the mpcomm.transports entry-point group."""
