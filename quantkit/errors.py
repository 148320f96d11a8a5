class QuantkitError(Exception):
    """A problem with the user's input or environment, reported as one line without a traceback."""
