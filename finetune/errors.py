"""User-facing errors.

Everything a user can get wrong raises a :class:`FinetuneError`. The CLI prints its message (one line per
problem, naming the key, file or flag and the fix) and exits with code 2; tracebacks are shown only with
``FINETUNE_DEBUG=1``. ``assert`` is reserved for our own invariants.
"""

from __future__ import annotations


class FinetuneError(Exception):
    """A mistake the user can fix; the message says what and how."""

    exit_code = 2


class ConfigError(FinetuneError):
    """The recipe (YAML, extends, overrides) is invalid."""


class DataError(FinetuneError):
    """A dataset file is missing or holds a bad row."""


class RunDirError(FinetuneError):
    """A run or checkpoint directory is missing, incomplete, or would be overwritten."""
