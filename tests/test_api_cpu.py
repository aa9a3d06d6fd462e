"""CPU tests of the public API: import without a GPU, validation messages, algorithm tables."""

from __future__ import annotations

import json

import pytest
import torch

import pcie_allreduce
from pcie_allreduce import constants, validation
from pcie_allreduce.plan import algorithms, rules, tables
from pcie_allreduce.plan.rules import Rule
from pcie_allreduce.plan.tables import AlgoTable
from pcie_allreduce.constants import MAX_RANKS

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


# ---- Communicator.all_reduce's fast check agrees with the validation functions ---------------


class _RecordingWorkspace:
    """Stands in for ``_C.Workspace``: records each launch and reports success."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, ...]] = []

    def all_reduce(self, *args: int) -> int:
        self.calls.append(args)
        return 0


def _cpu_communicator(monkeypatch) -> tuple[pcie_allreduce.Communicator, _RecordingWorkspace]:
    """A Communicator on the CPU whose only workspace records calls (no rendezvous, no GPU)."""
    from pcie_allreduce import communicator
    from pcie_allreduce.fused.path import FusedPath

    monkeypatch.setattr(communicator, "current_stream_handle", lambda device: 0)
    comm = communicator.Communicator.__new__(communicator.Communicator)
    workspace = _RecordingWorkspace()
    comm._closed, comm.device, comm.max_bytes, comm.ll_capacity = False, torch.device("cpu"), 1 << 16, 1 << 12
    comm.world_size, comm.rank, comm.table, comm.block_cap = 4, 0, tables.default_table(), constants.MAX_LAUNCH_BLOCKS
    comm._choices, comm._workspaces, comm._input_areas = {}, {0: workspace}, {}
    comm.transport, comm.island_ranks, comm._fused = "p2p", 0, FusedPath(None, "no meetings")
    return comm, workspace


_BUF = torch.zeros(4096, dtype=torch.bfloat16)
_FAST_CHECK_CASES = {  # name: (x, out); "x" stands for out=x
    "separate out": (torch.zeros(64, dtype=torch.bfloat16), torch.empty(64, dtype=torch.bfloat16)),
    "in place": (torch.zeros(8, 16), "x"),
    "new out": (torch.zeros(3, 5, dtype=torch.float16), None),
    "out aliases x through a view": (_BUF[:64], _BUF[:64].view(64)),
    "out adjacent to x": (_BUF[:64], _BUF[64:128]),
    "out partially overlaps x": (_BUF[:64], _BUF[1:65]),
    "x overlaps out from above": (_BUF[3:67], _BUF[:64]),
    "empty": (torch.zeros(0), torch.zeros(0)),
    "at max_bytes": (torch.zeros(1 << 14), "x"),
    "over max_bytes": (torch.zeros((1 << 14) + 1), "x"),
    "x not a tensor": ([1.0], None),
    "x int32": (torch.zeros(4, dtype=torch.int32), None),
    "x float64": (torch.zeros(4, dtype=torch.float64), None),
    "x on another device": (torch.zeros(4, device="meta"), None),
    "x not contiguous": (torch.zeros(8, 8)[:, :3], None),
    "x expanded": (torch.zeros(1).expand(4), None),
    "x sparse": (torch.zeros(4).to_sparse(), None),
    "x a Parameter": (torch.nn.Parameter(torch.zeros(4)), None),
    "out a Parameter": (torch.zeros(4), torch.nn.Parameter(torch.zeros(4), requires_grad=False)),
    "out not a tensor": (torch.zeros(4), [0.0]),
    "out other dtype": (torch.zeros(4), torch.zeros(4, dtype=torch.float16)),
    "out other shape": (torch.zeros(4), torch.zeros(4, 1)),
    "out on another device": (torch.zeros(4), torch.zeros(4, device="meta")),
    "out not contiguous": (torch.zeros(4), torch.zeros(4, 2)[:, 0]),
}


@pytest.mark.parametrize("case", list(_FAST_CHECK_CASES))
def test_all_reduce_accepts_and_rejects_exactly_as_the_validation_functions(case, monkeypatch) -> None:
    """The fast check ``all_reduce`` runs first (validation.common_call_nbytes) must not change what
    is accepted, the error raised, or the arguments of the launch."""
    from pcie_allreduce.plan.dispatch import DTYPE_IDS

    comm, workspace = _cpu_communicator(monkeypatch)
    x, out = _FAST_CHECK_CASES[case]
    out = x if isinstance(out, str) else out
    fast = validation.common_call_nbytes(x, out, comm.device, comm.max_bytes)
    try:
        validation.validate_tensor(x, name="input", device=comm.device, max_bytes=comm.max_bytes)
        validation.validate_out(x, out)
    except Exception as expected:
        with pytest.raises(type(expected)) as raised:
            comm.all_reduce(x, out=out)
        assert str(raised.value) == str(expected)
        assert workspace.calls == []
        assert fast == -1
        return
    result = comm.all_reduce(x, out=out)
    assert result is out or out is None
    nbytes = x.numel() * x.element_size()
    assert fast in (-1, nbytes)  # -1: the long checks decide (they accepted the call)
    if nbytes == 0:
        assert workspace.calls == []
        return
    algo_id, blocks = comm._choice(nbytes, x.dtype, "auto")
    assert workspace.calls == [(algo_id, x.data_ptr(), result.data_ptr(), nbytes, DTYPE_IDS[x.dtype], blocks, 0)]
    with pytest.raises(ValueError, match="unknown algo 'bogus'"):
        comm.all_reduce(x, out=out, algo="bogus")
    comm._closed = True
    with pytest.raises(RuntimeError, match="closed"):
        comm.all_reduce(x, out=out)


def test_communicator_choices_are_the_dispatch_choices(monkeypatch) -> None:
    """select_algo, select_fused_algo and the cached launch choice are thin over pcie_allreduce.plan.dispatch."""
    from pcie_allreduce.plan import dispatch
    from pcie_allreduce.fused.protocol import interpreting

    comm, _ = _cpu_communicator(monkeypatch)
    comm.block_cap = 8
    agreed = dict(ll_capacity=comm.ll_capacity, block_cap=comm.block_cap)
    for nbytes in (2, 4 << 10, 64 << 10, 1 << 20):
        assert comm.select_algo(nbytes, torch.bfloat16) == dispatch.plain_choice(
            nbytes, comm.world_size, torch.bfloat16, comm.table, **agreed).algo
        assert comm._choice(nbytes, torch.float16, "auto") == dispatch.plain_launch(
            nbytes, comm.world_size, torch.float16, comm.table, **agreed)
        assert comm._choice(nbytes, torch.float16, "auto")[1] <= 8
    for tokens, hidden in ((1, 2048), (2, 4096), (16, 8192)):
        assert comm.select_fused_algo(tokens, hidden, torch.bfloat16) == dispatch.fused_plan(
            tokens, hidden, torch.bfloat16, comm.world_size, comm.table, **agreed, interpret=interpreting()).algo


def test_default_table_is_total_and_pure() -> None:
    table = tables.default_table()
    for world in range(2, MAX_RANKS + 1):
        for nbytes in (1, 2, 16, 14 << 10, 56 << 10, 448 << 10, 4 << 20, 64 << 20):
            for dtype in ("bfloat16", "float16", "float32"):
                a = table.select(nbytes, world, dtype)
                assert a == table.select(nbytes, world, dtype)
                assert a.algo in algorithms.ALGORITHMS
                assert 1 <= a.blocks <= constants.MAX_LAUNCH_BLOCKS


def test_default_table_small_is_low_latency_then_full_payload_then_oneshot_then_twoshot() -> None:
    table = tables.default_table()
    for world in (2, 4, 8):
        assert table.select(4 << 10, world, "bfloat16").algo == "oneshot_ll"
        assert table.select(4 << 10 | 2, world, "bfloat16").algo == "oneshot_full"
        assert table.select(56 << 10, world, "bfloat16").algo == "oneshot_full"
    assert table.select(448 << 10, 4, "bfloat16").algo == "oneshot_full"
    assert table.select(512 << 10, 2, "bfloat16").algo == "oneshot_full"
    assert table.select(192 << 10, 8, "bfloat16").algo == "oneshot_full"
    assert table.select(256 << 10, 8, "bfloat16").algo == "oneshot"
    assert table.select(1 << 20, 4, "bfloat16") == rules.Choice("oneshot", 32)
    assert table.select(16 << 20, 8, "bfloat16").algo == "twoshot"
    assert table.select(16 << 20, 2, "bfloat16").algo == "twoshot"


def test_default_table_above_eight_ranks() -> None:
    """W = 9..16: the full-payload one-shot up to 16 KiB, the two-shot beyond, never the lines
    (twice the bytes) nor, on P2P, the pull forms (tables.default_table)."""
    table = tables.default_table()
    for world in range(9, MAX_RANKS + 1):
        assert table.select(1, world, "bfloat16") == rules.Choice("oneshot_full", 1)
        assert table.select(14 << 10, world, "bfloat16") == rules.Choice("oneshot_full", 4)
        assert table.select(16 << 10, world, "float32").algo == "oneshot_full"
        assert table.select(16 << 10 | 4, world, "float32").algo == "twoshot"
        assert table.select(64 << 20, world, "bfloat16").algo == "twoshot"
        assert table.select(1, world, "bfloat16", ll_capacity=0).algo == "twoshot"  # no full-payload slots
    assert table.select(4 << 10, 8, "bfloat16").algo == "oneshot_ll"


def test_low_latency_rules_are_passed_over_above_the_capacity() -> None:
    table = tables.default_table()
    assert table.select(4 << 10, 4, "bfloat16", ll_capacity=4 << 10).algo == "oneshot_ll"
    assert table.select(4 << 10, 4, "bfloat16", ll_capacity=2 << 10).algo == "oneshot"
    assert table.select(56 << 10, 4, "bfloat16", ll_capacity=56 << 10).algo == "oneshot_full"
    assert table.select(56 << 10, 4, "bfloat16", ll_capacity=32 << 10).algo == "oneshot"


def test_table_json_round_trip() -> None:
    table = tables.default_table()
    assert AlgoTable.from_json(table.to_json()) == table


def test_table_from_env_inline_and_file(tmp_path) -> None:
    text = json.dumps({"rules": [{"algo": "staged", "world": [8], "max_bytes": 1024},
                                 {"algo": "twoshot", "bytes_per_block": 4096, "max_blocks": 4}]})
    env_table = tables.load_table(environ={tables.TABLE_ENV: text})
    assert env_table.select(1000, 8, "bfloat16") == rules.Choice("staged", 1)
    assert env_table.select(1000, 4, "bfloat16") == rules.Choice("twoshot", 1)
    assert env_table.select(1 << 20, 8, "bfloat16") == rules.Choice("twoshot", 4)
    path = tmp_path / "table.json"
    path.write_text(text)
    assert tables.load_table(str(path)) == env_table
    assert tables.load_table(environ={}) == tables.default_table()


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
        tables.load_table("/nonexistent/table.json")


_CATCH_ALL = {"algo": "twoshot"}


@pytest.mark.parametrize("rule, match", [
    ({"algo": "oneshot", "dtypes": "bfloat16"}, "rule 0: dtypes must be null or a list"),
    ({"algo": "oneshot", "dtypes": ["bfloat17"]}, "rule 0: dtypes: unknown dtype 'bfloat17'"),
    ({"algo": "oneshot", "dtypes": [2]}, "rule 0: dtypes: unknown dtype 2"),
    ({"algo": "oneshot", "dtypes": []}, "rule 0: dtypes must be null or a non-empty list"),
    ({"algo": "oneshot", "world": "28"}, "rule 0: world must be"),
    ({"algo": "oneshot", "world": 8.0}, "rule 0: world must be"),
    ({"algo": "oneshot", "world": True}, "rule 0: world must be"),
    ({"algo": "oneshot", "world": {"2": 1}}, "rule 0: world must be"),
    ({"algo": "oneshot", "world": []}, "rule 0: world must be"),
    ({"algo": "oneshot", "world": [2, 8.0]}, r"rule 0: world sizes must be integers in \[2, 16\], got 8.0"),
    ({"algo": "oneshot", "world": [1]}, r"rule 0: world sizes must be integers in \[2, 16\], got 1"),
    ({"algo": "oneshot", "world": 17}, "rule 0: world sizes must be integers"),
    ({"algo": "oneshot", "max_bytes": "64K"}, "rule 0: max_bytes must be an integer"),
    ({"algo": "oneshot", "max_bytes": 65536.0}, "rule 0: max_bytes must be an integer"),
    ({"algo": "oneshot", "max_bytes": False}, "rule 0: max_bytes must be an integer"),
    ({"algo": "oneshot", "max_bytes": -1}, "rule 0: max_bytes must be an integer"),
    ({"algo": "oneshot", "max_bytes": 1 << 64}, "rule 0: max_bytes must be an integer"),
    ({"algo": "oneshot", "bytes_per_block": float("inf")}, "rule 0: bytes_per_block must be an integer"),
    ({"algo": "oneshot", "bytes_per_block": "4096"}, "rule 0: bytes_per_block must be an integer"),
    ({"algo": "oneshot", "bytes_per_block": 0}, "rule 0: bytes_per_block must be an integer"),
    ({"algo": "oneshot", "max_blocks": True}, "rule 0: max_blocks must be an integer"),
    ({"algo": "oneshot", "max_blocks": 4.5}, "rule 0: max_blocks must be an integer"),
    ({"algo": ["oneshot"]}, r"rule 0: unknown algo \['oneshot'\]"),
    ({"algo": None}, "rule 0: unknown algo None"),
])
def test_table_fields_are_checked_strictly_naming_source_rule_and_field(rule: dict, match: str) -> None:
    text = json.dumps({"rules": [rule, _CATCH_ALL]})
    with pytest.raises(ValueError, match="^tuned table t.json: " + match):
        AlgoTable.from_json(text, source="tuned table t.json")
    with pytest.raises(ValueError, match="rule 1: "):  # the rule's index, wherever it stands
        AlgoTable.from_json(json.dumps({"rules": [{"algo": "oneshot", "max_bytes": 1024}, rule, _CATCH_ALL]}))


@pytest.mark.parametrize("text", [
    '{"rules": ' + "[" * 100_000,  # nesting deeper than the parser recurses
    '{"rules": [{"algo": "twoshot", "max_bytes": 1' + "0" * 5000 + "}]}",  # an integer too long to parse
])
def test_unparseable_json_raises_value_error_naming_the_source(text: str) -> None:
    with pytest.raises(ValueError, match="^algo_table: not valid JSON"):
        tables.load_table(text)


@pytest.mark.parametrize("rules, match", [
    ([{"algo": "oneshot", "max_bytes": 1 << 20}], "world size 2 for float32"),
    ([{"algo": "twoshot", "world": [2, 3, 4, 5, 6, 7]}], "world size 8 for float32"),
    ([{"algo": "twoshot", "dtypes": ["bfloat16", "float16"]}], "world size 2 for float32"),
    ([{"algo": "oneshot_ll"}], "world size 2 for float32"),  # passed over above its capacity
    ([{"algo": "oneshot_full", "world": "*"}, {"algo": "twoshot", "world": [2, 3]}], "world size 4"),
])
def test_a_table_without_a_rule_for_every_size_is_rejected_when_loaded(rules: list, match: str) -> None:
    with pytest.raises(ValueError, match=f"^{tables.TABLE_ENV}: no rule covers every message size at {match}"):
        tables.load_table(environ={tables.TABLE_ENV: json.dumps({"rules": rules})})
    uncovered = AlgoTable(AlgoTable.from_json(json.dumps({"rules": rules + [_CATCH_ALL]})).rules[:-1])
    with pytest.raises(ValueError, match="^algo_table: no rule covers every message size"):
        tables.load_table(uncovered)  # as Communicator(algo_table=...) takes it


@pytest.mark.parametrize("transport", ["p2p", "host"])
def test_the_built_in_tables_cover_every_size(transport: str) -> None:
    table = tables.default_table(transport)
    assert table.coverage_problem() is None
    assert tables.load_table(table) == table == AlgoTable.from_json(table.to_json())


def test_a_table_file_that_is_not_text_names_the_file(tmp_path) -> None:
    path = tmp_path / "table.json"
    path.write_bytes(b'{"rules": [{"algo": "twoshot"}]}\xff\xfe')
    with pytest.raises(ValueError, match=f"algo_table: algorithm table file '{path}' is not UTF-8"):
        tables.load_table(str(path))


def test_table_without_matching_rule() -> None:
    table = AlgoTable((Rule("oneshot", max_bytes=10),))
    with pytest.raises(ValueError, match="no rule"):
        table.select(11, 2, "bfloat16")


def test_forced_algo_blocks_follow_its_rule() -> None:
    table = tables.default_table()
    assert table.blocks_for("twoshot", 64 << 10, 2, "bfloat16") == 1
    assert table.blocks_for("oneshot", 64 << 10, 2, "bfloat16") == 16
    assert 1 <= table.blocks_for("staged", 8 << 20, 8, "bfloat16") <= constants.MAX_LAUNCH_BLOCKS
    # a named algorithm takes its own rule's shape for the size, and past its rules' sizes the
    # shape of its rule for the largest messages at this world size (not a smaller size's rule)
    for nbytes in (8 << 10, 56 << 10):
        assert table.blocks_for("oneshot_full", nbytes, 8, "bfloat16") == table.select(nbytes, 8, "bfloat16").blocks
    widest = [r for r in table.rules if r.algo == "oneshot_full" and 8 in r.world][-1]
    assert table.blocks_for("oneshot_full", 4 << 20, 8, "bfloat16") == widest.blocks_for(4 << 20)
    assert widest.max_bytes == max(r.max_bytes for r in table.rules if r.algo == "oneshot_full" and 8 in r.world)
    # an algorithm the table never names launches as the table's choice for that size
    odd = tables.AlgoTable(tuple(r for r in table.rules if r.algo != "oneshot_full"))
    for nbytes in (1 << 10, 14 << 10, 56 << 10, 4 << 20):
        assert odd.blocks_for("oneshot_full", nbytes, 8, "bfloat16") == odd.select(nbytes, 8, "bfloat16").blocks


def test_torch_library_ops_registered() -> None:
    import pcie_allreduce.ops  # noqa: F401

    assert hasattr(torch.ops.pcie_allreduce, "all_reduce")
    assert hasattr(torch.ops.pcie_allreduce, "all_reduce_")
    x = torch.zeros(4, device="meta")
    assert torch.ops.pcie_allreduce.all_reduce(x, 1, "auto").shape == x.shape


def test_fused_outputs_may_only_alias_their_own_inputs() -> None:
    """out may be x and residual_out may be residual (in place); any other sharing of memory
    between the fused call's arguments is refused, naming the pair (a kernel storing a row of one
    output while later rows of an input are still to be read would corrupt the result)."""
    from pcie_allreduce.validation import validate_rmsnorm_aliasing

    tokens, hidden = 4, 64
    buf = torch.randn(8 * tokens * hidden, dtype=torch.bfloat16)
    x, residual, normed, new_residual = (buf[i * tokens * hidden:(i + 1) * tokens * hidden].view(tokens, hidden)
                                         for i in range(4))
    weight = torch.randn(hidden, dtype=torch.bfloat16)
    validate_rmsnorm_aliasing(x, residual, weight, normed, new_residual)
    validate_rmsnorm_aliasing(x, residual, weight, x, residual)  # in place
    shifted = buf[tokens * hidden + hidden:2 * tokens * hidden + hidden].view(tokens, hidden)  # residual, one row on
    for args, message in (((x, residual, weight, shifted, new_residual), "out overlaps residual"),
                          ((x, residual, weight, residual, new_residual), "out is residual"),
                          ((x, residual, weight, normed, x), "residual_out is x"),
                          ((x, residual, weight, normed, normed), "out is residual_out"),
                          ((x, residual, normed[0], normed, new_residual), "out overlaps weight")):
        with pytest.raises(ValueError, match=message):
            validate_rmsnorm_aliasing(*args)


def test_one_validation_pass_per_call_checks_everything_dispatch_needs() -> None:
    """validation.plain_call / fused_call are each call's only check: every tensor, every pair for
    shared memory and the algorithm name, returning what dispatch needs (bytes; tokens and hidden)."""
    cpu, big = torch.device("cpu"), 1 << 20
    x = torch.zeros(8)
    assert validation.plain_call(x, None, "auto", device=cpu, max_bytes=big) == 32
    assert validation.plain_call(x, x, "oneshot", device=cpu, max_bytes=big) == 32
    with pytest.raises(ValueError, match="unknown algo 'nope'"):
        validation.plain_call(x, None, "nope", device=cpu, max_bytes=big)
    buf = torch.zeros(16)
    with pytest.raises(ValueError, match="partially overlaps"):
        validation.plain_call(buf[0:8], buf[4:12], "auto", device=cpu, max_bytes=big)
    with pytest.raises(ValueError, match="max_bytes"):
        validation.plain_call(x, None, "auto", device=cpu, max_bytes=16)
    rows = torch.zeros(3, 64, dtype=torch.bfloat16)
    res, w = torch.zeros_like(rows), torch.ones(64, dtype=torch.bfloat16)
    assert validation.fused_call(rows, res, w, 1e-6, None, None, "auto", None, device=cpu, max_bytes=big,
                                 world=2) == (3, 64, "auto", None)
    assert validation.fused_call(rows, res, w, 1e-6, rows, res, "unfused", None, device=cpu, max_bytes=big,
                                 world=2) == (3, 64, "unfused", None)
    # A wire runs the pair with the wire's kernel; a fused kernel cannot take it.
    assert validation.fused_call(rows, res, w, 1e-6, None, None, "auto", "fp8", device=cpu, max_bytes=big,
                                 world=2) == (3, 64, "unfused", "twoshot_fp8")
    with pytest.raises(ValueError, match="wire='fp8' runs the all-reduce, then the add"):
        validation.fused_call(rows, res, w, 1e-6, None, None, "oneshot", "fp8", device=cpu, max_bytes=big, world=2)
    with pytest.raises(ValueError, match="unknown fused algo"):
        validation.fused_call(rows, res, w, 1e-6, None, None, "staged", None, device=cpu, max_bytes=big, world=2)
    with pytest.raises(ValueError, match="residual_out is x"):
        validation.fused_call(rows, res, w, 1e-6, None, rows, "auto", None, device=cpu, max_bytes=big, world=2)
    # Every fused kernel can be forced up to MAX_RANKS ranks; beyond, it is an error.
    for world in (9, 12, 16):
        for algo in ("auto", "unfused", "oneshot", "twoshot", "oneshot_ll", "oneshot_full"):
            assert validation.fused_call(rows, res, w, 1e-6, None, None, algo, None, device=cpu, max_bytes=big,
                                         world=world) == (3, 64, algo, None)
    for algo in ("oneshot", "twoshot", "oneshot_ll", "oneshot_full"):
        with pytest.raises(ValueError, match=f"fused kernel '{algo}' serves world sizes up to 16 .* got 17 ranks"):
            validation.fused_call(rows, res, w, 1e-6, None, None, algo, None, device=cpu, max_bytes=big, world=17)
