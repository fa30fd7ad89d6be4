"""The exit statuses of tformer's commands that a signal decides, in one place.

A process ended by a signal reports 128 + its number, as shells do (130 for Ctrl-C, 143 for SIGTERM,
141 for a closed pipe); a training run that a signal stopped (it saved a checkpoint first) exits the
same way, so a script or a scheduler cannot tell the two apart and need not.
"""

from __future__ import annotations

import signal

# The signals a training run stops on, saving a checkpoint at the next step boundary, by the name the
# loop gives each (``stopped`` in its summary).
STOP_SIGNALS = {signal.SIGTERM: "term", signal.SIGINT: "int"}


def exit_code_for_signal(signum: int) -> int:
    """The exit status of a process that signal ``signum`` ended: 128 + its number."""
    return 128 + int(signum)


# What a run that a stop signal ended exits with, by itself or killed by it.
STOPPED_EXITS = frozenset(exit_code_for_signal(signum) for signum in STOP_SIGNALS)

# Ctrl-C: a command interrupted before it could finish (or save) anything.
INTERRUPTED = exit_code_for_signal(signal.SIGINT)


def stopped_exit(stopped: str | None) -> int | None:
    """The exit status of a run whose loop stopped for ``stopped`` (its summary's): 128 + the signal for a
    stop signal's name (``"int"``, ``"term"``); None for any other reason, or none (the run goes on to finish)."""
    for signum, name in STOP_SIGNALS.items():
        if stopped == name:
            return exit_code_for_signal(signum)
    return None
