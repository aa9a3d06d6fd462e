"""From measurements to an algorithm table (pure): the winner of every (W, size), then the rules
that launch exactly the winners; and with fused measurements, the choice of every (W, tokens)
between the fused kernels and the unfused pair, then the fused rules that make it (the method:
:mod:`pcie_allreduce.tools.tune`)."""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from pcie_allreduce.plan.algorithms import ALGORITHMS as ALL_ALGORITHMS
from pcie_allreduce.plan.algorithms import SYMMETRIC_INPUT_ALGORITHMS, UNFUSED
from pcie_allreduce.plan.rules import FusedRule, Rule
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


# ---- the fused rules --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FusedMeasurement:
    """One fused call at one (W, tokens) of ``hidden`` columns: ``algo`` a fused kernel, or
    UNFUSED (the plain all-reduce, then the one add + RMSNorm kernel); p50 / p99 per call in us."""

    world: int
    tokens: int
    hidden: int
    algo: str
    status: str = OK
    p50_us: float | None = None
    p99_us: float | None = None
    replays: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK and self.p50_us is not None


@dataclasses.dataclass(frozen=True)
class FusedPick:
    """What one (world, tokens) runs: the fastest fused kernel where it beats the pair by more than
    the tolerance, else UNFUSED; the pair's p50 and the fastest kernel's (None: none ran)."""

    world: int
    tokens: int
    algo: str
    pair_us: float
    fastest_algo: str | None
    fastest_us: float | None
    hidden: int | None = None  # the row width measured (None: the picks hold for any width)


def pick_fused(rows: Iterable[FusedMeasurement], tolerance: float = DEFAULT_TOLERANCE) -> list[FusedPick]:
    """The choice of every measured (world, tokens) whose pair was measured, by world then tokens.
    A fused kernel must be faster than the pair by more than ``tolerance`` (a fraction of the
    pair's time) to be taken: within it the difference is noise, and the pair is the call's
    fallback everywhere, so a tie never makes the call slower than its parts."""
    groups: dict[tuple[int, int, int], dict[str, float]] = {}
    for r in rows:
        if r.ok:
            groups.setdefault((r.world, r.hidden, r.tokens), {})[r.algo] = float(r.p50_us)  # type: ignore[arg-type]
    picks = []
    for (world, hidden, tokens), times in sorted(groups.items()):
        pair = times.get(UNFUSED)
        if pair is None:
            continue  # nothing to beat: the default rules keep this point
        kernels = sorted((p50, algo) for algo, p50 in times.items() if algo != UNFUSED)
        fastest_us, fastest = kernels[0] if kernels else (None, None)
        wins = fastest_us is not None and fastest_us < pair * (1 - tolerance)
        picks.append(FusedPick(world, tokens, fastest if wins else UNFUSED, pair, fastest, fastest_us, hidden))
    return picks


def fused_rules_for_world(world: int, picks: Sequence[FusedPick]) -> list[FusedRule]:
    """The fused rules reproducing ``picks`` of one world at their token counts: one rule per run
    of equal choices, bounded by the run's largest token count; the last is unbounded (more tokens
    than measured take the largest measured point's choice). A named kernel that cannot take a
    call's shape runs the pair. Picks of a measured width make rules for that width alone
    (``min_hidden`` = ``max_hidden``): a row of another width keeps the rules below them, since a
    kernel's gain follows the width too."""
    rules: list[FusedRule] = []
    mine = [p for p in picks if p.world == world]
    for hidden in sorted({p.hidden for p in mine}, key=lambda h: (h is None, h or 0)):
        run: list[FusedRule] = []
        for p in sorted((p for p in mine if p.hidden == hidden), key=lambda p: p.tokens):
            if run and run[-1].algo == p.algo:
                run.pop()
            run.append(FusedRule(p.algo, max_tokens=p.tokens, world=(world,), min_hidden=hidden, max_hidden=hidden))
        run[-1] = dataclasses.replace(run[-1], max_tokens=None)
        rules.extend(run)
    return rules


def with_fused_rules(table: AlgoTable, picks: Sequence[FusedPick]) -> AlgoTable:
    """``table`` with the fused rules measured in ``picks`` ahead of its own, for their worlds."""
    tuned = [rule for w in sorted({p.world for p in picks}) for rule in fused_rules_for_world(w, picks)]
    return AlgoTable(table.rules, tuple(tuned) + table.fused)
