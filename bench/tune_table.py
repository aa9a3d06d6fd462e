"""From measured launch shapes to an algorithm table (pure; tested on CPU with fake results).

For every (W, size) the winner is the fastest (algo, blocks), except that a shape within
``tolerance`` of the fastest wins if it uses fewer blocks (fewer SMs taken from the model's
compute, and the difference is noise). Then per W, in size order, one rule per measured size:

    Rule(algo, max_bytes=size, world=(W,), bytes_per_block=size // blocks, max_blocks=blocks)

which launches exactly ``blocks`` at the measured size and proportionally fewer below it; the
last rule of a W has no size bound. Neighbouring rules are merged when the larger one already
reproduces the smaller one's choice. The default table follows, for the other world sizes.
Sizes between two measured ones get the larger one's rule: measure the sizes you serve.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from pcie_allreduce.algo import ALGORITHMS, AlgoTable, Rule, default_table
from bench.plan import parse_shape_algo
from bench.results import TUNE, Result

DEFAULT_TOLERANCE = 0.03


@dataclasses.dataclass(frozen=True)
class Pick:
    """The winning launch shape of one (world, size), and the fastest one's p50 for reference."""

    world: int
    size_bytes: int
    algo: str
    blocks: int
    p50_us: float
    fastest_us: float


def measured(results: Iterable[Result]) -> dict[tuple[int, int, str, int], float]:
    """(world, size, algo, blocks) -> p50 us of every ok tune row."""
    out = {}
    for r in results:
        if r.workload == TUNE and r.ok:
            algo, blocks = parse_shape_algo(r.algo)
            out[(r.world, r.size_bytes, algo, blocks)] = float(r.p50_us)  # type: ignore[arg-type]
    return out


def pick_shapes(results: Iterable[Result], tolerance: float = DEFAULT_TOLERANCE) -> list[Pick]:
    """The winner of every measured (world, size), sorted by world then size."""
    times = measured(results)
    groups: dict[tuple[int, int], list[tuple[str, int, float]]] = {}
    for (world, size, algo, blocks), p50 in times.items():
        groups.setdefault((world, size), []).append((algo, blocks, p50))
    picks = []
    for (world, size), shapes in sorted(groups.items()):
        fastest = min(p50 for _, _, p50 in shapes)
        near = [s for s in shapes if s[2] <= fastest * (1 + tolerance)]
        algo, blocks, p50 = min(near, key=lambda s: (s[1], s[2], ALGORITHMS.index(s[0])))
        picks.append(Pick(world, size, algo, blocks, p50, fastest))
    return picks


def rules_for_world(world: int, picks: Sequence[Pick]) -> list[Rule]:
    """The rules reproducing ``picks`` (one world, any order) at their sizes; the last is unbounded."""
    ordered = sorted((p for p in picks if p.world == world), key=lambda p: p.size_bytes)
    rules: list[Rule] = []
    chosen: list[Pick] = []
    for p in ordered:
        rule = Rule(p.algo, max_bytes=p.size_bytes, world=(world,), bytes_per_block=max(1, p.size_bytes // p.blocks),
                    max_blocks=p.blocks)
        # Drop earlier rules that this one already reproduces (same algo and block count there).
        while rules and rules[-1].algo == rule.algo and all(
                rule.blocks_for(q.size_bytes) == q.blocks for q in chosen[-1:]):
            rules.pop()
            chosen.pop()
        rules.append(rule)
        chosen.append(p)
    if rules:
        rules[-1] = dataclasses.replace(rules[-1], max_bytes=None)
    return rules


def derive_table(picks: Sequence[Pick], worlds: Sequence[int] | None = None,
                 fallback: AlgoTable | None = None) -> AlgoTable:
    """Tuned rules for ``worlds`` (default: every world in ``picks``), then the fallback table's."""
    worlds = sorted({p.world for p in picks}) if worlds is None else list(worlds)
    tuned = [rule for w in worlds for rule in rules_for_world(w, picks)]
    return AlgoTable(tuple(tuned) + (fallback or default_table()).rules)


def check_table(table: AlgoTable, picks: Sequence[Pick], dtype: str) -> list[str]:
    """Sizes where ``table`` does not launch what was picked (should be empty)."""
    problems = []
    for p in picks:
        choice = table.select(p.size_bytes, p.world, dtype)
        if (choice.algo, choice.blocks) != (p.algo, p.blocks):
            problems.append(f"W={p.world} {p.size_bytes} B: table picks {choice.algo}/b{choice.blocks}, "
                            f"measured best {p.algo}/b{p.blocks}")
    return problems
