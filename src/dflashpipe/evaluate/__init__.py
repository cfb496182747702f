"""Speculative decoding with the trained drafter, its metrics, and the regression check against a baseline."""
