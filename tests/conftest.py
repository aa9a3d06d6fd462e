"""Tests marked ``interpreted`` (tests/_interpreted.py): in a run without TRITON_INTERPRET=1 the
first of them starts one interpreted child for all of them (those this run selected), whose
progress is printed as it goes; each then reports the child's outcome for it."""

from __future__ import annotations

from typing import Any

import pytest

from tests import _interpreted

# The child's session header and report file line, not repeated on the terminal.
_CHILD_HEADER = ("platform ", "benchmark: ", "rootdir: ", "configfile: ", "plugins: ", "cachedir: ")
_CHILD_NOISE = ("test session starts", "generated xml file")
_SELECTED = pytest.StashKey[list]()
_OUTCOMES = pytest.StashKey[dict]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "interpreted: the test's kernels run under Triton's CPU interpreter "
                                       "(in a TRITON_INTERPRET=1 child unless this run sets it)")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[Any]) -> None:
    config.stash[_SELECTED] = [item.nodeid for item in items if item.get_closest_marker("interpreted")]


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if pyfuncitem.get_closest_marker("interpreted") is None or _interpreted.interpreting():
        return None  # an ordinary test, or an interpreted run: the test runs here
    config = pyfuncitem.config
    if _OUTCOMES not in config.stash:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        capture = config.pluginmanager.get_plugin("capturemanager")
        selected = config.stash[_SELECTED]

        def progress(line: str) -> None:
            """One line of the child's output on the terminal now (past this test's output capture)."""
            if (reporter is None or not line.strip() or line.startswith(_CHILD_HEADER)
                    or any(noise in line for noise in _CHILD_NOISE)):
                return
            if capture is None:
                reporter.write_line(f"[interpreter child] {line}")
                return
            with capture.global_and_fixture_disabled():
                reporter.write_line(f"[interpreter child] {line}")

        progress(f"running {len(selected)} tests under TRITON_INTERPRET=1")
        config.stash[_OUTCOMES] = _interpreted.run_in_child(selected, progress)
    outcome, message = config.stash[_OUTCOMES][pyfuncitem.nodeid]
    if outcome == "skipped":
        pytest.skip(message)
    if outcome != "passed":
        pytest.fail(f"in the interpreter child: {message}", pytrace=False)
    return True


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """One line on the SGLang plugin's conformance tests: how many ran, and how to run the rest
    (they skip where SGLang is not importable)."""
    counts = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        counts[outcome] = sum(1 for report in terminalreporter.stats.get(outcome, [])
                              if getattr(report, "when", "call") in ("call", "setup")
                              and "tests/test_sglang" in getattr(report, "nodeid", ""))
    if not any(counts.values()):
        return
    line = "SGLang plugin tests: " + ", ".join(f"{n} {outcome}" for outcome, n in counts.items() if n)
    if counts["skipped"]:
        line += " (skipped ones need SGLang's modules, or a GPU: README.md, '# sglang.' one-liner)"
    terminalreporter.write_line(line)
