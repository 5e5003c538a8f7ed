"""The one error type of the data package."""


class DataError(ValueError):
    """A user-facing problem with input data (corpus, vocab); the message names the file."""
