"""The one error type kvcal raises for bad input: the CLI prints its message on one line, exit 2."""


class KvcalError(Exception):
    """Bad input or a refused artifact. The message names the problem and what to do."""
