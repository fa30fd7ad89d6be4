"""The errors tformer raises for bad input, one family per kind of mistake.

Every message names the problem and the fix in one sentence. The command line turns these, and
only these, into a one-line message and exit status 2; any other exception is a bug and keeps its
traceback. Each class also derives from ``ValueError`` so code written against the older API
(``except ValueError``) keeps working.
"""

from __future__ import annotations


class TformerError(ValueError):
    """Base of every user-facing tformer error."""


class ConfigError(TformerError):
    """A configuration value is unknown, out of range, or inconsistent with another one."""


class CheckpointError(TformerError):
    """A checkpoint or model folder is missing, damaged, or does not fit its config."""


class InputError(TformerError):
    """Data given to a model or a command (ids, prompts, masks, files, options) cannot be used."""
