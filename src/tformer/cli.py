"""The ``tformer`` command. Each subcommand lives in its own module under ``tformer.commands``
with ``add_parser(subparsers)`` (which sets ``func``); this file only lists them.

The error boundary is here, once, so every command inherits it: a :class:`~tformer.errors.TformerError`
(bad input: its message names the problem and the fix) and an operating-system condition the user
can act on (a full disk, a read-only file system, a missing permission, ...) are printed as one line
``tformer <command>: error: ...`` with exit status 2; anything else is a bug and keeps its traceback.
Ctrl-C that no loop of the command handles (while a model loads or converts, while a fit runs) ends the
command with one line and status 130, the status of a process SIGINT ended.
A reader that closes stdout early (``tformer claims | head -1``) ends the command quietly with 141,
the status of a process a SIGPIPE ended, as Unix tools do.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import signal
import sys

from tformer.errors import TformerError
from tformer.exits import INTERRUPTED, exit_code_for_signal

# Subcommand modules, in the order ``tformer --help`` lists them.
COMMANDS = ["train", "finetune", "sample", "generate", "chat", "count", "convert", "embed", "claims", "plan", "sweep", "serve", "eval",
            "translate", "kernels"]

# OSError conditions that are the user's to fix, and the advice that goes with each.
USER_OS_ERRORS = {
    errno.ENOSPC: "free some space or write elsewhere",
    errno.EDQUOT: "free some space or write elsewhere",
    errno.EFBIG: "raise the file-size limit (ulimit -f) or write elsewhere",
    errno.EROFS: "write to a writable folder instead",
    errno.EACCES: "fix its permissions or use another path",
    errno.EPERM: "fix its permissions or use another path",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of the path is a file, not a folder; use another path",
    errno.EISDIR: "it is a folder where a file is needed; use another path",
    errno.EEXIST: "remove it or use another path",
    errno.ENAMETOOLONG: "use a shorter path",
    errno.EMFILE: "raise the open-file limit (ulimit -n)",
}


def os_error_message(e: OSError) -> str | None:
    """One sentence for an OSError the user can act on (naming the path), else ``None`` (a bug)."""
    if e.errno not in USER_OS_ERRORS:
        return None
    paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
    where = f" at {paths}" if paths else ""
    return f"{e.strerror or errno.errorcode.get(e.errno, e.errno)}{where}; {USER_OS_ERRORS[e.errno]}."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tformer", description="Build, train, run and measure transformers.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"tformer.commands.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C outside a loop that handles it (loading, converting, fitting): one line
        command = next((a for a in (sys.argv[1:] if argv is None else argv) if a in COMMANDS), None)
        print(f"\ntformer{' ' + command if command else ''}: interrupted (Ctrl-C); nothing more was done.",
              file=sys.stderr)
        return INTERRUPTED


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()                  # a closed pipe shows here when the output was buffered
        return status
    except BrokenPipeError:    # `tformer ... | head`: the reader has left; stop quietly, as Unix tools do
        return _reader_left()
    except TformerError as e:  # bad input: the message names the problem and the fix
        return _fail(args.command, str(e))
    except OSError as e:       # a full disk, a read-only folder, ...: the user's to fix, not a bug
        message = os_error_message(e)
        if message is None:
            raise
        return _fail(args.command, message)


# The status of a process that a SIGPIPE ended (141): what `yes | head -1` reports for `yes`.
PIPE_CLOSED = exit_code_for_signal(signal.SIGPIPE)


def _reader_left() -> int:
    """stdout's reader closed the pipe: point stdout at /dev/null so that the interpreter's last
    flush does not raise again, and return :data:`PIPE_CLOSED` without a word."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):   # stdout is not a real file (a test's capture): nothing to flush
        pass
    return PIPE_CLOSED


def _fail(command: str, message: str) -> int:
    print(f"tformer {command}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
