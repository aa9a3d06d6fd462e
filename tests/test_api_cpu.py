"""CPU tests of the public API: import without a GPU, validation messages, algorithm tables."""

from __future__ import annotations

import json

import pytest
import torch

import pcie_allreduce
from pcie_allreduce import algo, validation
from pcie_allreduce.algo import AlgoTable, Rule

CUDA0 = torch.device("cuda", 0)


def test_import_without_gpu_reports_why() -> None:
    reason = pcie_allreduce.unavailable_reason()
    if torch.cuda.is_available() and reason is None:
        pytest.skip("a GPU is usable here")
    assert pcie_allreduce.is_available() is False
    assert isinstance(reason, str) and reason


def test_communicator_refuses_cleanly_without_gpu(tmp_path) -> None:
    if pcie_allreduce.is_available():
        pytest.skip("a GPU is usable here")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        with pytest.raises((pcie_allreduce.UnavailableError, ValueError)):
            pcie_allreduce.Communicator(dist.group.WORLD, 0)
    finally:
        dist.destroy_process_group()


def test_extension_reports_no_device_without_driver() -> None:
    from pcie_allreduce import _ext

    module = _ext.load()
    if module is None:
        pytest.skip(f"extension not built: {_ext.unavailable_reason()}")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert module.device_count() == 0
    assert module.runtime_status() != ""
    assert module.driver_version() == 0 or module.runtime_status()


# ---- validation --------------------------------------------------------------------------


def _check(x, **kw):
    return validation.validate_tensor(x, name="input", device=kw.get("device", torch.device("cpu")),
                                      max_bytes=kw.get("max_bytes", 1 << 20))


def test_validation_accepts_good_tensor() -> None:
    x = torch.zeros(16, dtype=torch.bfloat16)
    assert _check(x) is x


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.int8, torch.bool])
def test_validation_rejects_dtype(dtype) -> None:
    with pytest.raises(TypeError, match="dtype"):
        _check(torch.zeros(4, dtype=dtype))


def test_validation_rejects_non_tensor() -> None:
    with pytest.raises(TypeError, match="torch.Tensor"):
        _check([1.0, 2.0])


def test_validation_rejects_wrong_device() -> None:
    with pytest.raises(ValueError, match="is on cpu, the communicator on cuda:0"):
        _check(torch.zeros(4), device=CUDA0)


def test_validation_rejects_non_contiguous() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        _check(torch.zeros(4, 4).t())


def test_validation_rejects_too_large() -> None:
    with pytest.raises(ValueError, match="max_bytes=64"):
        _check(torch.zeros(17), max_bytes=64)


def test_validation_out_must_match() -> None:
    x = torch.zeros(8)
    validation.validate_out(x, None)
    validation.validate_out(x, x)
    validation.validate_out(x, torch.empty(8))
    with pytest.raises(ValueError, match="must match"):
        validation.validate_out(x, torch.empty(9))
    with pytest.raises(ValueError, match="must match"):
        validation.validate_out(x, torch.empty(8, dtype=torch.float16))
    with pytest.raises(TypeError):
        validation.validate_out(x, "nope")
    with pytest.raises(ValueError, match="contiguous"):
        validation.validate_out(torch.zeros(4, 4), torch.zeros(4, 4).t())


def test_validation_out_partial_overlap() -> None:
    buf = torch.zeros(16)
    with pytest.raises(ValueError, match="partially overlaps"):
        validation.validate_out(buf[0:8], buf[4:12])


def test_validation_algo() -> None:
    for name in ("auto", "oneshot", "staged", "twoshot", "oneshot_ll"):
        assert validation.validate_algo(name) == name
    with pytest.raises(ValueError, match="unknown algo 'ring'"):
        validation.validate_algo("ring")


# ---- algorithm table ---------------------------------------------------------------------


def test_default_table_is_total_and_pure() -> None:
    table = algo.default_table()
    for world in range(2, 9):
        for nbytes in (1, 2, 16, 14 << 10, 56 << 10, 448 << 10, 4 << 20, 64 << 20):
            for dtype in ("bfloat16", "float16", "float32"):
                a = table.select(nbytes, world, dtype)
                assert a == table.select(nbytes, world, dtype)
                assert a.algo in algo.ALGORITHMS
                assert 1 <= a.blocks <= algo.MAX_LAUNCH_BLOCKS


def test_default_table_small_is_low_latency_then_oneshot_then_twoshot() -> None:
    table = algo.default_table()
    assert table.select(14 << 10, 2, "bfloat16").algo == "oneshot_ll"
    assert table.select(56 << 10, 8, "bfloat16").algo == "oneshot_ll"
    assert table.select(448 << 10, 4, "bfloat16") == algo.Choice("oneshot", 32)
    assert table.select(16 << 20, 8, "bfloat16").algo == "twoshot"
    assert table.select(16 << 20, 2, "bfloat16").algo == "twoshot"


def test_low_latency_rules_are_passed_over_above_the_capacity() -> None:
    table = algo.default_table()
    assert table.select(56 << 10, 4, "bfloat16", ll_capacity=56 << 10).algo == "oneshot_ll"
    assert table.select(56 << 10, 4, "bfloat16", ll_capacity=32 << 10).algo == "oneshot"


def test_table_json_round_trip() -> None:
    table = algo.default_table()
    assert AlgoTable.from_json(table.to_json()) == table


def test_table_from_env_inline_and_file(tmp_path) -> None:
    text = json.dumps({"rules": [{"algo": "staged", "world": [8], "max_bytes": 1024},
                                 {"algo": "twoshot", "bytes_per_block": 4096, "max_blocks": 4}]})
    env_table = algo.load_table(environ={algo.TABLE_ENV: text})
    assert env_table.select(1000, 8, "bfloat16") == algo.Choice("staged", 1)
    assert env_table.select(1000, 4, "bfloat16") == algo.Choice("twoshot", 1)
    assert env_table.select(1 << 20, 8, "bfloat16") == algo.Choice("twoshot", 4)
    path = tmp_path / "table.json"
    path.write_text(text)
    assert algo.load_table(str(path)) == env_table
    assert algo.load_table(environ={}) == algo.default_table()


@pytest.mark.parametrize("text, match", [
    ("not json", "not valid JSON"),
    ('{"rules": []}', "at least one rule"),
    ('{"rules": [{"algo": "ring"}]}', "unknown algo 'ring'"),
    ('{"rules": [{"algo": "oneshot", "speed": 3}]}', "unknown keys"),
    ('{"rules": [{"algo": "oneshot", "max_blocks": 500}]}', "max_blocks"),
    ('{"rules": [{"world": 2}]}', "needs an 'algo'"),
])
def test_table_errors_name_the_problem(text, match) -> None:
    with pytest.raises(ValueError, match=match):
        AlgoTable.from_json(text)


def test_table_missing_file() -> None:
    with pytest.raises(ValueError, match="cannot read"):
        algo.load_table("/nonexistent/table.json")


def test_table_without_matching_rule() -> None:
    table = AlgoTable((Rule("oneshot", max_bytes=10),))
    with pytest.raises(ValueError, match="no rule"):
        table.select(11, 2, "bfloat16")


def test_forced_algo_blocks_follow_its_rule() -> None:
    table = algo.default_table()
    assert table.blocks_for("twoshot", 64 << 10, 2, "bfloat16") == 1
    assert table.blocks_for("oneshot", 64 << 10, 2, "bfloat16") == 16
    assert 1 <= table.blocks_for("staged", 8 << 20, 8, "bfloat16") <= algo.MAX_LAUNCH_BLOCKS


def test_torch_library_ops_registered() -> None:
    import pcie_allreduce.ops  # noqa: F401

    assert hasattr(torch.ops.pcie_allreduce, "all_reduce")
    assert hasattr(torch.ops.pcie_allreduce, "all_reduce_")
    x = torch.zeros(4, device="meta")
    assert torch.ops.pcie_allreduce.all_reduce(x, 1, "auto").shape == x.shape
