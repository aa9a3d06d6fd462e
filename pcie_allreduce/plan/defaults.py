"""The rows of the built-in tables, which :func:`pcie_allreduce.plan.tables.default_table` assembles.

P2P on one island: crossovers measured on one H200 under MPS, and for the two data-as-flag
one-shots the bytes a PCIe link carries. P2P across islands: an estimate from bench/fabric_model.py
(no island box measured). Host transport: the write-once kernels for small messages, the pull forms
beyond. Fused: where a fused kernel beat the plain all-reduce + one add + RMSNorm kernel.
`pcie-allreduce tune` replaces the plain rows with measurements on the box it runs on. Why each row
sits where it does, with the figures and the link model behind it: bench/PERF_NOTES.md, "Why the
built-in tables choose what they do" and "The built-in fused rules and the island table's picks".
"""

from __future__ import annotations

from dataclasses import replace

from pcie_allreduce.constants import MAX_RANKS, SMALL_WORLD
from pcie_allreduce.plan.algorithms import UNFUSED
from pcie_allreduce.plan.rules import FusedRule, Rule

_SMALL_WORLDS = (2, 3, 4)
_LARGE_WORLDS = (5, 6, 7, 8)
_WIDE_WORLDS = tuple(range(SMALL_WORLD + 1, MAX_RANKS + 1))  # 9..16

#: The P2P rules of a single-island group.
FLAT_P2P_RULES: tuple[Rule, ...] = (
    Rule("oneshot_ll", max_bytes=4 << 10, world=_SMALL_WORLDS, bytes_per_block=2 << 10, max_blocks=32),
    Rule("oneshot_ll", max_bytes=4 << 10, world=_LARGE_WORLDS, bytes_per_block=1 << 10, max_blocks=32),
    Rule("oneshot_full", max_bytes=16 << 10, world=_LARGE_WORLDS, bytes_per_block=1 << 10, max_blocks=8),
    Rule("oneshot_full", max_bytes=512 << 10, world=_SMALL_WORLDS, bytes_per_block=4 << 10, max_blocks=32),
    Rule("oneshot_full", max_bytes=192 << 10, world=_LARGE_WORLDS, bytes_per_block=4 << 10, max_blocks=32),
    Rule("oneshot", max_bytes=1 << 20, world=_SMALL_WORLDS, bytes_per_block=4 << 10, max_blocks=32),
    Rule("oneshot", max_bytes=512 << 10, world=_LARGE_WORLDS, bytes_per_block=2 << 10, max_blocks=16),
    Rule("oneshot_full", max_bytes=16 << 10, world=_WIDE_WORLDS, bytes_per_block=4 << 10, max_blocks=32),
    Rule("twoshot_symm", max_bytes=None, world=(2,), bytes_per_block=64 << 10, max_blocks=64),
    Rule("twoshot_symm", max_bytes=None, world=None, bytes_per_block=64 << 10, max_blocks=32),
    Rule("twoshot", max_bytes=None, world=None, bytes_per_block=64 << 10, max_blocks=32),
)

#: The host transport's rules: the fastest kernel at each measured size on one H100 with W ranks
#: sharing it, where every byte crosses its one PCIe link (bench/RESULTS.md, "Host transport: every
#: kernel"): the data-as-flag one-shots (lines up to 2 KiB, full payload beyond), the lines again
#: and then the flag-based one-shot at W = 2, then the pull forms, which write each byte once. The
#: write-once kernels (host_oneshot, host_twoshot) were slower at every size there. W = 3 follows
#: W = 4 and W = 5-7 follow W = 8 (unmeasured); why the picks hold on a box with a link per GPU,
#: and which it may move: bench/PERF_NOTES.md, "The host transport's table".
HOST_RULES: tuple[Rule, ...] = (
    Rule("oneshot_ll", max_bytes=2 << 10, world=(2, 3, 4), bytes_per_block=8 << 10, max_blocks=32),
    Rule("oneshot_full", max_bytes=16 << 10, world=(2, 3, 4), bytes_per_block=8 << 10, max_blocks=32),
    Rule("oneshot_ll", max_bytes=64 << 10, world=(2,), bytes_per_block=8 << 10, max_blocks=32),
    Rule("oneshot", max_bytes=512 << 10, world=(2,), bytes_per_block=8 << 10, max_blocks=32),
    Rule("oneshot_pull", max_bytes=1 << 20, world=(2,), bytes_per_block=8 << 10, max_blocks=32),
    Rule("oneshot_pull", max_bytes=32 << 10, world=(3, 4), bytes_per_block=8 << 10, max_blocks=32),
    Rule("oneshot_full", max_bytes=4 << 10, world=_LARGE_WORLDS, bytes_per_block=8 << 10, max_blocks=32),
    Rule("oneshot_pull", max_bytes=16 << 10, world=_LARGE_WORLDS, bytes_per_block=8 << 10, max_blocks=32),
    Rule("oneshot_pull", max_bytes=4 << 10, world=_WIDE_WORLDS, bytes_per_block=8 << 10, max_blocks=32),
    Rule("twoshot_pull", max_bytes=None, world=None, bytes_per_block=32 << 10, max_blocks=32),
)

_CROSSING = tuple(range(3, MAX_RANKS + 1))  # W = 2 has one peer, no all-to-all: the flat rules
#: The P2P rules of a group across two or more islands, before the flat ones: two-shots, since the
#: flat one-shots' all-to-all writes collapse at a CPU root complex (an estimate).
ISLAND_RULES: tuple[Rule, ...] = (
    Rule("oneshot_full", max_bytes=512, world=_CROSSING, bytes_per_block=4 << 10, max_blocks=32),
    Rule("twoshot_full", max_bytes=24 << 10, world=_CROSSING, bytes_per_block=4 << 10, max_blocks=32),
    Rule("twoshot_staged", max_bytes=None, world=_CROSSING, bytes_per_block=4 << 10, max_blocks=32),
)


def default_fused_rules() -> tuple[FusedRule, ...]:
    """Where a fused kernel beats the plain all-reduce followed by the one add + RMSNorm kernel,
    and which: measured under MPS, every fused kernel against that pair in one run (bench/RESULTS.md,
    "Fused all-reduce + residual add + RMSNorm"): W = 2, 4 and 8 on one H100 at hidden 4096 and
    7168 (W = 2 and 4 also 8192); W = 3 follows W = 4 and W = 5-7 follow W = 8, unmeasured.
    ``pcie-allreduce tune --fused-tokens ... --hidden H`` measures them on the box it runs on and
    writes its own ``"fused"`` rules ahead of these; a table in $PCIE_AR_ALGO_TABLE may carry its own.

    - Few tokens: the data-as-flag one-shot in the plain table's wire format ("kernel"), up to
      8 tokens at W = 2, 4 at W = 3-4 and 2 above (W = 4, 4 x 7168: 6.40 us against 7.00 for the
      pair; W = 8, 1 x 7168: 6.32 against 10.28, 2 x 7168: 7.40 against 10.33). Where it has no
      launch shape (few programs: ranks sharing a GPU) the next rule takes the call: at W = 2 the
      flag-based one-shot (4 tokens: 5.6 against 6.2), above it the pair.
    - W = 2: the flag-based one-shot beyond (128 x 7168: 12.50 against 16.95).
    - W = 3-4: the pair beyond 4 tokens: every fused kernel the plain table's size gives lost to
      it (8 x 7168: the data-as-flag one-shot, 10.98 against 7.94; 64: the flag-based one-shot,
      24.72 against 22.10; 128: the token-split two-shot, 39.46 against 35.97).
    - W = 5-8: the pair at 3-4 tokens (W = 8, 4 x 7168: the flag-based one-shot 11.34 against
      11.09 in a graph loop; 4 x 4096: the data-as-flag one-shot, 11.07 against 9.94; 3 tokens
      unmeasured), the flag-based one-shot at 5-8 (8 x 7168: 11.52 against 14.15, graph loop; 5-7
      unmeasured), the pair beyond (32 x 7168: the flag-based one-shot 32.93 against 33.65, a
      draw; 128 tokens: the token-split two-shot, 55.94 against 53.32 at hidden 4096 and 70.69
      against 71.10 at 7168, a draw at best).
    - W = 9-16: the pair. The fused kernels serve these worlds (forced, or named by a table's own
      rules), but no fused kernel has been measured against the pair above 8 ranks, and each
      one-shot rank sends (W - 1) x the message there."""
    return (
        FusedRule("kernel", max_tokens=8, world=(2,)),
        FusedRule("oneshot", world=(2,)),
        FusedRule("kernel", max_tokens=4, world=(3, 4)),
        FusedRule("kernel", max_tokens=2, world=_LARGE_WORLDS),
        FusedRule(UNFUSED, max_tokens=4, world=_LARGE_WORLDS),
        FusedRule("oneshot", max_tokens=8, world=_LARGE_WORLDS),
        FusedRule(UNFUSED),
    )


def island_fused_rules() -> tuple[FusedRule, ...]:
    """Across islands fused calls run unfused except at W = 2, which keeps the flat fused rules:
    the fused kernels are the flat one-shot and two-shot exchanges."""
    flat = tuple(r for r in default_fused_rules() if r.world is not None and 2 in r.world)
    return tuple(replace(r, world=(2,)) for r in flat) + (FusedRule(UNFUSED),)
