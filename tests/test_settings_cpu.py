"""CPU tests of the settings: every boolean, size, integer and seconds setting of the library,
the plugin and the benchmark harness goes through :mod:`pcie_allreduce.settings`, so the same
spelling means the same everywhere and a bad value is a SettingsError naming the variable."""

from __future__ import annotations

import os
import re

import pytest
import torch

from pcie_allreduce import communicator, settings
from pcie_allreduce.fabric import nodes
from pcie_allreduce.settings import SettingsError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_shared_parsers() -> None:
    assert [settings.parse_bool("X", v) for v in ("1", "TRUE", " yes ", "on", "0", "False", "no", "off", "")] == \
        [True] * 4 + [False] * 5
    assert settings.parse_size("X", "8MiB") == 8 << 20 and settings.parse_size("X", "512KiB") == 512 << 10
    assert settings.parse_int("X", " 3 ", lo=1) == 3 and settings.parse_seconds("X", "2.5") == 2.5
    for call, why in ((lambda: settings.parse_bool("X", "maybe"), "expected 1 or 0"),
                      (lambda: settings.parse_int("X", "\u00b2", lo=1), "expected a whole number"),
                      (lambda: settings.parse_int("X", "0", lo=1), "must be at least 1"),
                      (lambda: settings.parse_int("X", "9", lo=1, hi=8), "must be between 1 and 8"),
                      (lambda: settings.parse_size("X", "1G"), "must be between 1 byte and 256MiB"),
                      (lambda: settings.parse_seconds("X", "nan"), "must be a number of seconds in")):
        with pytest.raises(SettingsError, match=f"X='.*': {why}"):
            call()
    assert settings.env_int("X", lo=1, environ={"X": " "}) is None and settings.env_bool("X", True, environ={})


@pytest.mark.parametrize("value, on", [("1", True), ("yes", True), ("true", True), ("On", True), ("0", False),
                                       ("off", False), ("", False)])
def test_dependent_launch_takes_every_boolean_spelling(monkeypatch, value: str, on: bool) -> None:
    monkeypatch.setenv(communicator.PDL_ENV, value)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert communicator._dependent_launch(torch.device("cuda", 0)) is on


def test_a_dependent_launch_value_that_is_no_boolean_names_the_variable(monkeypatch) -> None:
    monkeypatch.setenv(communicator.PDL_ENV, "sure")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(SettingsError, match="PCIE_AR_PDL='sure': expected 1 or 0"):
        communicator._dependent_launch(torch.device("cuda", 0))


def test_the_timeout_setting_names_the_variable(monkeypatch) -> None:
    monkeypatch.setenv(communicator.TIMEOUT_ENV, "2.5")
    assert communicator._default_timeout() == 2.5
    for bad in ("soon", "0", "inf", "nan", ""):
        monkeypatch.setenv(communicator.TIMEOUT_ENV, bad)
        with pytest.raises(SettingsError, match=f"PCIE_AR_TIMEOUT_S={bad!r}"):
            communicator._default_timeout()


@pytest.mark.parametrize("value", ["\u00b2", "\u0664", "2.0", "two", "0", "-1"])
def test_the_emulated_nodes_setting_names_the_variable(value: str) -> None:
    """"²" and "٤" pass str.isdigit(); int() then fails (or reads an Arabic-Indic digit)."""
    with pytest.raises(SettingsError, match=f"PCIE_AR_NODES={value!r}"):
        nodes.emulated_nodes({"PCIE_AR_NODES": value})


@pytest.mark.parametrize("value", ["0-\u00b9;2-3", "\u0660-1;2-3"])
def test_the_islands_setting_takes_ascii_ranks_only(value: str) -> None:
    from pcie_allreduce.fabric import topology

    with pytest.raises(ValueError, match=f"PCIE_AR_ISLANDS={value!r}: .* is not a rank or a range of ranks"):
        topology.islands_override(4, {"PCIE_AR_ISLANDS": value})


# Hand-rolled readings of a variable: int()/float() of a raw value, or a comparison with "1".
_BY_HAND = (re.compile(r"\b(int|float)\(\s*os\.environ"), re.compile(r"\b(int|float)\([^)]*environ\.get\("),
            re.compile(r"""environ\.get\([^)]*\)(\.strip\(\))?(\.lower\(\))?\s*[=!]=\s*["']1["']"""))
# The spawner's own word to the ranks it starts ("0" or "1", never a user's): not a setting.
_NOT_SETTINGS = ("os.environ.get(MPS_ENV_VAR) == \"1\"",)


def test_no_setting_is_parsed_by_hand() -> None:
    """What the library, the plugin and the harness read from the environment they read through
    pcie_allreduce.settings (the one .pth line SGLang's interpreter runs cannot import it)."""
    found = []
    for package in ("pcie_allreduce", "sglang_plugin", "bench"):
        for folder, _, files in os.walk(os.path.join(REPO, package)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                for number, line in enumerate(open(path, encoding="utf-8"), 1):
                    if any(p.search(line) for p in _BY_HAND) and not any(n in line for n in _NOT_SETTINGS):
                        found.append(f"{os.path.relpath(path, REPO)}:{number}: {line.strip()}")
    assert found == [], "\n".join(found)
