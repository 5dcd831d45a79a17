"""Errors meant for people.

Library code raises a subclass of :class:`PfctlError` for every *expected* failure (bad
config, unreadable input, a cache from another model, a failed check). The CLI turns it
into one line plus an optional hint and exits with ``exit_code``; tracebacks are shown only
with ``--debug`` (or ``PFCTL_DEBUG=1``).

Exit codes: 0 ok, 1 a check failed (or too many failures), 2 usage error or bad input.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2


class PfctlError(Exception):
    """Base class of expected failures. ``hint`` is the next step to suggest."""

    exit_code: int = EXIT_USAGE

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class ConfigError(PfctlError):
    """A recipe, an override or an option is invalid (names the key and what is allowed)."""


class InputError(PfctlError):
    """An input file or folder is missing, unreadable or malformed."""


class ModelLoadError(PfctlError):
    """A model folder or weight file cannot be loaded (names the file and the key)."""


class CacheError(PfctlError):
    """A latent cache is missing, from another model/preprocessing, or of another format version."""


class CheckpointError(PfctlError):
    """A training checkpoint is missing, incomplete or incompatible."""


class DistributedError(PfctlError):
    """Process-group layout is invalid (world size, sync group) or a rank failed."""


class NotBuiltError(PfctlError):
    """A feature that this version of pfctl does not provide yet."""


class CheckFailed(PfctlError):
    """A check ran and failed (verify-groupnorm verdict, too many encode failures)."""

    exit_code = EXIT_CHECK_FAILED
