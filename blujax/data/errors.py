"""The errors of data a user gave and can fix: shards, text, JSON lines."""


class DataError(ValueError):
    """A problem with data the user gave, which they can fix: the message (one line) names
    the file and what is wrong with it. The command line prints it and exits with status 2."""


class ShardError(DataError):
    """A token shard that is not a valid llm.c shard; the message names the file."""


class TextError(DataError):
    """A text or JSON-lines input that cannot be read as documents (not UTF-8, not JSON, no
    text field); the message names the file and the place in it."""
