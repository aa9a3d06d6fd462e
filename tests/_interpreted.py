"""Triton's CPU interpreter for the kernel tests, in a process of its own.

Triton picks its interpreter or its compiler when ``@triton.jit`` decorates a function (from
TRITON_INTERPRET, when a module is imported), Triton's own library functions (``tl.sum``, ...)
included; and running an interpreted kernel leaves builtins of ``triton.language`` re-bound
(``tl.core.load``, ``tl.core.where``: every Triton from 3.2 to 3.9; before 3.6 all of them), after
which that process can no longer compile a kernel. So the interpreter tests and the compiled
kernels cannot share a process, and TRITON_INTERPRET=1 for a whole run would send the GPU tests'
kernels through the interpreter too.

Instead a run without TRITON_INTERPRET skips :data:`INTERPRETER_TESTS` and runs them once in a
child pytest with TRITON_INTERPRET=1 (tests/test_interpreter_run.py); a run with
TRITON_INTERPRET=1 runs them in place, as before.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# Test files and test ids (relative to REPO_ROOT) that need their kernels interpreted.
INTERPRETER_TESTS = (
    "tests/test_fused_interpreter.py",
    "tests/test_fused_ll_interpreter.py",
    "tests/test_add_rmsnorm_interpreter.py",
    "tests/test_bench_topo.py::test_push_kernel_copies_a_slice_to_every_peer",
    "tests/test_bench_topo.py::test_pingpong_and_fill_kernels",
)
CHILD_TIMEOUT_S = 1800
# Why INTERPRETER_TESTS skip in a run without TRITON_INTERPRET=1.
NOT_INTERPRETED = "needs Triton's interpreter: runs in a TRITON_INTERPRET=1 child (tests/test_interpreter_run.py)"


def run_interpreter_tests() -> subprocess.CompletedProcess[str]:
    """``python -m pytest INTERPRETER_TESTS`` in a child process with TRITON_INTERPRET=1, from the
    repository root; its output (stdout and stderr together) in ``stdout``."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-rfEs", "--tb=short", "-p", "no:cacheprovider", *INTERPRETER_TESTS]
    return subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=CHILD_TIMEOUT_S, check=False)
