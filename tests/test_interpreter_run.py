"""The interpreter tests (tests/_interpreted.py's INTERPRETER_TESTS) in a child pytest with
TRITON_INTERPRET=1, so that a plain ``python -m pytest tests`` runs them under Triton's CPU
interpreter while every other test of the run keeps the compiled kernels."""

from __future__ import annotations

import re

import pytest

from tests._interpreted import INTERPRETER_TESTS, run_interpreter_tests

protocol = pytest.importorskip("pcie_allreduce.triton_protocol")


@pytest.mark.skipif(protocol.interpreting(), reason="this run interprets: the interpreter tests run in it directly")
def test_interpreter_tests_pass_in_an_interpreted_child() -> None:
    child = run_interpreter_tests()
    summary = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else "(no output)"
    assert child.returncode == 0, f"interpreter tests failed in the child (exit {child.returncode}):\n{child.stdout}"
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, (
        f"every interpreter test must run in the child: {summary}\n{child.stdout}")
    print(f"{len(INTERPRETER_TESTS)} interpreter test paths in a child: {summary}")
