"""Tests marked ``interpreted`` (tests/_interpreted.py): in a run without TRITON_INTERPRET=1 they
run in one interpreted child, started in the background as soon as collection ends, so it works
while this process runs the other tests; they are moved to the end of the run, where each reports
the child's outcome for it (a failure in full), with the child's own time for it (``--durations``
shows where the time went), after one line with the child's summary."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest

from tests import _interpreted

_CHILD = pytest.StashKey[_interpreted.Child]()
_OUTCOMES = pytest.StashKey[dict]()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # pytest-benchmark times only where asked (--benchmark-enable or --benchmark-only): an
    # ordinary run calls a benchmarked function once, checks it, and prints no timing table.
    if hasattr(config.option, "benchmark_disable") and not (config.option.benchmark_enable
                                                            or config.option.benchmark_only):
        config.option.benchmark_disable = True
    config.addinivalue_line("markers", "interpreted: the test's kernels run under Triton's CPU interpreter "
                                       "(in a TRITON_INTERPRET=1 child unless this run sets it)")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[Any]) -> None:
    """Interpreted tests last, so the child (started at the end of collection) overlaps the rest."""
    if _interpreted.interpreting():
        return
    items[:] = ([item for item in items if item.get_closest_marker("interpreted") is None]
                + [item for item in items if item.get_closest_marker("interpreted") is not None])


def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    selected = [item.nodeid for item in session.items if item.get_closest_marker("interpreted")]
    if selected and not _interpreted.interpreting() and not config.option.collectonly:
        config.stash[_CHILD] = _interpreted.Child.start(selected, config.rootpath)


def pytest_unconfigure(config: pytest.Config) -> None:
    child = config.stash.get(_CHILD, None)
    if child is not None:
        child.stop()  # a run stopped early (-x, Ctrl-C) leaves no child behind


def _show(config: pytest.Config, line: str) -> None:
    """A line about the interpreter child on the terminal now (past this test's output capture)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None:
        return
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        if getattr(reporter._tw, "width_of_current_line", 0):  # after progress dots: a line of its own
            reporter.write("\n")
        reporter.write_line(f"[interpreter child] {line}")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if pyfuncitem.get_closest_marker("interpreted") is None or _interpreted.interpreting():
        return None  # an ordinary test, or an interpreted run: the test runs here
    config = pyfuncitem.config
    if _OUTCOMES not in config.stash:
        child = config.stash[_CHILD]
        n = len(child.node_ids)
        what = f"{n} test{'s' if n != 1 else ''} under TRITON_INTERPRET=1, run beside this one"
        if child.running():
            _show(config, f"{what}: waiting for {'them' if n != 1 else 'it'} ...")
        config.stash[_OUTCOMES] = child.finish()
        _show(config, f"{what}: {child.summary()}")
    outcome, message, _ = config.stash[_OUTCOMES][pyfuncitem.nodeid]
    if outcome == "skipped":
        pytest.skip(message)
    if outcome != "passed":
        pytest.fail(f"in the interpreter child: {message}", pytrace=False)
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """An interpreted test's call takes the child's time for it, not this process's wait."""
    outcome = yield
    if call.when != "call" or item.get_closest_marker("interpreted") is None:
        return
    outcomes = item.config.stash.get(_OUTCOMES, None)
    if outcomes and item.nodeid in outcomes:
        outcome.get_result().duration = outcomes[item.nodeid][2]


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Where the skip reasons are, when the run's options do not print them; and one line per engine
    plugin's conformance tests: how many ran, and what the skipped ones need."""
    skipped = terminalreporter.stats.get("skipped", [])
    if skipped and not any(char in (config.option.reportchars or "") for char in "sSaA"):
        terminalreporter.write_line(f"{len(skipped)} skipped: add -rs for each reason (mostly: no GPU here)")
    for engine, tag in (("SGLang", "sglang"), ("vLLM", "vllm")):
        counts = {}
        for outcome in ("passed", "failed", "skipped", "error"):
            counts[outcome] = sum(1 for report in terminalreporter.stats.get(outcome, [])
                                  if getattr(report, "when", "call") in ("call", "setup")
                                  and f"tests/test_{tag}" in getattr(report, "nodeid", ""))
        if not any(counts.values()):
            continue
        line = f"{engine} plugin tests: " + ", ".join(f"{n} {outcome}" for outcome, n in counts.items() if n)
        if counts["skipped"]:
            line += f" ({_engine_skip_reason(engine, tag)})"
        terminalreporter.write_line(line)


def _engine_skip_reason(engine: str, tag: str) -> str:
    """What an engine plugin's skipped tests need: the engine's modules (docs/guide.md's line for it), or a GPU."""
    from tests import _sglang, _vllm

    missing = (_sglang.sglang_skip_reason if tag == "sglang" else _vllm.vllm_skip_reason)()
    if missing is not None:
        return f"skipped ones need {engine}'s modules: docs/guide.md's '# {tag}.' line; or a GPU"
    return "skipped ones need a GPU"
