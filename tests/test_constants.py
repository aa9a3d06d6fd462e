"""CPU tests of pcie_allreduce.constants: its pure-Python mirror equals what the extension exports.

The extension tests skip with a reason when ``pcie_allreduce._C`` is not built; set
PCIE_AR_REQUIRE_BUILD=1 (CI does) to make a missing build a failure.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from pcie_allreduce import constants, layout


@pytest.fixture(scope="module")
def extension() -> ModuleType:
    from pcie_allreduce import _ext

    module = _ext.load()
    if module is None:
        reason = f"extension not built: {_ext.unavailable_reason()}"
        if os.environ.get("PCIE_AR_REQUIRE_BUILD") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return module


@pytest.mark.parametrize("name", list(constants.MIRROR))
def test_mirror_value_equals_the_extension(extension: ModuleType, name: str) -> None:
    """Changing a constant on one side only must fail here: a stage or algorithm id that differs
    mislabels errors or launches the wrong kernel; a size that differs corrupts the workspace."""
    assert hasattr(extension, name), f"_C does not export {name} (stale build?)"
    assert constants.exported(extension)[name] == constants.MIRROR[name]


def test_extension_exports_nothing_the_mirror_lacks(extension: ModuleType) -> None:
    exported = {name for name in dir(extension)
                if name.isupper() and isinstance(getattr(extension, name), (int, dict, list))}
    unmirrored = exported - set(constants.MIRROR) - set(constants.MIRRORED_ELSEWHERE)
    assert unmirrored == set(), "mirror the new constants in pcie_allreduce/constants.py"


def test_algorithm_records_have_the_extension_ids(extension: ModuleType) -> None:
    """The records of pcie_allreduce.plan.algorithms mirror the algorithm ids (checked at import too)."""
    from pcie_allreduce.plan import algorithms

    assert algorithms.ALGO_IDS == {e["name"]: e["id"] for e in extension.ALGO_RECORDS}


# The fields of C++'s algorithm record (csrc/protocol_constants.h, kAlgorithms): the ones it checks
# before a launch, under the names of pcie_allreduce.plan.algorithms.Algorithm.
CXX_RECORD_FIELDS = {"name", "id", "transport", "capacity_margin", "island", "symmetric_input", "compressed_wire"}


def test_algorithm_records_equal_the_extension_field_by_field(extension: ModuleType) -> None:
    """Every field C++ checks (host only, capacity margin, islands, symmetric input, the FP8 wire)
    has the value of the Python record of the same name: Python validates a call by its record and
    C++ refuses it by its own, so a field that differs accepts what the other side refuses."""
    from pcie_allreduce.plan import algorithms

    exported = [dict(e) for e in extension.ALGO_RECORDS]
    assert [e["id"] for e in exported] == list(range(len(exported)))
    assert {e["name"] for e in exported} == set(algorithms.BY_NAME)
    for entry in exported:
        assert set(entry) == CXX_RECORD_FIELDS, entry
        record = algorithms.BY_NAME[entry["name"]]
        for field, value in entry.items():
            assert getattr(record, field) == value, f"{record.name}.{field}"
    assert algorithms.record_problem(algorithms.REGISTRY, exported) is None


@pytest.mark.parametrize("name, field, drifted", [
    ("host_oneshot", "transport", None),
    ("oneshot", "transport", "host"),
    ("oneshot_ll", "capacity_margin", None),
    ("twoshot_full", "capacity_margin", 0),
    ("staged", "capacity_margin", 16),
    ("island_oneshot", "island", False),
    ("twoshot", "island", True),
    ("twoshot_symm", "symmetric_input", False),
    ("oneshot_pull", "symmetric_input", True),
    ("twoshot_fp8", "compressed_wire", None),
    ("twoshot_pull", "compressed_wire", "fp8"),
])
def test_a_drifting_record_fails_the_check(extension: ModuleType, name: str, field: str, drifted: Any) -> None:
    """A Python record whose field differs from C++'s stops the import, naming the algorithm, the
    field and both values."""
    from pcie_allreduce.plan import algorithms

    exported = [dict(e) for e in extension.ALGO_RECORDS]
    original = getattr(algorithms.BY_NAME[name], field)
    assert original != drifted
    records = tuple(replace(r, **{field: drifted}) if r.name == name else r for r in algorithms.REGISTRY)
    with pytest.raises(ImportError, match=re.escape(f"{name}.{field} is {drifted!r} here, {original!r} in C++")):
        algorithms.check_records(records, exported)


def test_a_field_only_cxx_has_fails_the_check(extension: ModuleType) -> None:
    """A property C++ starts to check must get its Python field too."""
    from pcie_allreduce.plan import algorithms

    exported = [dict(e, ring=False) for e in extension.ALGO_RECORDS]
    with pytest.raises(ImportError, match=re.escape("oneshot.ring is not a field here, False in C++")):
        algorithms.check_records(algorithms.REGISTRY, exported)


def test_module_uses_the_extension_values(extension: ModuleType) -> None:
    assert constants.MAX_LAUNCH_BLOCKS == extension.MAX_LAUNCH_BLOCKS
    assert constants.STAGE_NAMES == dict(extension.STAGE_NAMES)


@pytest.mark.parametrize("transport", ["p2p", "host"])
@pytest.mark.parametrize("max_bytes, world", [(1, 2), (255, 2), (12345, 3), (2 << 20, 4), (8 << 20, 8),
                                              (512 << 10, 5), ((512 << 10) + 1, 7)])
def test_layout_mirror_matches_layout_make(extension: ModuleType, max_bytes: int, world: int, transport: str) -> None:
    """pcie_allreduce.layout (what the Triton kernels use) is Layout::make of csrc/protocol_constants.h."""
    transport_id = constants.TRANSPORT_IDS[transport]
    assert layout.Layout.make(max_bytes, world, transport) == layout.Layout(
        **extension.layout(max_bytes, world, transport_id))


def test_named_ids_follow_the_tables() -> None:
    assert constants.STAGE_NAMES[constants.STAGE_LOW_LATENCY_GATHER] == "low-latency gather"
    assert constants.STAGE_NAMES[constants.STAGE_FUSED_ROW_STATS] == "fused row statistics"
    assert {constants.ERROR_TIMEOUT, constants.ERROR_MISMATCH} == set(constants.ERROR_KINDS.values())
    assert constants.ABORT_WORD == 2 * constants.EPOCH_COPIES  # 64-bit epoch copies, as 32-bit words
    assert constants.EPOCH_COPIES == constants.MAX_FLAG_BLOCKS


def test_triton_constants_come_from_the_constants_module() -> None:
    from pcie_allreduce.fused import oneshot_ll, protocol, rmsnorm
    from pcie_allreduce.plan import fused_shapes as shapes

    assert shapes.MAX_PROGRAMS == constants.MAX_LAUNCH_BLOCKS
    assert oneshot_ll.STAGE_LOW_LATENCY_GATHER.value == constants.STAGE_LOW_LATENCY_GATHER
    assert oneshot_ll.STAGE_ROW_STATS.value == constants.STAGE_FUSED_ROW_STATS
    assert rmsnorm.STAGE_FUSED_GATHER == constants.STAGE_FUSED_GATHER
    assert protocol.line_flag_of(0, 0) == constants.LINE_FLAG_MIX


def test_import_without_the_extension_uses_the_mirror() -> None:
    """``import pcie_allreduce`` must work where _C is not built (CPU machines, docs builds)."""
    code = (
        "import sys\n"
        "sys.modules['pcie_allreduce._C'] = None  # any import of it raises ImportError\n"
        "import pcie_allreduce\n"
        "from pcie_allreduce import _ext, constants, layout\n"
        "from pcie_allreduce.plan import algorithms as algo\n"
        "assert _ext.load() is None\n"
        "assert {n: getattr(constants, n) for n in constants.MIRROR} == constants.MIRROR\n"
        "assert algo.ALGORITHMS == ('oneshot', 'staged', 'twoshot', 'oneshot_ll', 'host_oneshot', 'host_twoshot', 'oneshot_full', 'twoshot_full', 'island_twoshot', 'oneshot_pull', 'twoshot_pull', 'twoshot_staged', 'island_oneshot', 'twoshot_symm')\n"
        "assert layout.Layout.make(1, 2).slot_bytes == constants.ALIGN\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def _header_algorithms() -> dict[str, int]:
    """Algorithm name -> id as csrc/protocol_constants.h defines them (enum Algo, kAlgorithms)."""
    header = (Path(__file__).resolve().parents[1] / "csrc" / "protocol_constants.h").read_text()
    enum = header[header.index("enum class Algo"):]
    enum = enum[:enum.index("};")]
    values = {k: int(v) for k, v in re.findall(r"(k\w+)\s*=\s*(\d+)", enum)}
    names = header[header.index("kAlgorithms[]"):]
    names = names[:names.index("};")]
    return {name: values[key] for key, name in re.findall(r"\{Algo::(k\w+),\s*\"(\w+)\"", names)}


def test_algorithm_records_follow_the_header() -> None:
    """Without a build too: one record per algorithm of csrc/protocol_constants.h, with its id."""
    from pcie_allreduce.plan import algorithms

    assert algorithms.ALGO_IDS == _header_algorithms()
    assert [r.id for r in algorithms.REGISTRY] == sorted(r.id for r in algorithms.REGISTRY)


def _ids_only(ids: dict[str, int]) -> list[dict[str, Any]]:
    """An export of names and ids only (no field to compare): the checks of names and ids alone."""
    return [{"name": name, "id": algo_id} for name, algo_id in ids.items()]


def _record(name: str, algo_id: int) -> Any:
    from pcie_allreduce.plan import algorithms

    return replace(algorithms.REGISTRY[0], name=name, id=algo_id)


@pytest.mark.parametrize("extra, match", [
    (("ring", 15), "records the kernels lack: ring=15"),
    (("oneshot", 15), "repeat a name or an id"),
    (("ring", 0), "repeat a name or an id"),
])
def test_a_record_the_kernels_do_not_have_fails_the_check(extra: tuple[str, int], match: str) -> None:
    from pcie_allreduce.plan import algorithms

    records = algorithms.REGISTRY + (_record(*extra),)
    assert algorithms.record_problem(algorithms.REGISTRY, _ids_only(algorithms.ALGO_IDS)) is None
    with pytest.raises(ImportError, match=match):
        algorithms.check_records(records, _ids_only(algorithms.ALGO_IDS))


def test_records_that_differ_from_the_kernels_fail_the_check() -> None:
    from pcie_allreduce.plan import algorithms

    renamed = (_record("one_shot", 0),) + algorithms.REGISTRY[1:]
    with pytest.raises(ImportError, match="no record for oneshot=0; records the kernels lack: one_shot=0"):
        algorithms.check_records(renamed, _ids_only(algorithms.ALGO_IDS))
    swapped = (_record("oneshot", 1), _record("staged", 0)) + algorithms.REGISTRY[2:]
    with pytest.raises(ImportError, match="oneshot is 1 here, 0 in C[+][+]"):
        algorithms.check_records(swapped, _ids_only(algorithms.ALGO_IDS))
    missing = algorithms.REGISTRY[:-1]
    with pytest.raises(ImportError, match="no record for twoshot_fp8=14"):
        algorithms.check_records(missing, _ids_only(algorithms.ALGO_IDS))


def test_an_extension_with_other_ids_fails_the_import() -> None:
    """The check runs at import: an extension whose ids differ from the records stops it loudly."""
    code = (
        "import sys, types\n"
        "fake = types.ModuleType('pcie_allreduce._C')\n"
        "fake.ALGO_RECORDS = [{'name': 'oneshot', 'id': 1}, {'name': 'staged', 'id': 0}]\n"
        "sys.modules['pcie_allreduce._C'] = fake\n"
        "try:\n"
        "    import pcie_allreduce.plan.algorithms\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr
    assert "disagree with those pcie_allreduce._C exports" in result.stdout
    assert "ids differ: oneshot is 0 here, 1 in C++" in result.stdout

