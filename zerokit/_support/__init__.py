"""Leaves that import nothing of zerokit, so that any room may import them without an import circle:
log.py (the `zerokit` logger), lazy.py (names a package imports on first use), jsonfile.py (zerokit's small JSON
files), extras.py (optional packages, imported where needed) and torchrun.py (torchrun's environment, read
without torch)."""
