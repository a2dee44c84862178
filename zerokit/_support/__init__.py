"""Leaves that import nothing of zerokit, so that any room may import them without an import circle:
log.py (the `zerokit` logger)."""
