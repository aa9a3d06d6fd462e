"""The rows of an algorithm table: :class:`Rule` (plain all-reduce), :class:`FusedRule` (the fused
all-reduce + RMSNorm) and the :class:`Choice` a call launches, with the strict checks of every
field and the conversion of a JSON row into a rule. Every problem is a ValueError naming the field,
so a table's loader (:mod:`pcie_allreduce.plan.tables`) can name the source and the rule's index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pcie_allreduce.constants import DTYPE_IDS, MAX_LAUNCH_BLOCKS, MAX_RANKS, MIN_RANKS
from pcie_allreduce.plan.algorithms import (ALGORITHMS, FUSED_ALGORITHMS, LOSSY_ALGORITHMS, SYMMETRIC_INPUT_ALGORITHMS,
                                            fits_capacity)

#: The dtype names a rule's ``dtypes`` may list.
DTYPE_NAMES: tuple[str, ...] = tuple(sorted(DTYPE_IDS, key=DTYPE_IDS.__getitem__))
# Sizes in a table are bounded like the C++ side's uint64 byte counts (and so never make the
# arithmetic of a launch shape overflow).
_SIZE_LIMIT = (1 << 63) - 1


@dataclass(frozen=True)
class Choice:
    """What one call launches."""

    algo: str
    blocks: int


@dataclass(frozen=True)
class Rule:
    """One row of an algorithm table."""

    algo: str
    max_bytes: int | None = None
    world: tuple[int, ...] | None = None  # None: any world size
    dtypes: tuple[str, ...] | None = None  # None: any dtype ("bfloat16", "float16", "float32")
    bytes_per_block: int = 16384
    max_blocks: int = 16

    def __post_init__(self) -> None:
        problem = _rule_problem(self.algo, self.max_bytes, self.world, self.dtypes, self.bytes_per_block,
                                self.max_blocks)
        if problem is not None:
            raise ValueError(f"algorithm table: {problem}")

    def matches(self, nbytes: int, world: int, dtype: str, ll_capacity: int | None = None, *,
                symmetric: bool = False) -> bool:
        """Whether this rule serves the call; ``symmetric``: its input is the symmetric input area
        (a rule naming a SYMMETRIC_INPUT_ALGORITHMS algorithm serves only such calls)."""
        return ((symmetric or self.algo not in SYMMETRIC_INPUT_ALGORITHMS)
                and self.serves_world(world)
                and (self.dtypes is None or dtype in self.dtypes)
                and (self.max_bytes is None or nbytes <= self.max_bytes)
                and fits_capacity(self.algo, nbytes, ll_capacity))

    def serves_world(self, world: int) -> bool:
        """Whether this rule applies at ``world`` ranks (any size, or one it lists)."""
        return _in_worlds(self.world, world)

    def blocks_for(self, nbytes: int) -> int:
        return max(1, min(self.max_blocks, math.ceil(nbytes / self.bytes_per_block)))


def _in_worlds(worlds: tuple[int, ...] | None, world: int) -> bool:
    """A rule's world sizes (None: any) include ``world``."""
    return worlds is None or world in worlds


def _is_int(value: object) -> bool:
    """A real integer: JSON's 8.0, "8" and true are not."""
    return isinstance(value, int) and not isinstance(value, bool)


def _world_problem(world: object) -> str | None:
    """What is wrong with a rule's ``world`` (None: any world size, or a tuple of sizes), or None."""
    if world is None:
        return None
    if not isinstance(world, tuple) or not world:
        return f"world must be '*', null, an integer or a non-empty list of integers, got {world!r}"
    bad = [w for w in world if not (_is_int(w) and MIN_RANKS <= w <= MAX_RANKS)]
    if bad:
        return f"world sizes must be integers in [{MIN_RANKS}, {MAX_RANKS}], got {bad[0]!r}"
    return None


def _rule_problem(algo: object, max_bytes: object, world: object, dtypes: object, bytes_per_block: object,
                  max_blocks: object) -> str | None:
    """What is wrong with a rule's fields, naming the field, or None."""
    if isinstance(algo, str) and algo in LOSSY_ALGORITHMS:
        return (f"algo {algo!r} sends a compressed wire, which changes the result: a call asks for it "
                "(all_reduce(x, wire=...)), a table never names it")
    if not isinstance(algo, str) or algo not in ALGORITHMS:
        return f"unknown algo {algo!r}; expected one of {ALGORITHMS}"
    if max_bytes is not None and not (_is_int(max_bytes) and 0 <= max_bytes <= _SIZE_LIMIT):
        return f"max_bytes must be an integer in [0, {_SIZE_LIMIT}] or null, got {max_bytes!r}"
    problem = _world_problem(world)
    if problem is not None:
        return problem
    if dtypes is not None:
        if not isinstance(dtypes, tuple) or not dtypes:
            return f"dtypes must be null or a non-empty list of dtype names {DTYPE_NAMES}, got {dtypes!r}"
        bad = [d for d in dtypes if not isinstance(d, str) or d not in DTYPE_NAMES]
        if bad:
            return f"dtypes: unknown dtype {bad[0]!r}; expected names from {DTYPE_NAMES}"
    if not (_is_int(bytes_per_block) and 1 <= bytes_per_block <= _SIZE_LIMIT):
        return f"bytes_per_block must be an integer in [1, {_SIZE_LIMIT}], got {bytes_per_block!r}"
    if not (_is_int(max_blocks) and 1 <= max_blocks <= MAX_LAUNCH_BLOCKS):
        return f"max_blocks must be an integer in [1, {MAX_LAUNCH_BLOCKS}], got {max_blocks!r}"
    return None


@dataclass(frozen=True)
class FusedRule:
    """One row of the fused table: for ``[tokens, hidden]`` calls on ``world`` ranks with at most
    ``max_tokens`` tokens (None: any) and, with ``min_hidden`` / ``max_hidden``, rows at least / at
    most that many elements wide (where a kernel's gain follows the row's width, not only the token
    count; a tuned table's rules hold for the width they were measured at), what
    ``all_reduce_rmsnorm(algo="auto")`` runs: ``"kernel"``
    (the fused Triton kernel that follows the plain table's choice for the message, see
    ``pcie_allreduce.plan.dispatch.fused_plan``), a named fused kernel, or ``"unfused"`` (the plain all-reduce, then
    one add + RMSNorm kernel). A named kernel that cannot take a call's shape runs unfused."""

    algo: str
    max_tokens: int | None = None
    world: tuple[int, ...] | None = None  # None: any world size
    min_hidden: int | None = None  # None: any row width
    max_hidden: int | None = None  # None: any row width

    def __post_init__(self) -> None:
        if self.algo not in FUSED_CHOICES:
            raise ValueError(f"fused table: unknown algo {self.algo!r}; expected one of {FUSED_CHOICES}")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise ValueError(f"fused table: max_tokens must be a positive int or null, got {self.max_tokens!r}")
        for name, value in (("min_hidden", self.min_hidden), ("max_hidden", self.max_hidden)):
            if value is not None and not (_is_int(value) and value >= 1):
                raise ValueError(f"fused table: {name} must be a positive int or null, got {value!r}")
        if self.min_hidden is not None and self.max_hidden is not None and self.min_hidden > self.max_hidden:
            raise ValueError(f"fused table: min_hidden {self.min_hidden} is above max_hidden {self.max_hidden}: "
                             "the rule would take no call")
        problem = _world_problem(self.world)
        if problem is not None:
            raise ValueError(f"fused table: {problem}")

    def matches(self, tokens: int, world: int, hidden: int | None = None) -> bool:
        """Whether the rule takes ``[tokens, hidden]`` calls on ``world`` ranks; a rule bounded by
        a row width never takes a call whose width is not given (``hidden`` None)."""
        if not (_in_worlds(self.world, world) and (self.max_tokens is None or tokens <= self.max_tokens)):
            return False
        if self.min_hidden is None and self.max_hidden is None:
            return True
        return (hidden is not None and (self.min_hidden is None or hidden >= self.min_hidden)
                and (self.max_hidden is None or hidden <= self.max_hidden))


#: What a fused rule may name: "kernel" (follow the plain table), a fused kernel, or "unfused".
FUSED_CHOICES: tuple[str, ...] = ("kernel", *FUSED_ALGORITHMS)


def rule_from_dict(row: Any, source: str, index: int) -> Rule:
    """Rule ``index`` of the table ``source`` from its JSON object; a ValueError names both and the field."""
    where = f"{source}: rule {index}"
    if not isinstance(row, dict):
        raise ValueError(f"{where} must be an object, got {type(row).__name__}")
    known = {"algo", "max_bytes", "world", "dtypes", "bytes_per_block", "max_blocks"}
    unknown = set(row) - known
    if unknown:
        raise ValueError(f"{where} has unknown keys {sorted(unknown)}; known: {sorted(known)}")
    if "algo" not in row:
        raise ValueError(f"{where} needs an 'algo'")
    # Only the JSON shapes are converted here (a list becomes a tuple); Rule checks every value.
    world = row.get("world", "*")
    if world == "*" or world is None:
        world_t = None
    elif _is_int(world):
        world_t = (world,)
    elif isinstance(world, list):
        world_t = tuple(world)
    else:
        raise ValueError(f"{where}: world must be '*', null, an integer or a list of integers, got {world!r}")
    dtypes = row.get("dtypes")
    if dtypes is not None and not isinstance(dtypes, list):
        raise ValueError(f"{where}: dtypes must be null or a list of dtype names {DTYPE_NAMES}, got {dtypes!r}")
    fields = {"algo": row["algo"], "max_bytes": row.get("max_bytes"), "world": world_t,
              "dtypes": None if dtypes is None else tuple(dtypes),
              "bytes_per_block": row.get("bytes_per_block", Rule.bytes_per_block),
              "max_blocks": row.get("max_blocks", Rule.max_blocks)}
    problem = _rule_problem(**fields)
    if problem is not None:
        raise ValueError(f"{where}: {problem}")
    return Rule(**fields)


def fused_rule_from_dict(row: Any, source: str, index: int) -> FusedRule:
    """Fused rule ``index`` of the table ``source`` from its JSON object, checked like :func:`rule_from_dict`."""
    where = f"{source}: fused rule {index}"
    if not isinstance(row, dict):
        raise ValueError(f"{where} must be an object, got {type(row).__name__}")
    unknown = set(row) - {"algo", "max_tokens", "world", "min_hidden", "max_hidden"}
    if unknown:
        raise ValueError(f"{where} has unknown keys {sorted(unknown)}; known: algo, max_tokens, world, min_hidden, "
                         "max_hidden")
    # Only the JSON shapes are converted here (a list becomes a tuple); FusedRule checks every value.
    world = row.get("world", "*")
    if world == "*" or world is None:
        world_t = None
    elif isinstance(world, list):
        world_t = tuple(world)
    else:
        raise ValueError(f'{where}: world must be "*", null or a non-empty list of integers, got {world!r}')
    try:
        return FusedRule(algo=row.get("algo", ""), max_tokens=row.get("max_tokens"), world=world_t,
                         min_hidden=row.get("min_hidden"), max_hidden=row.get("max_hidden"))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
