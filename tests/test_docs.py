"""What the READMEs say that the code computes or reads, checked against that code: the workspace
memory formula, the SGLang plugin's example log line and settings table, the environment
variables they name, README's default-table ranges, limits and "Measured" rows (against
bench/RESULTS.md), the soak's schedule, and the package data pyproject.toml lists."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest

from pcie_allreduce.plan import dispatch
from pcie_allreduce.plan.tables import default_table
from pcie_allreduce.constants import LOW_LATENCY_MAX_BYTES
from pcie_allreduce.layout import Layout

ROOT = Path(__file__).resolve().parents[1]
FORMULA = "(2*W + 1)*max_bytes + 6*W*min(max_bytes, 512 KiB)"
PLUGIN_FORMULA = "(2 x W + 1) x `MAX_BYTES` + 6 x W x min(`MAX_BYTES`, 512 KiB)"


def _formula(max_bytes: int, world: int) -> int:
    return (2 * world + 1) * max_bytes + 6 * world * min(max_bytes, LOW_LATENCY_MAX_BYTES)


def test_readmes_give_the_workspace_formula() -> None:
    assert LOW_LATENCY_MAX_BYTES == 512 << 10, "the READMEs' formula names 512 KiB"
    assert FORMULA in _user_docs()
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
    from pcie_allreduce import plugin_logline as logline

    max_bytes, world = 8 << 20, 8
    layout = Layout.make(max_bytes, world)
    table = default_table()
    comm = types.SimpleNamespace(select_algo=lambda nbytes, dtype: dispatch.plain_choice(
        nbytes, world, dtype, table, ll_capacity=layout.ll_capacity).algo)
    text = (ROOT / "sglang_plugin" / "README.md").read_text()
    example = next(line for line in text.splitlines() if line.startswith("pcie_allreduce[sglang] rank 3/8"))
    assert f"(auto: {logline.algorithm_ranges(comm, max_bytes)} for bf16)" in example
    assert logline.workspace_memory(max_bytes, world, "p2p", "SGLang", "PCIE_AR_SGLANG_MAX_BYTES") in example
    per_stream = int(re.search(r"W=8: (\d+) MiB per stream", text).group(1))
    assert per_stream == round(layout.total_bytes / 2**20)


def test_readme_gives_the_driver_each_runtime_needs() -> None:
    """README's driver requirements are the ones the extension's loader checks."""
    from pcie_allreduce import _ext

    readme = _user_docs()
    for floor, branch in _ext._MIN_DRIVER_FOR_RUNTIME:
        version = f"{floor // 1000}.{floor % 1000 // 10}"
        assert re.search(rf"{re.escape(version)} needs\s+(driver\s+)?{branch}", readme), (version, branch)


def test_bench_readme_gives_the_algos_default_and_the_sleep() -> None:
    """bench/README.md's `--algos` default is the harness's, and its GPU sleep the timing code's."""
    from bench.options import DEFAULT_OUR_ALGOS
    from pcie_allreduce.tools import timing

    text = (ROOT / "bench" / "README.md").read_text()
    assert f"| `--algos` | `{' '.join(DEFAULT_OUR_ALGOS)}` |" in text
    sleep_us = round(timing.SLEEP_CYCLES / 2e9 * 1e6, -1)  # cycles at ~2 GHz, as the timer says
    assert f"~{sleep_us:.0f} us GPU sleep" in text


# ------------------------------------------------------------------ environment variables

ENV_NAME = re.compile(r"\bPCIE_AR_[A-Z0-9_]*[A-Z0-9]\b")
SOURCE_DIRS = ("pcie_allreduce", "sglang_plugin", "vllm_plugin", "bench")
TEST_ONLY_PREFIXES = ("PCIE_AR_TEST_", "PCIE_AR_REQUIRE_")


def _doc(path: str) -> str:
    return (ROOT / path).read_text()


def _user_docs() -> str:
    """README.md and the guide it links to for everything past the first screen."""
    return _doc("README.md") + "\n" + _doc("docs/guide.md")


def _flat(text: str) -> str:
    """Markdown text with its line breaks and runs of spaces as single spaces."""
    return re.sub(r"\s+", " ", text)


def _name_literals(files) -> set[str]:
    """String constants that are exactly an environment variable's name (keys the code reads or
    sets; a name inside a message or docstring does not count)."""
    import ast

    names: set[str] = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and ENV_NAME.fullmatch(node.value):
                names.add(node.value)
    return names


def _code_variables() -> set[str]:
    from sglang_plugin import settings
    from vllm_plugin import settings as vllm_settings

    files = [ROOT / "setup.py"] + [p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py")]
    return _name_literals(files) | set(settings.DOCS) | set(vllm_settings.DOCS)


@pytest.mark.parametrize("doc", ["README.md", "docs/guide.md", "bench/README.md", "sglang_plugin/README.md",
                                 "vllm_plugin/README.md"])
def test_every_variable_a_readme_names_is_read_by_the_code(doc: str) -> None:
    """Each PCIE_AR_* name in the READMEs is a key the library, the plugin, the harness or
    setup.py uses (the test suites' own switches: a key the tests use)."""
    named = set(ENV_NAME.findall(_doc(doc)))
    in_code = _code_variables()
    in_tests = _name_literals((ROOT / "tests").rglob("*.py"))
    unknown = sorted(n for n in named if n not in in_code
                     and not (n.startswith(TEST_ONLY_PREFIXES) and n in in_tests))
    assert not unknown, f"{doc} names variables no code reads: {unknown}"


def test_every_library_setting_is_documented() -> None:
    """The variables the library reads at run time are each named in README.md or bench/README.md."""
    from pcie_allreduce import _archs, rendezvous, transport
    from pcie_allreduce.plan import cache, tables

    docs = _user_docs() + _doc("bench/README.md")
    for name in (transport.ENV, tables.TABLE_ENV, rendezvous.TIMEOUT_ENV, cache.CACHE_ENV, _archs.ENV_VAR):
        assert f"`{name}" in docs or f"${name}" in docs, name


def _plugin_settings_rows() -> dict[str, tuple[str, str]]:
    """sglang_plugin/README.md's settings table: name -> (default, meaning)."""
    text = _doc("sglang_plugin/README.md")
    section = text[text.index("## Settings"):text.index("\n## ", text.index("## Settings") + 1)]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `(PCIE_AR_\w+)` \| `([^`]*)` \| (.*) \|$", line)
        if match:
            rows[match.group(1)] = (match.group(2), match.group(3))
    return rows


def test_plugin_settings_table_is_settings_py() -> None:
    """Every PCIE_AR_SGLANG_* setting in the table, with its default, and no other; the table's
    other rows are the library's variables, and the text says so."""
    from sglang_plugin import settings

    rows = _plugin_settings_rows()
    ours = {n: d for n, (d, _) in rows.items() if n.startswith(settings.PREFIX)}
    assert ours == {n: d for n, (d, _) in settings.DOCS.items()}
    assert settings.from_env(dict(ours)) == settings.Settings(), "a documented default is not the code's"
    library = sorted(set(rows) - set(ours))
    intro = _flat(_doc("sglang_plugin/README.md"))
    for name in library:
        assert name in _code_variables(), name
        assert f"`{name}` is the library's" in intro, f"the settings text must say {name} is the library's"


def test_plugin_settings_limits_are_the_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    from pcie_allreduce.constants import MAX_MESSAGE_BYTES, MAX_TIMEOUT_S
    from pcie_allreduce.plugin_settings import ALGOS
    from pcie_allreduce.transport import requested
    from sglang_plugin import settings

    rows = _plugin_settings_rows()
    assert f"at most `{MAX_MESSAGE_BYTES >> 20}MiB`" in rows[settings.MAX_BYTES][1]
    assert f"at most {MAX_TIMEOUT_S}" in rows[settings.TIMEOUT_S][1]
    assert f"{LOW_LATENCY_MAX_BYTES >> 10} KiB" in rows[settings.ALGO][1]
    for algo in ALGOS:
        assert f"`{algo}`" in rows[settings.ALGO][1], algo
    monkeypatch.delenv("PCIE_AR_TRANSPORT", raising=False)
    assert rows["PCIE_AR_TRANSPORT"][0] == requested(None)
    # "`1MiB` covers decode and verify with 40 MiB": the layout at W = 8.
    small = int(re.search(r"`1MiB` covers decode and verify with (\d+) MiB", rows[settings.MAX_BYTES][1]).group(1))
    assert small == round(Layout.make(1 << 20, 8).total_bytes / 2**20)


def test_plugin_memory_fraction_example() -> None:
    """'456 MiB of a 96 GB card is about 0.005': three streams of the W = 8, 8 MiB workspace."""
    from pcie_allreduce import plugin_logline as logline

    text = _flat(_doc("sglang_plugin/README.md"))
    match = re.search(r"\((\d+) MiB of a (\d+) GB card is about ([0-9.]+)\)", text)
    total = logline.TYPICAL_STREAMS * Layout.make(8 << 20, 8).total_bytes
    assert int(match.group(1)) == round(total / 2**20)
    assert float(match.group(3)) == round(total / (int(match.group(2)) * 1e9), 3)


# ------------------------------------------------------------------ README.md

def test_readme_gives_the_default_full_payload_range() -> None:
    """'by default above 4 KiB up to 512 KiB at W <= 4, 192 KiB above': the built-in table."""
    import torch

    table = default_table()

    def picks(world: int) -> list[int]:
        capacity = Layout.make(8 << 20, world).ll_capacity
        return [k for k in range(1, 1025) if dispatch.plain_choice(
            k << 10, world, torch.bfloat16, table, ll_capacity=capacity).algo == "oneshot_full"]

    ranges = {w: (min(picks(w)) - 1, max(picks(w))) for w in range(2, 9)}
    low = {lo for lo, _ in ranges.values()}
    small = {hi for w, (_, hi) in ranges.items() if w <= 4}
    large = {hi for w, (_, hi) in ranges.items() if w > 4}
    assert len(low) == len(small) == len(large) == 1, ranges
    expected = f"by default above {low.pop()} KiB up to {small.pop()} KiB at W <= 4, {large.pop()} KiB above"
    assert expected in _flat(_user_docs())


def test_readme_gives_the_communicators_limits() -> None:
    from pcie_allreduce import rendezvous
    from pcie_allreduce.fused import path as fused_path
    from pcie_allreduce.constants import MAX_MESSAGE_BYTES, MAX_TIMEOUT_S

    text = _flat(_user_docs())
    assert f"`max_bytes` up to {MAX_MESSAGE_BYTES >> 20} MiB" in text
    assert MAX_TIMEOUT_S == 24 * 3600 and "`timeout_s` / `PCIE_AR_TIMEOUT_S` up to a day" in text
    assert f"after `timeout_s` (default {rendezvous.DEFAULT_TIMEOUT_S:g} s)" in text
    assert f"reaches that meeting within {fused_path.FIRST_FUSED_CALL_WAIT_S} s" in text


def test_readme_measured_figures_are_in_results() -> None:
    """Every row of README's "Measured" tables has its figures on one row of bench/RESULTS.md
    (the same run's row), and each RESULTS.md section it names exists there."""
    readme = _doc("README.md")
    measured = readme[readme.index("## Measured"):readme.index("\n## ", readme.index("## Measured") + 1)]
    results = _doc("bench/RESULTS.md")

    def figures(line: str) -> set[str]:
        return set(re.findall(r"(?<![\d.])\d+\.\d+(?![\d.])", line))

    rows = [figures(line) for line in measured.splitlines() if line.startswith("|")]
    rows = [row for row in rows if row]
    assert len(rows) >= 6, "the Measured tables have no figures"
    result_rows = [figures(line) for line in results.splitlines() if line.startswith("|")]
    missing = [sorted(row) for row in rows if not any(row <= other for other in result_rows)]
    assert not missing, f"README rows whose figures are on no one row of bench/RESULTS.md: {missing}"
    headings = {h.strip() for h in re.findall(r"^#+ (.*)$", results, flags=re.MULTILINE)}
    for name in re.findall(r'RESULTS\.md, "([^"]+)"', _flat(measured)):
        assert name in headings, name


# ------------------------------------------------------------------ bench/README.md

def test_bench_readme_soak_schedule_figures() -> None:
    """The soak's straggler rates, late time, shapes and summary line as the code has them."""
    from bench import soak, soak_schedule

    params = soak_schedule.ScheduleParams(world=8, max_bytes=2 << 20, ll_capacity=512 << 10, block_cap=16)
    text = _flat(_doc("bench/README.md"))
    assert params.host_rate == params.stream_rate == 1 / 400 and "about 1 call in 400 each" in text
    assert f"about 1 call in {round(1 / params.late_rate):,}" in text
    low, high = soak_schedule.LATE_S
    assert f"a rank is {low:g}-{high:g} s late" in text and f"at least twice that ({2 * high:g} s)" in text
    assert f"on {soak_schedule.FUSED_SHAPES} shapes per seed" in text
    schedule = soak_schedule.Schedule(0, params)
    always, decode = schedule._fused_algos(64, 7168, "bfloat16"), schedule._fused_algos(4, 7168, "bfloat16")
    fused = re.search(r"Fused calls \(`all_reduce_rmsnorm`\): (.*?) where their launch shape exists", text).group(1)
    named = re.findall(r"`(\w+)`", fused)
    assert set(named) == {"auto", *decode}, "the soak's fused algorithms"
    assert all(a in fused.split(", and ")[0] for a in always), "the ones every shape takes come first"
    assert f"tokens 1..{soak_schedule.MAX_TOKENS}" in text
    assert f"`--max-bytes` ({soak.DEFAULT_MAX_BYTES})" in text
    # The example summary line is the W = 8 soak's in RESULTS.md, in format_summary's format.
    line = re.search(r"`(soak: W=\d+ calls=[^`]+)`", text).group(1)
    assert line in _flat(_doc("bench/RESULTS.md"))
    numbers = dict(re.findall(r"(\w+)[= ](\d+)", line))
    summary = {"world": int(numbers["W"]), "calls": int(numbers["calls"]), "plain": int(numbers["plain"]),
               "fused": int(numbers["fused"]), "in_graphs": int(re.search(r"in graphs (\d+)", line).group(1)),
               "calls_per_s": float(re.search(r"calls/s=(\d+)", line).group(1)), "wrong": int(numbers["wrong"]),
               "hung": int(numbers["hung"]), "elapsed_s": float(numbers["elapsed"]), "targets_met": True,
               "graphs": 0, "stragglers": 0, "counts": {}, "errors": [], "wrong_calls": []}
    assert soak.format_summary(summary).splitlines()[0] == line
    rate = int(re.search(r"at the ([\d,]+) calls/s", text).group(1).replace(",", ""))
    assert f"calls/s={rate}" in line
    every = int(re.search(r"every ~(\d+) s at the", text).group(1))
    assert every == round(1 / params.late_rate / rate, -1)


# ------------------------------------------------------------------ packaging

def test_package_data_files_exist() -> None:
    """Every file pyproject.toml lists as package data by name exists (py.typed: PEP 561)."""
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_data = config["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["pcie_allreduce"]
    for package, patterns in package_data.items():
        for pattern in patterns:
            if not any(c in pattern for c in "*?["):
                assert (ROOT / package.replace(".", "/") / pattern).is_file(), f"{package}/{pattern}"


def _named_in(rows: list[str], path: Path, top: Path) -> bool:
    """Whether a layout row names ``path``: by its path below ``top``, or by its name in a row that
    names its folder (a top-level file by its name anywhere)."""
    rel = path.relative_to(top)
    folder = rel.parent.as_posix()
    if folder == ".":
        return any(f"`{rel.name}`" in row for row in rows)
    return any(f"`{rel.as_posix()}`" in row or (f"`{folder}/`" in row and f"`{rel.name}`" in row) for row in rows)


def test_guide_layout_names_every_module_and_kernel_header() -> None:
    """The guide's layout lists what exists: every module of the library, in its folder, and every file of csrc/."""
    guide = _doc("docs/guide.md")
    rows = guide[guide.index("## Layout"):].splitlines()
    library = ROOT / "pcie_allreduce"
    files = [p for p in library.rglob("*.py") if p.name != "__init__.py"] + list((ROOT / "csrc").iterdir())
    missing = sorted(str(p.relative_to(ROOT)) for p in files
                     if not _named_in(rows, p, library if p.is_relative_to(library) else ROOT / "csrc"))
    assert not missing, f"docs/guide.md's layout does not name {missing}"


def test_readme_is_short() -> None:
    """The README is what the project is, the two commands, the headline figures and links;
    details live in docs/guide.md."""
    assert len(_doc("README.md").splitlines()) <= 100


# The wire-bytes column of docs/guide.md's algorithm table, per formula of the records: each is
# evaluated below against the formula itself, so the table cannot drift from the accounting.
WIRE_FORMULAS = {
    "_one_shot": "(W-1)N / (W-1)N",
    "_two_shot": "2(W-1)N/W / 2(W-1)N/W",
    "_lines": "2(W-1)N / 2(W-1)N",
    "_fp8_two_shot": "2(W-1)F/W / 2(W-1)F/W",
    "_island_two_shot": "2N / 2N",
    "_island_one_shot": "(S-1)N + max(2, W/S-1)N / (S+1)N",
    "_host_one_shot": "2N / (W-1)N",
    "_host_two_shot": "2(N+N/W) / 2(W-1)N/W",
}


def _algorithm_row(record) -> str:
    """One row of the guide's algorithm table, from the algorithm's record."""
    transport = "p2p" if record.symmetric_input else record.transport or "p2p, host"
    capacity = ("max_bytes" if record.capacity_margin is None else "ll_capacity" if record.capacity_margin == 0
                else f"ll_capacity - {record.capacity_margin} B")
    kind = ("pull" if record.pull else "in place (symmetric input)" if record.symmetric_input
            else "islands" if record.island else f"compressed wire ({record.compressed_wire})" if record.lossy
            else "host memory" if record.transport == "host" else "push")
    fused = "data as flag" if record.data_as_flag else "yes" if record.fused else "-"
    return (f"| `{record.name}` | {record.id} | {transport} | {capacity} | {kind} | {fused} | "
            f"{WIRE_FORMULAS[record.wire_bytes.__name__]} |")


def _evaluate(formula: str, n: int, w: int, s: int, f: int) -> int:
    """A wire formula of the table, e.g. ``2(W-1)N/W``, at N, W, S, F (integer division, as the code)."""
    expr = formula.replace("/", "//")
    expr = re.sub(r"(?<=[\d)NWSF])(?=[(NWSF]|max)", "*", expr)
    return eval(expr, {"max": max}, {"N": n, "W": w, "S": s, "F": f})  # noqa: S307 - our own table


def test_the_guide_lists_every_algorithm_record() -> None:
    from pcie_allreduce.plan import algorithms

    guide = (ROOT / "docs" / "guide.md").read_text()
    rows = [line for line in guide.splitlines() if re.match(r"\| `\w+` \| \d+ \|", line)]
    assert rows == [_algorithm_row(r) for r in algorithms.REGISTRY]


@pytest.mark.parametrize("n, w, s", [(12288, 4, 2), (7168 * 8, 8, 4), (4096, 6, 3), (1 << 20, 16, 8)])
def test_the_guides_wire_formulas_are_the_records(n: int, w: int, s: int) -> None:
    from pcie_allreduce.plan import algorithms

    for record in algorithms.REGISTRY:
        out, into = WIRE_FORMULAS[record.wire_bytes.__name__].split(" / ")
        f = algorithms.fp8_wire_bytes(n // 2)
        expected = algorithms.wire_bytes(record.name, n, w, island_ranks=s, elem_size=2)
        assert (_evaluate(out, n, w, s, f), _evaluate(into, n, w, s, f)) == (expected.out, expected.into), record.name
