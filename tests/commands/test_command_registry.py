"""A new command is one module in ``tformer/commands/`` plus its name in ``cli.COMMANDS``.

References: the modules found on disk, and a command written here, registered by that one name,
run through ``tformer.cli.main`` with its error boundary.
"""

import re
import sys
import types
from pathlib import Path

import pytest

import tformer.commands
from tformer import cli
from tformer.errors import InputError


def test_every_command_module_is_listed_and_has_add_parser():
    on_disk = {p.stem for p in Path(tformer.commands.__file__).parent.glob("*.py") if p.stem != "__init__"}
    assert on_disk == set(cli.COMMANDS) and len(cli.COMMANDS) == len(set(cli.COMMANDS))
    listed = re.findall(r"^    (\S+)", cli.build_parser().format_help(), re.M)    # every add_parser ran
    assert [name for name in listed if name in cli.COMMANDS] == cli.COMMANDS


def _echo_module() -> types.ModuleType:
    def run(args):
        if args.times < 1:
            raise InputError(f"--times {args.times} must be >= 1.")
        print(" ".join([args.word] * args.times))
        return 0

    def add_parser(sub):
        p = sub.add_parser("echo", help="repeat a word")
        p.add_argument("word")
        p.add_argument("--times", type=int, default=1)
        p.set_defaults(func=run)

    module = types.ModuleType("tformer.commands.echo")
    module.add_parser = add_parser
    return module


def test_a_command_registered_by_name_runs_with_the_error_boundary(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tformer.commands.echo", _echo_module())
    monkeypatch.setattr(cli, "COMMANDS", [*cli.COMMANDS, "echo"])               # the one registration
    assert cli.main(["echo", "hi", "--times", "2"]) == 0
    assert capsys.readouterr().out == "hi hi\n"
    assert cli.main(["echo", "hi", "--times", "0"]) == 2
    assert capsys.readouterr().err == "tformer echo: error: --times 0 must be >= 1.\n"
    with pytest.raises(SystemExit):
        cli.main(["no-such-command"])
