"""CPU tests of the settings: every boolean, size, integer and seconds setting of the library,
the plugin and the benchmark harness goes through :mod:`pcie_allreduce.settings`, so the same
spelling means the same everywhere and a bad value is a SettingsError naming the variable."""

from __future__ import annotations

import ast
import os
import re

import pytest
import torch

from pcie_allreduce import rendezvous, settings
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
    monkeypatch.setenv(rendezvous.PDL_ENV, value)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert rendezvous.dependent_launch(torch.device("cuda", 0)) is on


def test_a_dependent_launch_value_that_is_no_boolean_names_the_variable(monkeypatch) -> None:
    monkeypatch.setenv(rendezvous.PDL_ENV, "sure")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(SettingsError, match="PCIE_AR_PDL='sure': expected 1 or 0"):
        rendezvous.dependent_launch(torch.device("cuda", 0))


def test_the_timeout_setting_names_the_variable(monkeypatch) -> None:
    monkeypatch.setenv(rendezvous.TIMEOUT_ENV, "2.5")
    assert rendezvous.default_timeout() == 2.5
    for bad in ("soon", "0", "inf", "nan", ""):
        monkeypatch.setenv(rendezvous.TIMEOUT_ENV, bad)
        with pytest.raises(SettingsError, match=f"PCIE_AR_TIMEOUT_S={bad!r}"):
            rendezvous.default_timeout()


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


# Variables of other programs, read as those programs define them (not settings of ours): the
# spawner's word to the ranks it starts ("0" or "1", never a user's), CMake's generator name, MPS's
# active-thread percentage (a number as MPS reads it; one that is not stays MPS's to refuse).
_FOREIGN = {("pcie_allreduce/tools/ranks.py", "MPS_ENV_VAR"), ("setup.py", 'generator == "Ninja"'),
            ("pcie_allreduce/tools/mps.py", "float(current)")}
# Where the environment is read: every module of the library, both plugins, the harness, the build.
_READERS = ("pcie_allreduce", "sglang_plugin", "vllm_plugin", "bench", "setup.py")


def _reads_environment(node: ast.AST) -> bool:
    """``node`` contains ``environ.get(..)`` / ``env.get(..)`` / ``environ[..]`` / ``getenv(..)``."""
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            owner = n.func.value
            if n.func.attr == "getenv" or (n.func.attr == "get" and getattr(owner, "attr", getattr(owner, "id", ""))
                                           in ("environ", "env")):
                return True
        if isinstance(n, ast.Subscript) and getattr(n.value, "attr", getattr(n.value, "id", "")) == "environ":
            return True
    return False


def _parsed_by_hand(tree: ast.AST) -> list[int]:
    """Lines where a value read from the environment (directly, or through a name assigned from
    it in the same function, after strip/lower) goes to ``int()``/``float()``, ``.isdigit()``, an
    ``in (...)`` test or a comparison with a string: what the one parser exists to do."""
    found = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))):
        tainted = {t.id for n in ast.walk(fn) if isinstance(n, ast.Assign) and _reads_environment(n.value)
                   for t in n.targets if isinstance(t, ast.Name)}

        def from_env(e: ast.AST) -> bool:
            if isinstance(e, ast.Name):
                return e.id in tainted
            if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr in ("strip", "lower"):
                return from_env(e.func.value)
            return isinstance(e, (ast.Call, ast.Subscript)) and _reads_environment(e)

        for n in ast.walk(fn):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("int", "float")
                    and n.args and from_env(n.args[0])):
                found.append(n.lineno)
            elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                  and n.func.attr in ("isdigit", "isdecimal", "isnumeric") and from_env(n.func.value)):
                found.append(n.lineno)
            elif isinstance(n, ast.Compare) and from_env(n.left) and any(
                    (isinstance(op, (ast.In, ast.NotIn)) and isinstance(c, (ast.Tuple, ast.List, ast.Set)))
                    or (isinstance(op, (ast.Eq, ast.NotEq)) and isinstance(c, ast.Constant) and isinstance(c.value, str))
                    for op, c in zip(n.ops, n.comparators)):
                found.append(n.lineno)
    return sorted(set(found))


def _environment_readers() -> list[str]:
    paths = []
    for package in _READERS:
        root = os.path.join(REPO, package)
        if package.endswith(".py"):
            paths.append(root)
            continue
        paths += [os.path.join(folder, name) for folder, _, names in os.walk(root) for name in names
                  if name.endswith(".py")]
    return paths


def test_no_setting_is_parsed_by_hand() -> None:
    """What the library, both plugins, the harness and the build read from the environment they
    read through pcie_allreduce.settings (the one .pth line SGLang's interpreter runs cannot import it)."""
    found = []
    for path in _environment_readers():
        text = open(path, encoding="utf-8").read()
        lines = text.splitlines()
        where = os.path.relpath(path, REPO)
        for number in _parsed_by_hand(ast.parse(text, path)):
            line = lines[number - 1].strip()
            enclosing = [ln for ln in lines[:number] if ln.lstrip().startswith("def ")][-1:]
            if any(where == f and (marker in line or any(marker in e for e in enclosing)) for f, marker in _FOREIGN):
                continue
            found.append(f"{where}:{number}: {line}")
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("source", [
    "def f():\n    v = os.environ.get('X', '').strip()\n    return v.isdigit()\n",
    "def f(env):\n    return env.get('X', '').strip().lower() in ('0', 'off')\n",
    "def f():\n    return int(os.environ['X'])\n",
    "def f():\n    raw = os.getenv('X')\n    return raw == '1'\n",
])
def test_the_guard_finds_a_setting_parsed_by_hand(source: str) -> None:
    assert _parsed_by_hand(ast.parse(source))


def test_the_guard_reads_every_file_that_reads_the_environment() -> None:
    readers = {os.path.relpath(p, REPO).split(os.sep)[0] for p in _environment_readers()
               if re.search(r"\benviron\b|getenv\(", open(p, encoding="utf-8").read())}
    assert {"pcie_allreduce", "sglang_plugin", "vllm_plugin", "bench", "setup.py"} <= readers


def test_the_transport_setting_is_a_settings_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from pcie_allreduce import transport

    monkeypatch.setenv(transport.ENV, "nvlink")
    with pytest.raises(SettingsError, match=transport.ENV):
        transport.requested(None)
    monkeypatch.setenv(transport.ENV, " HOST ")
    assert transport.requested(None) == "host"
