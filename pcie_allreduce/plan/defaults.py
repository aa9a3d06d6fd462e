"""The rows of the built-in tables, which :func:`pcie_allreduce.plan.tables.default_table` assembles.

P2P on one island: crossovers measured on one H200 under MPS, and for the two data-as-flag
one-shots the bytes a PCIe link carries. P2P across islands: an estimate from bench/fabric_model.py
(no island box measured). Host transport: the write-once kernels for small messages, the pull forms
beyond. Fused: where a fused kernel beat the plain all-reduce + one add + RMSNorm kernel.
`pcie-allreduce tune` replaces the plain rows with measurements on the box it runs on. Why each row
sits where it does, with the figures and the link model behind it: bench/PERF_NOTES.md, "Why the
built-in tables choose what they do" and "Fused all-reduce + RMSNorm against the plain all-reduce +
one add + RMSNorm kernel".
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
    and which: measured under MPS, every fused kernel forced beside the best such pair of any
    backend in one run per world and hidden size (bench/RESULTS.md, "Fused all-reduce + residual
    add + RMSNorm": W = 2, 4 and 8 on one H100 at hidden 4096, 7168 and 8192, 1-128 tokens). A
    rule is kept where its kernel won at all three hidden sizes; W = 3 follows W = 4 and W = 5-7
    follow W = 8, unmeasured. ``pcie-allreduce tune --fused-tokens ... --hidden H`` measures them
    on the box it runs on and writes its own ``"fused"`` rules ahead of these; a table in
    $PCIE_AR_ALGO_TABLE may carry its own.

    - Few tokens: the data-as-flag one-shot in the plain table's wire format ("kernel"), up to
      16 tokens at W = 2, 8 at W = 3-4 and 4 above (W = 2, 16 x 7168: 5.57 us against 5.76 for
      the pair; W = 4, 8 x 4096 / 7168 / 8192 in 16-byte quads: 4.77 / 5.71 / 6.00 against 5.84 /
      7.24 / 8.88, graph loop; W = 8, 4 x 4096: 8.72 against 9.96, and 4 x 7168 in two 16-warp
      quads programs per row: 9.89 against 11.24, graph loop). Where it has no launch shape (few
      programs: ranks sharing a GPU) the next rule takes the call.
    - W = 2: the flag-based one-shot beyond (128 x 7168: 12.64 against 17.32).
    - W = 3-4: the pair at 5-8 tokens where the data-as-flag kernel has no shape (the flag-based
      one-shot lost at 8 x 7168: 8.65 against 7.83), the flag-based one-shot at 9-16 (16 x 7168:
      8.95 against 10.49; 0.82-0.91x the pair at the three sizes), the pair beyond (32 x 7168: 14.96
      against 14.48; the two-shot lost at 64 tokens at hidden 4096 and at 128 at 7168).
    - W = 5-8: the pair at 3-4 tokens where the data-as-flag kernel has no shape (the flag-based
      one-shot drew: 4 x 7168, 12.60 against 12.51), the flag-based one-shot at 5-16 (16 x 7168:
      20.31 against 22.00; 0.80-0.94x the pair at 8 and 16 tokens), the pair beyond (32 tokens:
      the one-shot 0.92-1.01x; 64-128: the token-split two-shot 0.85-1.05x), except for rows of
      8192 elements or more: the one-shot up to 32 tokens and the two-shot at 33-128, which won in
      two runs (8192 wide: the one-shot 0.92x the pair at 32 tokens in both, the two-shot
      0.84-0.85x at 64 and 0.86-0.87x at 128), where at 4096 and 7168 they drew or lost.
    - W = 9-16: the pair. The fused kernels serve these worlds (forced, or named by a table's own
      rules), but no fused kernel has been measured against the pair above 8 ranks, and each
      one-shot rank sends (W - 1) x the message there."""
    return (
        FusedRule("kernel", max_tokens=16, world=(2,)),
        FusedRule("oneshot", world=(2,)),
        FusedRule("kernel", max_tokens=8, world=(3, 4)),
        FusedRule(UNFUSED, max_tokens=8, world=(3, 4)),
        FusedRule("oneshot", max_tokens=16, world=(3, 4)),
        FusedRule("kernel", max_tokens=4, world=_LARGE_WORLDS),
        FusedRule(UNFUSED, max_tokens=4, world=_LARGE_WORLDS),
        FusedRule("oneshot", max_tokens=16, world=_LARGE_WORLDS),
        FusedRule("oneshot", max_tokens=32, world=_LARGE_WORLDS, min_hidden=8192),
        FusedRule("twoshot", max_tokens=128, world=_LARGE_WORLDS, min_hidden=8192),
        FusedRule(UNFUSED),
    )


def island_fused_rules() -> tuple[FusedRule, ...]:
    """Across islands fused calls run unfused except at W = 2, which keeps the flat fused rules:
    the fused kernels are the flat one-shot and two-shot exchanges."""
    flat = tuple(r for r in default_fused_rules() if r.world is not None and 2 in r.world)
    return tuple(replace(r, world=(2,)) for r in flat) + (FusedRule(UNFUSED),)
