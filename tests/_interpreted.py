"""Triton's CPU interpreter for the kernel tests, in a process of its own.

Triton picks its interpreter or its compiler when ``@triton.jit`` decorates a function (from
TRITON_INTERPRET, when a module is imported), Triton's own library functions (``tl.sum``, ...)
included; and running an interpreted kernel leaves builtins of ``triton.language`` re-bound
(``tl.core.load``, ``tl.core.where``: every Triton from 3.2 to 3.9; before 3.6 all of them), after
which that process can no longer compile a kernel. So the interpreter tests and the compiled
kernels cannot share a process, and TRITON_INTERPRET=1 for a whole run would send the GPU tests'
kernels through the interpreter too.

Instead the tests marked :data:`interpreted` run, in a run without TRITON_INTERPRET=1, in one
child pytest with TRITON_INTERPRET=1 (tests/conftest.py starts it at the first such test, streams
its progress, one line per test, and reports each test with the child's outcome: they count as
what they did); a run with TRITON_INTERPRET=1 runs them in place.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Callable, Sequence

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
#: Marks a test (or, as ``pytestmark``, a module) whose kernels must run under the interpreter.
interpreted = pytest.mark.interpreted
CHILD_TIMEOUT_S = 1800


def interpreting() -> bool:
    """Whether this process runs Triton's interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


Outcome = tuple[str, str]  # ("passed" | "skipped" | "failed", message)


def run_in_child(node_ids: Sequence[str], progress: Callable[[str], None]) -> dict[str, Outcome]:
    """Run ``node_ids`` in a child pytest with TRITON_INTERPRET=1, from the repository root,
    passing each line of its output (one per test) to ``progress``; the outcome of each node id."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "interpreted.xml")
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "pytest", "-v", "--tb=short", "-p", "no:cacheprovider", "-p", "no:randomly",
                   f"--junitxml={report}", *node_ids]
        lines: list[str] = []
        try:
            with subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) as child:
                assert child.stdout is not None
                for line in child.stdout:
                    lines.append(line)
                    progress(line.rstrip("\n"))
                child.wait(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            lines.append(f"(the child did not finish within {CHILD_TIMEOUT_S} s)\n")
        outcomes = _outcomes(report) if os.path.exists(report) else {}
    tail = "".join(lines[-60:])
    missing: Outcome = ("failed", f"the interpreter child did not report this test; its output ended with:\n{tail}")
    return {node: outcomes.get(_junit_key(node), missing) for node in node_ids}


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
        if problem is not None:
            outcomes[key] = ("failed", (problem.get("message") or "") + "\n" + (problem.text or ""))
        elif skipped is not None:
            outcomes[key] = ("skipped", skipped.get("message") or "skipped in the interpreter child")
        else:
            outcomes[key] = ("passed", "")
    return outcomes
