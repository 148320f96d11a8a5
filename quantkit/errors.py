class QuantkitError(Exception):
    """A problem with the user's input or environment, reported as one line without a traceback."""


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type's name when empty): a foreign error as one line."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror  # not the path again: callers name the file themselves
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
