"""Compiling once, in one thread, and proving nothing compiles again (see guard.py, artifact.py)."""
