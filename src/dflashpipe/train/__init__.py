"""Drafter training: data order, topology, the threaded loop."""
