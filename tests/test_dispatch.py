"""CPU tests of pcie_allreduce.plan.dispatch: the plain and fused choices and the block cap, table-driven."""

from __future__ import annotations

import json

import pytest
import torch

from pcie_allreduce.fabric import topology
from pcie_allreduce.constants import FULL_TWOSHOT_MARGIN, MAX_LAUNCH_BLOCKS, MAX_RANKS, SMALL_WORLD
from pcie_allreduce.plan import algorithms, dispatch, fused_shapes, rules, tables
from pcie_allreduce.plan.algorithms import ALGO_IDS
from pcie_allreduce.plan.defaults import default_fused_rules
from pcie_allreduce.plan.rules import Choice, FusedRule, Rule
from pcie_allreduce.plan.tables import AlgoTable, default_table

KIB, MIB = 1 << 10, 1 << 20
BF16 = torch.bfloat16
# Low-latency up to 64 KiB, one-shot up to 1 MiB, two-shot beyond: one rule per algorithm, so
# each case below names the rule it exercises.
TABLE = AlgoTable((
    Rule("oneshot_ll", max_bytes=64 * KIB, bytes_per_block=4 * KIB, max_blocks=32),
    Rule("oneshot", max_bytes=MIB, bytes_per_block=16 * KIB, max_blocks=16),
    Rule("staged", max_bytes=2 * MIB, world=(8,), bytes_per_block=16 * KIB, max_blocks=64),
    Rule("twoshot", bytes_per_block=64 * KIB, max_blocks=32),
))
LL_CAP = 512 * KIB


@pytest.mark.parametrize("nbytes, world, ll_capacity, block_cap, algo, expected", [
    (1, 4, LL_CAP, 64, "auto", Choice("oneshot_ll", 1)),
    (64 * KIB, 4, LL_CAP, 64, "auto", Choice("oneshot_ll", 16)),
    (64 * KIB, 4, 32 * KIB, 64, "auto", Choice("oneshot", 4)),        # above the line slots' capacity
    (64 * KIB, 4, None, 64, "auto", Choice("oneshot_ll", 16)),        # None: unbounded
    (512 * KIB, 4, LL_CAP, 64, "auto", Choice("oneshot", 16)),
    (512 * KIB, 4, LL_CAP, 8, "auto", Choice("oneshot", 8)),          # block cap applied
    (2 * MIB, 8, LL_CAP, 64, "auto", Choice("staged", 64)),           # world-specific rule
    (2 * MIB, 8, LL_CAP, 33, "auto", Choice("staged", 33)),
    (2 * MIB, 4, LL_CAP, 64, "auto", Choice("twoshot", 32)),
    (64 * MIB, 2, LL_CAP, 64, "auto", Choice("twoshot", 32)),
    (2 * MIB, 4, LL_CAP, 64, "oneshot", Choice("oneshot", 16)),       # forced: its own rule's shape
    (64 * KIB, 4, LL_CAP, 64, "twoshot", Choice("twoshot", 1)),
    (2 * MIB, 4, LL_CAP, 3, "twoshot", Choice("twoshot", 3)),
    (32 * KIB, 4, 32 * KIB, 64, "oneshot_ll", Choice("oneshot_ll", 8)),
])
def test_plain_choice(nbytes, world, ll_capacity, block_cap, algo, expected) -> None:
    got = dispatch.plain_choice(nbytes, world, BF16, TABLE, ll_capacity=ll_capacity, block_cap=block_cap, algo=algo)
    assert got == expected
    assert dispatch.plain_launch(nbytes, world, BF16, TABLE, ll_capacity=ll_capacity, block_cap=block_cap,
                                 algo=algo) == (ALGO_IDS[expected.algo], expected.blocks)


def test_a_forced_low_latency_call_above_the_capacity_is_refused() -> None:
    from pcie_allreduce.plan.algorithms import call_problem

    assert "takes messages up to 32768 bytes" in call_problem("oneshot_ll", 32 * KIB + 1, 2, "p2p", 0, MIB, 32 * KIB)
    assert call_problem("oneshot_ll", 32 * KIB, 2, "p2p", 0, MIB, 32 * KIB) is None
    assert call_problem("oneshot", 32 * KIB + 1, 2, "p2p", 0, MIB, 32 * KIB) is None


def test_plain_choice_reads_dtype_rules() -> None:
    table = AlgoTable((Rule("staged", dtypes=("float32",)), Rule("twoshot")))
    assert dispatch.plain_choice(4 * KIB, 2, torch.float32, table, ll_capacity=None).algo == "staged"
    assert dispatch.plain_choice(4 * KIB, 2, "float32", table, ll_capacity=None).algo == "staged"
    assert dispatch.plain_choice(4 * KIB, 2, BF16, table, ll_capacity=None).algo == "twoshot"


def _fused_algo(tokens, hidden, dtype, world, table, **kwargs) -> str:
    """What the fused call runs with ``algo="auto"`` (the plan's choice alone)."""
    return dispatch.fused_plan(tokens, hidden, dtype, world, table, **kwargs).algo


def _fused_kernel(tokens, hidden, dtype, world, table, **kwargs) -> str:
    """The fused kernel that follows the plain choice (a fused rule's "kernel")."""
    return dispatch.fused_plan(tokens, hidden, dtype, world, table, algo="kernel", **kwargs).algo


@pytest.mark.parametrize("tokens, hidden, world, ll_capacity, block_cap, interpret, expected", [
    (1, 4096, 4, LL_CAP, 64, False, "oneshot_ll"),
    (1, 4095, 4, LL_CAP, 64, False, "oneshot"),      # odd hidden: the low-latency kernel has no shape
    (8, 4096, 4, LL_CAP, 64, False, "oneshot_ll"),
    (8, 4096, 4, LL_CAP, 4, False, "oneshot"),       # block cap: 8 rows need more programs than 4
    (1, 4096, 4, 4 * KIB, 64, False, "oneshot"),     # above the line slots' capacity
    (2, 4096, 2, LL_CAP, 64, True, "oneshot_ll"),    # interpreter: one chunk per row
    (3, 262144, 4, LL_CAP, 64, False, "oneshot"),    # two-shot size, fewer tokens than ranks
    (4, 262144, 4, LL_CAP, 64, False, "twoshot"),
    (16, 32768, 8, LL_CAP, 64, False, "oneshot"),    # 1 MiB: the plain one-shot's range
])
def test_fused_kernel(tokens, hidden, world, ll_capacity, block_cap, interpret, expected) -> None:
    got = _fused_kernel(tokens, hidden, BF16, world, TABLE, ll_capacity=ll_capacity, block_cap=block_cap,
                        interpret=interpret)
    assert got == expected


@pytest.mark.parametrize("tokens, world, expected", [
    (1, 8, "oneshot_full"),   # 14 KiB at W = 8: full payload (the lines end at 4 KiB)
    (4, 8, "oneshot_full"),   # 56 KiB, the verify pass
    (1, 2, "oneshot_full"),
    (4, 2, "oneshot_full"),
    (32, 8, "oneshot"),       # 448 KiB: beyond the data-as-flag band
])
def test_fused_kernel_follows_the_default_tables_wire_format(tokens, world, expected) -> None:
    """Where the plain default picks ``oneshot_full`` (half the lines' bytes), the fused call
    takes the fused kernel in the same format."""
    got = _fused_kernel(tokens, 7168, BF16, world, default_table(), ll_capacity=LL_CAP, block_cap=64)
    assert got == expected


def test_fused_algo_follows_the_fused_rules() -> None:
    """The fused rules decide between a fused kernel and the unfused pair; "kernel" follows the
    plain table, a named kernel that cannot take the shape runs unfused, and every call has an
    answer (the unfused pair)."""
    rules = (FusedRule("kernel", max_tokens=2, world=(2,)), FusedRule("oneshot_ll", max_tokens=8),
             FusedRule("unfused"))
    table = AlgoTable(TABLE.rules, rules)

    def pick(tokens: int, world: int, hidden: int = 4096) -> str:
        return _fused_algo(tokens, hidden, BF16, world, table, ll_capacity=LL_CAP, block_cap=64)

    assert pick(1, 2) == _fused_kernel(1, 4096, BF16, 2, table, ll_capacity=LL_CAP, block_cap=64)
    assert pick(3, 2) == "oneshot_ll"
    assert pick(3, 2, hidden=4095) == "unfused", "odd hidden: the named data-as-flag kernel has no shape"
    assert pick(9, 2) == "unfused"
    assert pick(1, 8) == "oneshot_ll"
    # Above 8 ranks too the rules decide: the fused kernels serve every world up to MAX_RANKS.
    assert [pick(t, w) for w in range(SMALL_WORLD + 1, MAX_RANKS + 1) for t in (1, 3, 9)] == [
        "oneshot_ll", "oneshot_ll", "unfused"] * 8
    for algo in ("oneshot", "twoshot"):
        assert _fused_algo(16, 4096, BF16, 16, AlgoTable(TABLE.rules, (FusedRule(algo),)), ll_capacity=LL_CAP) == algo
    assert _fused_algo(1, 4096, BF16, 2, AlgoTable(TABLE.rules, (FusedRule("kernel", max_tokens=1),)),
                       ll_capacity=LL_CAP) == "oneshot_ll"
    assert _fused_algo(2, 4096, BF16, 2, AlgoTable(TABLE.rules, (FusedRule("kernel", max_tokens=1),)),
                       ll_capacity=LL_CAP) == "unfused", "past the last rule: unfused"


@pytest.mark.parametrize("world, tokens, cap, expected", [
    (2, 8, 14, "oneshot"),    # W = 2: the next rule, the flag-based one-shot
    (4, 8, 14, "unfused"),    # W = 3-4: the next rule, the pair
    (8, 4, 7, "unfused"),     # W >= 5: the pair (a crowded share: 3 programs)
    (8, 1, 14, "oneshot_full"),  # one token has a shape within 14 programs: the rule's own kernel
    (8, 4, 14, "oneshot_full"),  # four: two 4096-column quads programs per row (the wide shape)
])
def test_a_kernel_rule_without_a_data_as_flag_shape_passes_the_call_on(world: int, tokens: int, cap: int,
                                                                       expected: str) -> None:
    """Ranks sharing a GPU get few programs (14 at W = 8 on an H100): 8 x 7168 has no data-as-flag
    launch shape there, not even the full payload's wide quads one (two programs per row), so the
    default fused rule "kernel" cannot take its kernel and the next rule decides (measured: the
    flag-based one-shot beats the pair at W = 2 and loses above it). A named "kernel" keeps the
    flag-based one-shot."""
    plan = dispatch.fused_plan(tokens, 7168, BF16, world, default_table(), ll_capacity=LL_CAP, block_cap=cap)
    assert plan.algo == expected
    assert _fused_kernel(tokens, 7168, BF16, world, default_table(), ll_capacity=LL_CAP, block_cap=cap) == (
        "oneshot_full" if expected == "oneshot_full" else "oneshot")


def test_each_data_as_flag_kernel_has_its_own_shape() -> None:
    """The full payload's kernel may take the wide quads shape (rows in 4096-column chunks) where
    the word shape has too many programs; the lines kernel never does. A forced kernel plans the
    shape its launch computes, and one without a shape is refused by name."""
    fits = {k: dispatch.fused_kernel_fits(k, 32, 7168, BF16, 2, ll_capacity=LL_CAP, block_cap=64)
            for k in algorithms.DATA_AS_FLAG_ONESHOTS}
    assert fits == {"oneshot_ll": False, "oneshot_full": True}
    plan = dispatch.fused_plan(32, 7168, BF16, 2, default_table(), ll_capacity=LL_CAP, block_cap=64,
                               algo="oneshot_full")
    assert plan.algo == "oneshot_full" and plan.shape == fused_shapes.data_as_flag(32, 7168, 2, 64, full=True)
    assert plan.shape[:2] == (64, 2)
    with pytest.raises(ValueError, match="fused oneshot_ll cannot take"):
        dispatch.fused_plan(32, 7168, BF16, 2, default_table(), ll_capacity=LL_CAP, block_cap=64, algo="oneshot_ll")
    assert not dispatch.fused_kernel_fits("oneshot_full", 32, 7168, BF16, 2, ll_capacity=LL_CAP, block_cap=63)


@pytest.mark.parametrize("hidden", [2048, 7168, 8192])
def test_the_built_in_fused_rules_at_two_to_four_ranks(hidden: int) -> None:
    """W = 2: the data-as-flag kernel up to 16 tokens, the flag-based one-shot beyond. W = 3-4:
    the data-as-flag kernel up to 8 tokens, the flag-based one-shot at 9-16 and the pair beyond
    (measured at W = 2 and 4, hidden 4096 / 7168 / 8192: each rule's kernel beat the pair at all
    three sizes; from 32 tokens some fused kernel lost somewhere)."""
    table = default_table()
    for world in (3, 4):
        picks = {t: _fused_algo(t, hidden, BF16, world, table, ll_capacity=LL_CAP, block_cap=64)
                 for t in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 64, 128, 1000)}
        assert all(picks[t] in algorithms.DATA_AS_FLAG_ONESHOTS for t in (1, 2, 3, 4, 5, 8)), (world, picks)
        assert all(picks[t] == "oneshot" for t in (9, 16)), (world, picks)
        assert all(picks[t] == algorithms.UNFUSED for t in (17, 32, 64, 128, 1000)), (world, picks)
    picks = {t: _fused_algo(t, hidden, BF16, 2, table, ll_capacity=LL_CAP, block_cap=64)
             for t in (1, 8, 9, 16, 17, 128, 1000)}
    assert all(picks[t] in algorithms.DATA_AS_FLAG_ONESHOTS for t in (1, 8, 9, 16)), picks
    assert all(picks[t] == "oneshot" for t in (17, 128, 1000)), picks


@pytest.mark.parametrize("hidden", [4096, 7168, 8192, 12288])
def test_the_built_in_fused_rules_at_five_to_eight_ranks(hidden: int) -> None:
    """At W = 5-8 the built-in rules take the data-as-flag fused kernel up to 4 tokens (the pair
    at 3-4 where it has no launch shape), the flag-based one-shot at 5-16 and the pair beyond,
    128 included; rows of 8192 or more take the one-shot up to 32 tokens and the token-split
    two-shot at 33-128 (measured at W = 8: the data-as-flag kernel beat the pair at 1, 2 and 4
    tokens where it ran, the flag-based one-shot won at 8 and 16 at each hidden size and at 32 at
    8192, the two-shot won at 64-128 at 8192 and drew or lost at 4096 and 7168)."""
    table = default_table()
    wide = hidden >= 8192
    for world in (5, 6, 7, 8):
        picks = {t: _fused_algo(t, hidden, BF16, world, table, ll_capacity=LL_CAP, block_cap=64)
                 for t in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 128, 129, 256, 1000)}
        assert all(picks[t] in algorithms.DATA_AS_FLAG_ONESHOTS for t in (1, 2, 3, 4)), (world, picks)
        assert all(picks[t] == "oneshot" for t in (5, 8, 9, 16)), (world, picks)
        assert all(picks[t] == ("oneshot" if wide else algorithms.UNFUSED) for t in (17, 32)), (world, picks)
        assert all(picks[t] == ("twoshot" if wide else algorithms.UNFUSED) for t in (33, 64, 128)), (world, picks)
        assert all(picks[t] == algorithms.UNFUSED for t in (129, 256, 1000)), (world, picks)


def test_a_fused_rule_bounded_by_the_row_width() -> None:
    """``min_hidden`` takes rows at least that wide; without a width such a rule is passed over;
    it round-trips through JSON (left out where unset) and is checked on load."""
    rule = FusedRule("twoshot", max_tokens=64, world=(8,), min_hidden=8192)
    assert rule.matches(64, 8, 8192) and rule.matches(64, 8, 16384)
    assert not rule.matches(64, 8, 8190) and not rule.matches(64, 8) and not rule.matches(65, 8, 8192)
    table = AlgoTable(TABLE.rules, (rule, FusedRule("unfused")))
    assert AlgoTable.from_json(table.to_json()) == table
    assert "min_hidden" not in AlgoTable(TABLE.rules, (FusedRule("unfused"),)).to_json()
    assert table.select_fused(64, 8, hidden=8192) == "twoshot" and table.select_fused(64, 8) == "unfused"
    _width_bound_refused("min_hidden", (0, -1, 8192.0, True, "8192"))


def test_a_fused_rule_for_one_row_width() -> None:
    """``max_hidden`` takes rows at most that wide; with ``min_hidden`` the same, one width alone
    (what a tuned table writes); without a width such a rule is passed over; JSON round trip and
    the checks on load, an empty range among them."""
    rule = FusedRule("oneshot", max_tokens=16, world=(4,), min_hidden=7168, max_hidden=7168)
    assert rule.matches(16, 4, 7168) and not rule.matches(16, 4, 7176) and not rule.matches(16, 4, 7160)
    assert not rule.matches(16, 4) and FusedRule("oneshot", max_hidden=4096).matches(1, 2, 2048)
    table = AlgoTable(TABLE.rules, (rule, FusedRule("unfused")))
    assert AlgoTable.from_json(table.to_json()) == table and '"max_hidden": 7168' in table.to_json()
    assert table.select_fused(4, 4, hidden=7168) == "oneshot" and table.select_fused(4, 4, hidden=8192) == "unfused"
    _width_bound_refused("max_hidden", (0, -1, 7168.0, True, "7168"))
    with pytest.raises(ValueError, match="min_hidden 8192 is above max_hidden 4096"):
        FusedRule("twoshot", min_hidden=8192, max_hidden=4096)


def _width_bound_refused(field: str, bad_values: tuple) -> None:
    """A fused rule's row-width bound ``field`` refuses each of ``bad_values``, given directly and
    loaded from a table's JSON, naming the field."""
    for bad in bad_values:
        with pytest.raises(ValueError, match=field):
            FusedRule("twoshot", **{field: bad})
        with pytest.raises(ValueError, match=field):
            AlgoTable.from_json('{"rules": [{"algo": "twoshot"}], "fused": [{"algo": "unfused", "%s": %s}]}'
                                % (field, json.dumps(bad)))


def test_the_built_in_fused_rules_keep_the_pair_above_8_ranks() -> None:
    """No fused kernel has been measured against the pair above 8 ranks: the built-in rules run
    the pair there at every token count, though a forced fused kernel runs."""
    table = default_table()
    assert [_fused_algo(t, 7168, BF16, w, table, ll_capacity=LL_CAP, block_cap=64)
            for w in range(SMALL_WORLD + 1, MAX_RANKS + 1) for t in (1, 4, 64, 512)] == ["unfused"] * 32
    assert [dispatch.fused_plan(t, 7168, BF16, 16, table, ll_capacity=LL_CAP, block_cap=64, algo=algo).algo
            for t, algo in ((1, "oneshot_ll"), (1, "oneshot_full"), (4, "oneshot"), (64, "twoshot"))] == [
        "oneshot_ll", "oneshot_full", "oneshot", "twoshot"]


def test_fused_rules_round_trip_and_validation() -> None:
    table = AlgoTable(TABLE.rules, (FusedRule("twoshot", max_tokens=64, world=(4, 8)), FusedRule("unfused")))
    assert AlgoTable.from_json(table.to_json()) == table
    assert AlgoTable.from_json('{"rules": [{"algo": "twoshot"}]}').fused == default_fused_rules()
    for bad, message in (('"fused": []', "at least one rule"),
                         ('"fused": [{"algo": "fast"}]', "unknown algo"),
                         ('"fused": [{"algo": "unfused", "max_tokens": 0}]', "max_tokens"),
                         ('"fused": [{"algo": "unfused", "max_tokens": 4.0}]', "max_tokens"),
                         ('"fused": [{"algo": "unfused", "world": "8"}]', "world"),
                         ('"fused": [{"algo": "unfused", "tokens": 3}]', "unknown keys"),
                         ('"fast": 1', "unknown keys")):
        with pytest.raises(ValueError, match=message):
            AlgoTable.from_json('{"rules": [{"algo": "twoshot"}], ' + bad + "}", source="t.json")
    for world in ((1,), (), (2, 99), [2, 4]):  # built in Python: FusedRule checks as Rule does
        with pytest.raises(ValueError, match="world"):
            FusedRule("unfused", world=world)


@pytest.mark.parametrize("ranks_per_gpu, sms, expected", [
    (1, 132, MAX_LAUNCH_BLOCKS),   # own GPU: every block of every rank runs at once
    (1, 8, MAX_LAUNCH_BLOCKS),
    (2, 132, MAX_LAUNCH_BLOCKS),   # 66 SMs each: the kernels' cap
    (4, 132, 33),
    (8, 132, 16),
    (8, 4, 1),                     # never 0
])
def test_block_cap(ranks_per_gpu, sms, expected) -> None:
    assert dispatch.block_cap(ranks_per_gpu, sms) == expected


def test_ranks_per_gpu_from_placements() -> None:
    def placements(*bus_ids: str) -> list[topology.RankPlacement]:
        return [topology.RankPlacement(rank, "host", bus) for rank, bus in enumerate(bus_ids)]

    assert topology.ranks_per_gpu(placements("a", "b", "c", "d")) == 1
    assert topology.ranks_per_gpu(placements("a", "a", "b", "a")) == 3
    assert topology.ranks_per_gpu([]) == 1
    assert topology.shares_gpu(placements("a", "b", "a")) and not topology.shares_gpu(placements("a", "b"))


def test_dtype_maps_cover_the_kernels_dtypes() -> None:
    from pcie_allreduce import constants, validation

    assert {dispatch.DTYPE_NAMES[d]: i for d, i in dispatch.DTYPE_IDS.items()} == constants.DTYPE_IDS
    assert set(validation.SUPPORTED_DTYPES) == set(dispatch.DTYPE_IDS)


def test_the_host_transport_has_its_own_table_and_algorithms() -> None:
    """The host table takes the fastest kernel measured on the host transport at each size (the
    data-as-flag one-shots for small messages, the pull forms for large ones); host_oneshot /
    host_twoshot exist only in host segments: a P2P communicator refuses a table that names them,
    and every other algorithm runs on both."""
    from pcie_allreduce.plan import algorithms, rules, tables

    host = tables.default_table("host")
    picks = {(w, n): host.select(n << 10, w, "bfloat16").algo for w in (2, 4, 8) for n in (1, 14, 32, 56, 128, 448)}
    assert [picks[2, n] for n in (1, 14, 32, 56, 128, 448)] == [
        "oneshot_ll", "oneshot_full", "oneshot_ll", "oneshot_ll", "oneshot", "oneshot"]
    assert [picks[4, n] for n in (1, 14, 32, 56, 128, 448)] == [
        "oneshot_ll", "oneshot_full", "oneshot_pull", "twoshot_pull", "twoshot_pull", "twoshot_pull"]
    assert [picks[8, n] for n in (1, 14, 32, 56, 128, 448)] == ["oneshot_full", "oneshot_pull"] + ["twoshot_pull"] * 4
    assert host.select(4 << 20, 2, "bfloat16").algo == "twoshot_pull"
    assert host.select(4 << 20, 8, "bfloat16").algo == "twoshot_pull"
    # the two-shot's crossover falls with W: it reads 2(W-1)/W of the message, the one-shot W-1
    crossovers = [next(n for n in range(1 << 10, 1 << 30, 1 << 10) if "twoshot" in host.select(n, w, "bfloat16").algo)
                  for w in range(3, MAX_RANKS + 1)]
    assert crossovers == sorted(crossovers, reverse=True), crossovers
    # where bytes dominate, the pull forms (each byte written once)
    for w in range(2, MAX_RANKS + 1):
        assert host.select(1 << 30, w, "bfloat16").algo == "twoshot_pull"
        assert all(host.select(n, w, "bfloat16").algo in ("oneshot_pull", "twoshot_pull") for n in (2 << 20, 16 << 20))
    # above 8 ranks the pull forms at every size (measured at W = 16: the write-once kernels 2-4x slower)
    for w in range(SMALL_WORLD + 1, MAX_RANKS + 1):
        assert [host.select(n, w, "bfloat16").algo for n in (1, 4 << 10, 4 << 10 | 2, 16 << 20)] == [
            "oneshot_pull", "oneshot_pull", "twoshot_pull", "twoshot_pull"]
    assert host.availability_problem("host") is None and tables.default_table().availability_problem("host") is None
    problem = tables.AlgoTable((rules.Rule("host_oneshot", max_bytes=64 << 10), rules.Rule("twoshot"))).availability_problem("p2p")
    assert problem is not None and "host transport only" in problem and "host_oneshot" in problem
    assert all(algorithms.runs_on(a, "host", island_ranks=4) for a in algorithms.ALGORITHMS)
    assert [a for a in algorithms.ALGORITHMS if not algorithms.runs_on(a, "p2p", island_ranks=4)] == list(algorithms.HOST_ONLY_ALGORITHMS)
    assert [a for a in algorithms.ALGORITHMS if not algorithms.runs_on(a, "host")] == list(algorithms.ISLAND_ALGORITHMS)


def test_island_algorithms_need_islands_and_say_so() -> None:
    """island_twoshot is refused by name where the ranks form no equal consecutive islands, on
    either transport, and a table naming it cannot serve such a communicator."""
    for transport in ("p2p", "host"):
        for name in ("island_twoshot", "island_oneshot"):
            problem = algorithms.availability_problem(name, transport, island_ranks=0)
            assert problem is not None and name in problem and "islands" in problem
            assert algorithms.availability_problem(name, transport, island_ranks=2) is None
    table = tables.AlgoTable((rules.Rule("island_twoshot", max_bytes=1 << 20), rules.Rule("twoshot")))
    assert table.availability_problem("p2p", island_ranks=4) is None
    problem = table.availability_problem("p2p")
    assert problem is not None and "'island_twoshot'" in problem and "islands" in problem
    assert tables.default_table().availability_problem("p2p") is None
    # auto never picks the island form, nor on P2P the pull forms (whether a fabric's reads beat
    # its writes is for `tune` to measure); the host table reads from host memory either way. The
    # in-place two-shot reads too, but only inputs a caller placed in the symmetric area.
    for transport, islands in (("p2p", 1), ("p2p", 2), ("host", 1)):
        named = {r.algo for r in tables.default_table(transport, islands=islands).rules}
        assert not named & set(algorithms.ISLAND_ALGORITHMS), named
        assert transport == "host" or not named & set(algorithms.PULL_ALGORITHMS), named


@pytest.mark.parametrize(("groups", "expected"), [
    (((0, 1, 2, 3), (4, 5, 6, 7)), 4),
    (((0, 1), (2, 3), (4, 5), (6, 7)), 2),
    (((0, 1, 2), (3, 4, 5)), 3),
    (((0, 1), (2, 3)), 2),
    (((0, 1, 2, 3, 4, 5, 6, 7),), 0),          # one island: flat
    (((0, 2, 4, 6), (1, 3, 5, 7)), 0),          # not runs of consecutive ranks
    (((0, 1, 2), (3, 4)), 0),                   # unequal
    (((0,), (1,)), 0),                          # islands of one rank
    ((), 0),
])
def test_island_ranks_of_groups(groups: tuple, expected: int) -> None:
    from pcie_allreduce.fabric import topology

    assert topology.island_ranks(groups) == expected


@pytest.mark.parametrize("world", [2, 3, 8])
def test_wire_bytes_per_algorithm(world: int) -> None:
    """Bytes on one rank's link per call, a pure function of (algorithm, bytes, W)."""
    from pcie_allreduce.plan.algorithms import WireBytes, wire_bytes

    n = 4 * 7168 * 2  # the verify pass's message: 4 tokens x 7168 bf16
    assert wire_bytes("oneshot", n, world) == WireBytes((world - 1) * n, (world - 1) * n)
    assert wire_bytes("staged", n, world) == wire_bytes("oneshot", n, world)
    assert wire_bytes("oneshot_ll", n, world).busiest == 2 * (world - 1) * n  # 16-byte lines of 8 payload bytes
    assert wire_bytes("twoshot", n, world).busiest == 2 * (world - 1) * n // world
    assert wire_bytes("oneshot_pull", n, world) == wire_bytes("oneshot", n, world)  # reads instead of writes
    assert wire_bytes("twoshot_pull", n, world) == wire_bytes("twoshot", n, world)
    assert wire_bytes("twoshot_staged", n, world) == wire_bytes("twoshot", n, world)  # in ring order
    if world == 8:  # the motivating case: 392 KiB per GPU at full payload, twice that in lines
        assert wire_bytes("oneshot", n, world).out == 392 * 1024
    # host memory: each message written once (plus the re-poison), the others read
    assert wire_bytes("host_oneshot", n, world) == WireBytes(2 * n, (world - 1) * n)
    assert wire_bytes("host_twoshot", n, world).into == 2 * (world - 1) * n // world
    with pytest.raises(ValueError, match="no wire accounting"):
        wire_bytes("ring", n, world)
    if world >= 4:  # two islands of W/2: 2N each way on the busiest rank
        assert wire_bytes("island_twoshot", n, world, island_ranks=world // 2) == WireBytes(2 * n, 2 * n)
        # the one-shot: the message to each island peer, and the fp32 partial (2N) to the next
        # island or the result to the others; the flat one-shot sends W/2 copies across instead
        s = world // 2
        assert wire_bytes("island_oneshot", n, world, island_ranks=s) == WireBytes((s + 1) * n, (s + 1) * n)
    if world == 8:  # four islands of 2: the finisher sends the result to 3 other islands
        assert wire_bytes("island_oneshot", n, world, island_ranks=2) == WireBytes(4 * n, 3 * n)
    for algo in ("island_twoshot", "island_oneshot"):
        with pytest.raises(ValueError, match="island_ranks"):
            wire_bytes(algo, n, world)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_default_choice_at_the_verify_size_sends_the_message_once_per_peer(world: int) -> None:
    """The default P2P table at the verify pass's message (4 x 7168 bf16) puts (W - 1) x 56 KiB
    on each rank's link, not the lines' twice that: 392 KiB at W = 8."""
    from pcie_allreduce.plan.algorithms import wire_bytes
    from pcie_allreduce.constants import LOW_LATENCY_MAX_BYTES

    n = 4 * 7168 * 2
    choice = default_table().select(n, world, "bfloat16", ll_capacity=LOW_LATENCY_MAX_BYTES)
    assert wire_bytes(choice.algo, n, world).busiest == (world - 1) * n


def test_the_full_payload_one_shot_is_capped_like_the_lines() -> None:
    from pcie_allreduce.plan.algorithms import fits_capacity, wire_bytes

    assert not fits_capacity("oneshot_full", 600 << 10, 512 << 10) and fits_capacity("oneshot_full", 56 << 10, 512 << 10)
    assert wire_bytes("oneshot_full", 56 << 10, 8) == wire_bytes("oneshot", 56 << 10, 8)
    assert wire_bytes("oneshot_full", 56 << 10, 8).busiest * 2 == wire_bytes("oneshot_ll", 56 << 10, 8).busiest
    assert wire_bytes("twoshot_full", 56 << 10, 8) == wire_bytes("twoshot", 56 << 10, 8)
    # the full-payload two-shot's inboxes take the capacity less a margin (csrc/twoshot_full.cuh)
    assert fits_capacity("twoshot_full", (512 << 10) - 16, 512 << 10)
    assert not fits_capacity("twoshot_full", (512 << 10) - 15, 512 << 10)


# ---- the island table: groups across two or more islands ----------------------------------


def test_the_island_table_covers_every_call_and_round_trips_through_json() -> None:
    table = tables.island_fabric_table()
    assert table.coverage_problem() is None
    assert tables.AlgoTable.from_json(table.to_json(), source="test") == table
    assert tables.default_table("p2p", islands=2) == table == tables.default_table("p2p", islands=3)
    assert tables.default_table("p2p", islands=1) == tables.default_table()
    assert tables.default_table("host", islands=2) == tables.default_table("host")


@pytest.mark.parametrize("world", [3, 4, 6, 8])
def test_across_islands_messages_go_two_shot_and_fused_calls_run_unfused(world: int) -> None:
    """Full payload up to 24 KiB, then the staged two-shot (never all-to-all writes)."""
    table = tables.island_fabric_table()
    cap = 512 << 10
    picks = {n: table.select(n, world, "bfloat16", ll_capacity=cap).algo for n in (2, 512, 514, 14 << 10, 24 << 10,
                                                                                   (24 << 10) + 2, 56 << 10, cap,
                                                                                   4 << 20)}
    assert picks == {2: "oneshot_full", 512: "oneshot_full", 514: "twoshot_full", 14 << 10: "twoshot_full",
                     24 << 10: "twoshot_full", (24 << 10) + 2: "twoshot_staged", 56 << 10: "twoshot_staged",
                     cap: "twoshot_staged", 4 << 20: "twoshot_staged"}
    # a smaller workspace: the full-payload two-shot's capacity ends sooner
    assert table.select(20 << 10, world, "float16", ll_capacity=16 << 10).algo == "twoshot_staged"
    assert all(table.select_fused(tokens, world) == algorithms.UNFUSED for tokens in (1, 4, 8, 32, 128))


def test_two_ranks_across_islands_keep_the_flat_choices() -> None:
    """One peer: nothing is written to several peers at once, so islands change nothing."""
    island, flat = tables.island_fabric_table(), tables.default_table()
    for n in (2, 1 << 10, 14 << 10, 56 << 10, 448 << 10, 4 << 20):
        assert island.select(n, 2, "bfloat16", ll_capacity=512 << 10) == flat.select(n, 2, "bfloat16",
                                                                                    ll_capacity=512 << 10)
    for tokens in (1, 4, 8, 32, 128):
        assert island.select_fused(tokens, 2) == flat.select_fused(tokens, 2)


def test_the_records_give_each_kind_of_algorithm() -> None:
    """The names every module reads, derived from the records of pcie_allreduce.plan.algorithms."""
    kib = 1 << 10
    assert algorithms.WIRE_ALGORITHMS == {"fp8": "twoshot_fp8"} and algorithms.LOSSY_ALGORITHMS == ("twoshot_fp8",)
    assert algorithms.FORCEABLE_ALGORITHMS == algorithms.ALGORITHMS + ("twoshot_fp8",)
    assert algorithms.PULL_ALGORITHMS == ("oneshot_pull", "twoshot_pull")
    assert algorithms.CAPPED_ALGORITHMS == ("oneshot_ll", "oneshot_full", "twoshot_full")
    assert algorithms.DATA_AS_FLAG_ONESHOTS == ("oneshot_ll", "oneshot_full")
    assert algorithms.SYMMETRIC_INPUT_ALGORITHMS == ("twoshot_symm",)
    assert algorithms.HOST_ONLY_ALGORITHMS == ("host_oneshot", "host_twoshot")
    assert algorithms.ISLAND_ALGORITHMS == ("island_twoshot", "island_oneshot")
    assert algorithms.FUSED_ALGORITHMS == ("oneshot", "twoshot", "oneshot_ll", "oneshot_full", "unfused")
    assert algorithms.FUSED_MAX_WORLD == MAX_RANKS
    assert algorithms.capacity_of("twoshot_full", 64 * kib) == 64 * kib - FULL_TWOSHOT_MARGIN
    assert algorithms.capacity_of("oneshot_ll", 64 * kib) == 64 * kib and algorithms.capacity_of("twoshot", 1) is None
    for name in algorithms.FORCEABLE_ALGORITHMS:  # every record has its wire accounting
        assert algorithms.wire_bytes(name, 8 * kib, 4, island_ranks=2).busiest > 0


@pytest.mark.parametrize("ranks_per_gpu, share_sms, expected", [
    (1, 132, MAX_LAUNCH_BLOCKS),   # own GPU: never capped
    (4, 32, 32),                   # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 on an H100: the device reports 32 SMs
    (8, 14, 14),                   # 12%: 14 SMs
    (2, 66, MAX_LAUNCH_BLOCKS),
])
def test_block_cap_under_an_mps_share_is_the_share(ranks_per_gpu, share_sms, expected) -> None:
    """Each rank capped to its MPS share sees that share as its SM count: the cap, not a W-th of it."""
    assert dispatch.block_cap(ranks_per_gpu, share_sms, mps_share=True) == expected
    if ranks_per_gpu > 1:
        assert dispatch.block_cap(ranks_per_gpu, share_sms) == max(1, share_sms // ranks_per_gpu)


@pytest.mark.parametrize("ranks_per_gpu, environ, expected", [
    (1, {}, {}),
    (2, {}, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}),
    (3, {}, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "33"}),
    (8, {}, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "12"}),
    (4, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10"}, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10"}),  # a smaller one stays
    (4, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "60"}, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}),
    (4, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "lots"}, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}),
])
def test_ranks_sharing_a_gpu_each_get_their_share(ranks_per_gpu, environ, expected) -> None:
    from pcie_allreduce.tools import mps, ranks

    assert mps.thread_share_env(ranks_per_gpu, environ) == expected
    shares = ranks._child_env({"CUDA_MPS_PIPE_DIRECTORY": "/tmp/x"}, {}, ranks_per_gpu)
    assert shares.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") == mps.thread_share_env(ranks_per_gpu, dict(
        __import__("os").environ)).get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in ranks._child_env(None, {}, ranks_per_gpu)  # no MPS, no share


@pytest.mark.parametrize("environ, expected", [({}, False), ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": ""}, False),
                                               ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": " "}, False),
                                               ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}, True)])
def test_a_process_runs_in_an_mps_share_where_the_variable_is_set(environ, expected) -> None:
    assert dispatch.runs_in_mps_share(environ) is expected
