"""Triton's CPU interpreter for the kernel tests, in a process of its own.

Triton picks its interpreter or its compiler when ``@triton.jit`` decorates a function (from
TRITON_INTERPRET, when a module is imported), Triton's own library functions (``tl.sum``, ...)
included; and running an interpreted kernel leaves builtins of ``triton.language`` re-bound
(``tl.core.load``, ``tl.core.where``: every Triton from 3.2 to 3.9; before 3.6 all of them), after
which that process can no longer compile a kernel. So the interpreter tests and the compiled
kernels cannot share a process, and TRITON_INTERPRET=1 for a whole run would send the GPU tests'
kernels through the interpreter too.

Instead the tests marked :data:`interpreted` run, in a run without TRITON_INTERPRET=1, in one
child pytest with TRITON_INTERPRET=1, started in the background when collection ends
(tests/conftest.py), so that on a machine of few cores the interpreter and the rest of the run
overlap; each interpreted test then reports the child's outcome and the child's time for it. A
run with TRITON_INTERPRET=1 runs them in place.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Sequence

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
#: Marks a test (or, as ``pytestmark``, a module) whose kernels must run under the interpreter.
interpreted = pytest.mark.interpreted
CHILD_TIMEOUT_S = 1800


def interpreting() -> bool:
    """Whether this process runs Triton's interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


Outcome = tuple[str, str, float]  # ("passed" | "skipped" | "failed", message, seconds in the child)


class Child:
    """The interpreted child pytest, running in the background; :meth:`finish` waits for it."""

    def __init__(self, node_ids: Sequence[str], process: subprocess.Popen, tmp: tempfile.TemporaryDirectory,
                 report: str) -> None:
        self.node_ids = list(node_ids)
        self._process = process
        self._tmp = tmp
        self._report = report
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, node_ids: Sequence[str], rootdir: str | os.PathLike = REPO_ROOT) -> "Child":
        """Start the child on ``node_ids`` (relative to ``rootdir``, the run's) and return at once."""
        tmp = tempfile.TemporaryDirectory()
        report = os.path.join(tmp.name, "interpreted.xml")
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
        # Quiet: its failures come back through the report, each in full on the test it belongs to;
        # its terminal output only gives the summary line, or the tail of a child that crashed.
        command = [sys.executable, "-m", "pytest", "-q", "--tb=short", "-p", "no:cacheprovider", "-p", "no:randomly",
                   f"--rootdir={rootdir}", f"--junitxml={report}", *node_ids]
        process = subprocess.Popen(command, cwd=rootdir, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        return cls(node_ids, process, tmp, report)

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            self._lines.append(line.rstrip("\n"))

    def running(self) -> bool:
        """Whether the child is still at work."""
        return self._reader.is_alive()

    def finish(self) -> dict[str, Outcome]:
        """Wait for the child (at most CHILD_TIMEOUT_S from now); the outcome of each node id."""
        self._reader.join(timeout=CHILD_TIMEOUT_S)
        if self._reader.is_alive():
            self.stop()
            self._lines.append(f"(the child did not finish within {CHILD_TIMEOUT_S} s)")
        self._process.wait()
        outcomes = _outcomes(self._report) if os.path.exists(self._report) else {}
        self._tmp.cleanup()
        tail = "\n".join(self._lines[-60:])
        missing: Outcome = ("failed", f"the interpreter child did not report this test; its output ended with:\n{tail}",
                            0.0)
        return {node: outcomes.get(_junit_key(node), missing) for node in self.node_ids}

    def summary(self) -> str:
        """The child's closing line ("86 passed in 58.83s"), or why there is none."""
        return summary_line(self._lines) or f"no summary (exit {self._process.poll()}); see the failures below"

    def stop(self) -> None:
        """Kill the child if it still runs (a run that ends before reaching its tests)."""
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


def summary_line(lines: Sequence[str]) -> str | None:
    """pytest's closing line among ``lines`` ("3 passed, 1 skipped in 4.20s"), without its rule."""
    for line in reversed(lines):
        text = re.sub(r"\x1b\[[0-9;]*m", "", line).strip().strip("=").strip()  # a FORCE_COLOR run's colours
        if re.fullmatch(r"(no tests ran|\d+ \w+(, \d+ \w+)*) in [\d.]+s( \(\d+:\d\d:\d\d\))?", text):
            return text
    return None


def _junit_key(node_id: str) -> tuple[str, str]:
    """A pytest node id as the (classname, name) pair its junit XML testcase carries."""
    path, *parts = node_id.split("::")
    classname = ".".join([path.removesuffix(".py").replace("/", "."), *parts[:-1]])
    return classname, parts[-1]


def _outcomes(report: str) -> dict[tuple[str, str], Outcome]:
    outcomes: dict[tuple[str, str], Outcome] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        key = (case.get("classname", ""), case.get("name", ""))
        problem = next((c for c in case if c.tag in ("failure", "error")), None)
        skipped = case.find("skipped")
        seconds = float(case.get("time") or 0.0)
        if problem is not None:
            outcomes[key] = ("failed", (problem.get("message") or "") + "\n" + (problem.text or ""), seconds)
        elif skipped is not None:
            outcomes[key] = ("skipped", skipped.get("message") or "skipped in the interpreter child", seconds)
        else:
            outcomes[key] = ("passed", "", seconds)
    return outcomes
