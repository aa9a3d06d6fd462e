"""The interpreter child (tests/_interpreted.py, tests/conftest.py) as a person running the tests
sees it: one summary line on the terminal, each failure in full on the test it belongs to."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._interpreted import REPO_ROOT, summary_line


@pytest.mark.parametrize("lines,want", [
    (["....", "86 passed in 58.83s"], "86 passed in 58.83s"),
    (["F.s", "=== 1 failed, 1 passed, 1 skipped, 2 warnings in 301.20s (0:05:01) ==="],
     "1 failed, 1 passed, 1 skipped, 2 warnings in 301.20s (0:05:01)"),
    (["\x1b[32m3 passed\x1b[0m\x1b[32m in 1.00s\x1b[0m", "trailing noise"], "3 passed in 1.00s"),
    (["no tests ran in 0.01s"], "no tests ran in 0.01s"),
    (["Traceback (most recent call last):", "Killed"], None),
])
def test_summary_line_is_pytests_closing_line(lines: list[str], want: str | None) -> None:
    assert summary_line(lines) == want


def test_the_child_shows_one_line_and_its_failures_in_full(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.conftest"]\n')
    (tmp_path / "test_child.py").write_text(textwrap.dedent("""
        import os

        from tests._interpreted import interpreted

        pytestmark = interpreted


        def test_runs_interpreted():
            assert os.environ.get("TRITON_INTERPRET") == "1"


        def test_fails_in_the_child():
            got = 6 * 7
            assert got == 41, "the child's own message"


        def test_not_interpreted_here():
            pass
    """))
    (tmp_path / "test_plain.py").write_text("def test_here():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                          str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    child_lines = [line for line in text.splitlines() if line.startswith("[interpreter child]")]
    assert child_lines[-1].startswith("[interpreter child] 3 tests under TRITON_INTERPRET=1, run beside this one: "
                                      "1 failed, 2 passed in "), text
    assert len(child_lines) <= 2 and all("waiting for them" in line for line in child_lines[:-1]), text
    # The failure, reported on its own test, with the child's assertion and its values.
    assert "FAILED test_child.py::test_fails_in_the_child" in text, text
    assert "in the interpreter child" in text and "the child's own message" in text and "assert 42 == 41" in text
    assert "1 failed, 3 passed" in text.splitlines()[-1], text


def test_the_statistics_special_values_raise_no_warning() -> None:
    """The interpreted statistic's special values run clean with RuntimeWarnings as errors (the
    test's filter names the two warnings of the arithmetic the kernel discards, and nothing else)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error::RuntimeWarning",
                          "tests/test_add_rmsnorm_interpreter.py::test_statistic_special_values"],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
