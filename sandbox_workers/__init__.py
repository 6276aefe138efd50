"""Sandboxes: the Sandbox interface (base) and its backends (process/bwrap, docker)."""
