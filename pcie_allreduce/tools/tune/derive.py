"""From measurements to an algorithm table (pure): the winner of every (W, size), then the rules
that launch exactly the winners (the method: :mod:`pcie_allreduce.tools.tune`)."""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from pcie_allreduce.plan.algorithms import ALGORITHMS as ALL_ALGORITHMS
from pcie_allreduce.plan.algorithms import SYMMETRIC_INPUT_ALGORITHMS
from pcie_allreduce.plan.rules import Rule
from pcie_allreduce.plan.tables import AlgoTable, default_table

# What tune times: the algorithms that take any tensor (the in-place ones keep their built-in rules).
ALGORITHMS: tuple[str, ...] = tuple(a for a in ALL_ALGORITHMS if a not in SYMMETRIC_INPUT_ALGORITHMS)
DEFAULT_TOLERANCE = 0.03
OK, SKIPPED, WRONG = "ok", "skipped", "wrong"  # a measurement's status


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One launch shape at one (W, size): p50 / p99 per call in us over the timed replays, if ok."""

    world: int
    size_bytes: int
    algo: str
    blocks: int
    status: str = OK
    p50_us: float | None = None
    p99_us: float | None = None
    replays: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK and self.p50_us is not None


@dataclasses.dataclass(frozen=True)
class Pick:
    """The winning launch shape of one (world, size), and the fastest one's p50 for reference."""

    world: int
    size_bytes: int
    algo: str
    blocks: int
    p50_us: float
    fastest_us: float


def measured(rows: Iterable[Measurement]) -> dict[tuple[int, int, str, int], float]:
    """(world, size, algo, blocks) -> p50 us of every ok measurement."""
    return {(r.world, r.size_bytes, r.algo, r.blocks): float(r.p50_us) for r in rows if r.ok}  # type: ignore[arg-type]


def pick_shapes(rows: Iterable[Measurement], tolerance: float = DEFAULT_TOLERANCE) -> list[Pick]:
    """The winner of every measured (world, size), sorted by world then size."""
    groups: dict[tuple[int, int], list[tuple[str, int, float]]] = {}
    for (world, size, algo, blocks), p50 in measured(rows).items():
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
    base = fallback or default_table()
    return AlgoTable(tuple(tuned) + base.rules, base.fused)


def check_table(table: AlgoTable, picks: Sequence[Pick], dtype: str) -> list[str]:
    """Sizes where ``table`` does not launch what was picked (should be empty)."""
    problems = []
    for p in picks:
        choice = table.select(p.size_bytes, p.world, dtype)
        if (choice.algo, choice.blocks) != (p.algo, p.blocks):
            problems.append(f"W={p.world} {p.size_bytes} B: table picks {choice.algo}/b{choice.blocks}, "
                            f"measured best {p.algo}/b{p.blocks}")
    return problems
