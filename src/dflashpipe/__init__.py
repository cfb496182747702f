"""dflashpipe: a DVC pipeline that trains and measures a DFlash speculative-decoding drafter."""

from dflashpipe.core.threads import bound_the_spinning

bound_the_spinning()  # before any module of ours imports torch (dflashpipe.core.threads.SPIN_COUNT)

__version__ = "0.1.0"
