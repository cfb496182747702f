"""dflashpipe: a DVC pipeline that trains and measures a DFlash speculative-decoding drafter."""

__version__ = "0.1.0"
