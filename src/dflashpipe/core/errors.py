"""Errors a user can act on.

Anything raised as a `DflashpipeError` is printed as one message (what was wrong,
where, what to do) and the stage exits with status 2; anything else is a bug and
keeps its traceback.
"""


class DflashpipeError(Exception):
    """A problem with the user's input or environment, explained in the message."""


class ParamsError(DflashpipeError):
    """params.yaml or dvc.yaml does not describe a valid run."""


class SourceError(DflashpipeError):
    """A data or model source is missing, unreadable or malformed."""
