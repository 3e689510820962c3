"""The base class of errors caused by what the user gave us.

A bad checkpoint, a malformed config or token file: the launcher prints the
message (which names the file, tensor or option at fault) and exits 1 instead
of showing a traceback. Programming errors keep their tracebacks.
"""


class UserInputError(Exception):
    """Something the user supplied is wrong; the message says what and where."""
