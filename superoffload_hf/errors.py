"""Errors the command line reports in one line, importable without torch (the CLI sets torch's
OpenMP policy before torch loads)."""


class CorruptStateError(ValueError):
    """An optimizer state tensor does not match the checksum saved with it."""
