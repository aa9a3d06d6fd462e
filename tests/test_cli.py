"""CPU tests of the ``pcie-allreduce`` console script (pcie_allreduce.tools.cli): its commands, lazy
loading, and the one-line exits (cannot run here, interrupted, a command missing from the install)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pcie_allreduce.tools import cli
from pcie_allreduce.errors import UnavailableError



def test_commands_and_top_level_parser(capsys) -> None:
    assert [c.name for c in cli.COMMANDS] == ["tune", "env"]
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args([])  # a subcommand is required
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "tune" in out and "env" in out and "bench" not in out.split("COMMAND", 1)[1]


def test_only_the_named_command_is_imported() -> None:
    code = ("import sys; from pcie_allreduce.tools import cli; cli.build_parser(['tune', '--help'])\n"
            "assert 'pcie_allreduce.tools.tune.cli' in sys.modules and 'pcie_allreduce.tools.environment' not in sys.modules\n"
            "assert 'torch' not in sys.modules\n"
            "assert not any(m == 'bench' or m.startswith('bench.') for m in sys.modules)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_tune_help(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["tune", "--help"])
    assert info.value.code == 0 and "--cache-dir" in capsys.readouterr().out


def test_env_help(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["env", "--help"])
    assert info.value.code == 0 and "configuration" in capsys.readouterr().out


def test_a_command_missing_from_the_install_is_one_line(capsys, monkeypatch) -> None:
    missing = cli.Command("gone", "a command whose module this install lacks",
                          "pcie_allreduce.not_installed:add_arguments", "pcie_allreduce.not_installed:run")
    monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, missing))
    assert cli.main(["gone"]) == cli.EXIT_UNAVAILABLE
    err = capsys.readouterr().err
    assert err.startswith("pcie-allreduce gone: error: cannot load the command (") and err.count("\n") == 1


def _args() -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    return argparse.Namespace(), argparse.ArgumentParser()


def test_run_handler_turns_unavailable_and_ctrl_c_into_one_line(capsys) -> None:
    def refuse(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        raise UnavailableError("no GPU\nat all")

    def interrupted(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        raise KeyboardInterrupt

    assert cli.run_handler("prog mode", refuse, *_args()) == cli.EXIT_UNAVAILABLE
    assert capsys.readouterr().err == "prog mode: cannot run here: no GPU at all\n"
    assert cli.run_handler("prog", interrupted, *_args()) == cli.EXIT_INTERRUPTED
    assert capsys.readouterr().err == "prog: interrupted\n"
    assert cli.run_handler("prog", lambda a, p: 1, *_args()) == 1
    assert cli.run_handler("prog", "no_such_module_here:run", *_args()) == cli.EXIT_UNAVAILABLE
    assert "cannot load the command" in capsys.readouterr().err


def test_typed_arg_makes_bad_values_usage_errors() -> None:
    even = cli.typed_arg(int, lambda v: v % 2 == 0, "an even integer")
    assert even("4") == 4
    with pytest.raises(argparse.ArgumentTypeError, match="'x' is not an even integer"):
        even("x")
    with pytest.raises(argparse.ArgumentTypeError, match="'3': must be an even integer"):
        even("3")
