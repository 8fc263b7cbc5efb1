"""Model architectures, one file each, and the registry that picks one for a file."""
