"""The figures the READMEs give that the code computes: the workspace memory formula and the
SGLang plugin's example log line, checked against the layout and the log line's own code."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest

from pcie_allreduce import dispatch
from pcie_allreduce.algo import default_table
from pcie_allreduce.constants import LOW_LATENCY_MAX_BYTES
from pcie_allreduce.layout import Layout

ROOT = Path(__file__).resolve().parents[1]
FORMULA = "2*W*(max_bytes + 3*min(max_bytes, 512 KiB))"
PLUGIN_FORMULA = "2 x W x (`MAX_BYTES` + 3 x min(`MAX_BYTES`, 512 KiB))"


def _formula(max_bytes: int, world: int) -> int:
    return 2 * world * (max_bytes + 3 * min(max_bytes, LOW_LATENCY_MAX_BYTES))


def test_readmes_give_the_workspace_formula() -> None:
    assert LOW_LATENCY_MAX_BYTES == 512 << 10, "the READMEs' formula names 512 KiB"
    assert FORMULA in (ROOT / "README.md").read_text()
    assert PLUGIN_FORMULA in (ROOT / "sglang_plugin" / "README.md").read_text()


@pytest.mark.parametrize("max_bytes", [64 << 10, 1 << 20, 8 << 20, 64 << 20])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_the_workspace_formula_is_the_layouts(max_bytes: int, world: int) -> None:
    """The formula covers the data slots, the lines and the full-payload slots; the flags,
    control and statistics words add well under 1 MiB."""
    total = Layout.make(max_bytes, world).total_bytes
    assert 0 <= total - _formula(max_bytes, world) < 1 << 20


def test_the_plugins_example_log_line_is_what_the_code_prints() -> None:
    """sglang_plugin/README.md's example line (W = 8, 8 MiB): its algorithm ranges and workspace
    figures are what the log line's own functions give for the built-in table."""
    logline = pytest.importorskip("sglang_plugin.logline")
    max_bytes, world = 8 << 20, 8
    layout = Layout.make(max_bytes, world)
    table = default_table()
    comm = types.SimpleNamespace(select_algo=lambda nbytes, dtype: dispatch.plain_choice(
        nbytes, world, dtype, table, ll_capacity=layout.ll_capacity).algo)
    text = (ROOT / "sglang_plugin" / "README.md").read_text()
    example = next(line for line in text.splitlines() if line.startswith("pcie_allreduce[sglang] rank 3/8"))
    assert f"(auto: {logline.algorithm_ranges(comm, max_bytes)} for bf16)" in example
    assert logline.workspace_memory(max_bytes, world) in example
    per_stream = int(re.search(r"W=8: (\d+) MiB per stream", text).group(1))
    assert per_stream == round(layout.total_bytes / 2**20)


def test_readme_gives_the_driver_each_runtime_needs() -> None:
    """README's driver requirements are the ones the extension's loader checks."""
    from pcie_allreduce import _ext

    readme = (ROOT / "README.md").read_text()
    for floor, branch in _ext._MIN_DRIVER_FOR_RUNTIME:
        version = f"{floor // 1000}.{floor % 1000 // 10}"
        assert re.search(rf"{re.escape(version)} needs\s+(driver\s+)?{branch}", readme), (version, branch)


def test_bench_readme_gives_the_algos_default_and_the_sleep() -> None:
    """bench/README.md's `--algos` default is the harness's, and its GPU sleep the timing code's."""
    from bench import timing
    from bench.options import DEFAULT_OUR_ALGOS

    text = (ROOT / "bench" / "README.md").read_text()
    assert f"| `--algos` | `{' '.join(DEFAULT_OUR_ALGOS)}` |" in text
    sleep_us = round(timing.SLEEP_CYCLES / 2e9 * 1e6, -1)  # cycles at ~2 GHz, as bench/timing.py says
    assert f"~{sleep_us:.0f} us GPU sleep" in text
