"""Algorithm tables: the data the plain and fused choices of :mod:`pcie_allreduce.plan.dispatch` read.

Every rank must launch the same algorithm with the same launch shape for the same call (the
kernels' flags are per block), so the choice depends only on the call's shape and on a table
that all ranks agree on when the communicator is created. The built-in table
(:func:`default_table`) can be replaced by a JSON file or inline JSON in ``PCIE_AR_ALGO_TABLE``::

    {"rules": [
        {"world": [2, 3, 4], "max_bytes": 262144, "algo": "oneshot", "bytes_per_block": 16384, "max_blocks": 16},
        {"world": "*",       "max_bytes": null,   "algo": "twoshot", "bytes_per_block": 65536, "max_blocks": 32}
    ]}

Rules are tried in order; the first whose ``world`` contains W and whose ``max_bytes`` (null:
unbounded) is >= the message size wins. ``dtype`` may restrict a rule to some dtypes. A
``oneshot_ll`` rule is passed over for messages above the communicator's low-latency capacity
(derived from its agreed ``max_bytes``, so still the same choice on every rank).

An optional ``"fused"`` list holds the fused call's rules (:class:`FusedRule`), tried in order:
``{"world": [5, 6, 7, 8], "max_tokens": 128, "min_hidden": 8192, "algo": "twoshot"}`` takes calls
of at most ``max_tokens`` rows (null: any) of at least ``min_hidden`` and at most ``max_hidden``
elements (absent: any width; ``pcie-allreduce tune`` bounds its rules to the width it measured);
``algo`` is ``"kernel"``, a fused kernel or ``"unfused"``.

Loading checks every field's type strictly (integers are JSON integers, ``world`` is ``"*"``,
null, an integer or a list of integers from MIN_RANKS to MAX_RANKS, ``dtypes`` null or a list of
``"float32"``, ``"float16"``, ``"bfloat16"``) and that every world size and dtype has a rule with
``max_bytes`` null and an uncapped algorithm, so no call finds the table without a rule; any
problem is a ValueError naming the table's source, the rule's index and the field.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from pcie_allreduce.constants import MAX_RANKS, MIN_RANKS
from pcie_allreduce.plan import defaults
from pcie_allreduce.plan.algorithms import CAPPED_ALGORITHMS, SYMMETRIC_INPUT_ALGORITHMS, UNFUSED, availability_problem
from pcie_allreduce.plan.rules import (DTYPE_NAMES, Choice, FusedRule, Rule, fused_rule_from_dict,
                                       rule_from_dict)

TABLE_ENV = "PCIE_AR_ALGO_TABLE"


@dataclass(frozen=True)
class AlgoTable:
    """An ordered list of rules; loading one checks that every call has a rule (:meth:`coverage_problem`).
    ``fused``: the fused table (:class:`FusedRule`), tried in order; a call past its last rule runs
    unfused."""

    rules: tuple[Rule, ...] = field(default_factory=tuple)
    fused: tuple[FusedRule, ...] = field(default_factory=defaults.default_fused_rules)

    def select_fused(self, tokens: int, world: int, serves: Callable[[str], bool] | None = None, *,
                     hidden: int | None = None) -> str:
        """The fused table's choice for ``tokens`` rows of ``hidden`` elements on ``world`` ranks (a
        name of FUSED_CHOICES): the first matching rule whose choice ``serves`` the call (every
        choice, without it); without ``hidden`` the rules bounded by a row width are passed over."""
        for rule in self.fused:
            if rule.matches(tokens, world, hidden) and (serves is None or serves(rule.algo)):
                return rule.algo
        return UNFUSED

    def select(self, nbytes: int, world: int, dtype: str, ll_capacity: int | None = None, *,
               symmetric: bool = False) -> Choice:
        """The algorithm and block count for a message of ``nbytes`` bytes of ``dtype`` on ``world``
        ranks; ``ll_capacity`` (bytes, None: unbounded) rules ``oneshot_ll`` out for larger messages;
        ``symmetric``: the input is the symmetric input area, which the in-place rules need."""
        for rule in self.rules:
            if rule.matches(nbytes, world, dtype, ll_capacity, symmetric=symmetric):
                return Choice(rule.algo, rule.blocks_for(nbytes))
        raise ValueError(f"algorithm table has no rule for {nbytes} bytes of {dtype} at world size {world}")

    def blocks_for(self, algo: str, nbytes: int, world: int, dtype: str) -> int:
        """Launch shape when the caller forces ``algo``: the first rule for that algorithm that fits;
        past its rules' sizes, its last rule for this world size (the one sized for the largest
        messages), else its first rule; an algorithm the table never names launches as the
        table's choice for this message does (its rules' shapes are sized for the message: a
        generic shape would give a 14 KiB message one block where the table's gives four, and
        make a comparison of algorithms a comparison of launch shapes)."""
        candidates = [r for r in self.rules if r.algo == algo and r.matches(nbytes, world, dtype, symmetric=True)]
        if not candidates:
            candidates = [r for r in self.rules if r.algo == algo and r.serves_world(world)][-1:]
        if not candidates:
            candidates = [r for r in self.rules if r.algo == algo]
        if not candidates:
            candidates = [r for r in self.rules if r.matches(nbytes, world, dtype)] or [Rule(algo)]
        return candidates[0].blocks_for(nbytes)

    def coverage_problem(self) -> str | None:
        """Why some call would find no rule, or None: every world size and dtype needs a rule
        with ``max_bytes`` null whose algorithm has no capacity (a capped one is passed over for
        larger messages), else the first call of an uncovered size fails, perhaps inside a CUDA
        graph capture."""
        for world in range(MIN_RANKS, MAX_RANKS + 1):
            for dtype in DTYPE_NAMES:
                if not any(r.max_bytes is None and r.algo not in CAPPED_ALGORITHMS + SYMMETRIC_INPUT_ALGORITHMS
                           and r.serves_world(world) and (r.dtypes is None or dtype in r.dtypes)
                           for r in self.rules):
                    return (f"no rule covers every message size at world size {world} for {dtype}: the table "
                            f'needs a last rule with "max_bytes": null and an algorithm other than '
                            f'{CAPPED_ALGORITHMS + SYMMETRIC_INPUT_ALGORITHMS} for it '
                            '(e.g. {"algo": "twoshot", "world": "*"})')
        return None

    def availability_problem(self, transport: str, island_ranks: int = 0) -> str | None:
        """Why this table cannot serve a communicator of ``transport`` with islands of
        ``island_ranks`` ranks (0: none): what :func:`~pcie_allreduce.plan.algorithms.availability_problem`
        says of the first algorithm it names that cannot run there, or None."""
        for algo in dict.fromkeys(r.algo for r in self.rules):
            problem = availability_problem(algo, transport, island_ranks)
            if problem is not None:
                return f"the algorithm table names {algo!r}, which cannot serve this communicator: {problem}"
        return None

    def to_json(self) -> str:
        rows = []
        for rule in self.rules:
            row: dict[str, Any] = asdict(rule)
            row["world"] = "*" if rule.world is None else list(rule.world)
            row["dtypes"] = None if rule.dtypes is None else list(rule.dtypes)
            rows.append(row)
        fused = [{"algo": r.algo, "max_tokens": r.max_tokens, "world": "*" if r.world is None else list(r.world),
                  **{k: v for k, v in (("min_hidden", r.min_hidden), ("max_hidden", r.max_hidden)) if v is not None}}
                 for r in self.fused]
        return json.dumps({"rules": rows, "fused": fused}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, source: str = "algorithm table") -> "AlgoTable":
        """Parse and check a table; every problem (syntax, a field's type or range, a world size
        or dtype without a rule for every size) raises ValueError naming ``source``."""
        if not isinstance(text, str):
            raise ValueError(f"{source}: expected JSON text, got {type(text).__name__}")
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, an int too long, nesting too deep
            raise ValueError(f"{source}: not valid JSON ({exc})") from None
        if not isinstance(data, dict) or not isinstance(data.get("rules"), list) or not data["rules"]:
            raise ValueError(f'{source}: expected an object {{"rules": [...]}} with at least one rule')
        unknown = set(data) - {"rules", "fused", "meta"}  # "meta": what tune records of its run, not read
        if unknown:
            raise ValueError(f'{source}: unknown keys {sorted(unknown)}; known: "rules", "fused", "meta"')
        rules = tuple(rule_from_dict(row, source, i) for i, row in enumerate(data["rules"]))
        if "fused" not in data:
            return _checked(cls(rules), source)
        fused = data["fused"]
        if not isinstance(fused, list) or not fused:
            raise ValueError(f'{source}: "fused" must be a list of at least one rule')
        return _checked(cls(rules, tuple(fused_rule_from_dict(row, source, i) for i, row in enumerate(fused))), source)


def _checked(table: AlgoTable, source: str) -> AlgoTable:
    problem = table.coverage_problem()
    if problem is not None:
        raise ValueError(f"{source}: {problem}")
    return table


def default_table(transport: str = "p2p", islands: int = 1) -> AlgoTable:
    """The built-in table of ``transport`` for a group of ``islands`` islands (GPUs under one PCIe
    switch or one NUMA node: :attr:`pcie_allreduce.Communicator.islands`); P2P groups of two or
    more islands take :func:`island_fabric_table`. P2P: crossovers measured on one H200 under MPS
    (`pcie-allreduce tune` measures yours), and for the two data-as-flag one-shots the bytes a
    PCIe link carries. Why each rule sits where it does, with the figures and the link model behind
    it: bench/PERF_NOTES.md, "Why the built-in tables choose what they do".
    """
    if transport == "host":
        return AlgoTable(defaults.HOST_RULES)
    if islands > 1:
        return island_fabric_table()
    return AlgoTable(defaults.FLAT_P2P_RULES)


def island_fabric_table() -> AlgoTable:
    """The built-in P2P table where the ranks span two or more islands: an ESTIMATE, from
    bench/fabric_model.py (a model calibrated on FlashInfer's published figures of an 8-GPU,
    two-NUMA-node box; bench/RESULTS.md, "Fabric model"), until `pcie-allreduce tune` on such a
    box replaces it. No island box has been measured.

    Across islands the flat one-shots write every message to every peer at once, and such
    all-to-all writes collapse at a CPU root complex: the model gives each rank 0.072 of its link
    then (fitted), 0.57 on a milder box (vLLM #56128). The two-shots write a 1/W shard to each
    owner in turn; the staged two-shot also hands the owners' sums on one peer at a time, so it
    never writes all-to-all. Taking, per size, each built-in algorithm's worst ratio to the best
    under the two fractions: up to 14 KiB the full-payload two-shot has the smallest (W = 8:
    1.00-1.40 from 1 KiB), for its data-as-flag hops; from 32 KiB the staged two-shot (W = 8:
    1.50 at 32 KiB, 1.58 at 56 KiB, 1.85 at 448 KiB, 1.00 from 1 MiB; W = 4 and 6 alike), where the
    full-payload two-shot's reaches 1.9-3.7 and beyond its capacity the flag-based two-shot's
    4.4. The switch is at 24 KiB. Only the smallest messages (up to 512 B, one block) keep the
    full-payload one-shot, for its single hop. W = 2 has one peer, no all-to-all: the flat rules.
    tests/test_fabric_model.py checks every pick is within 1.10x of the algorithm with the
    smallest worst ratio. (The model takes the staged forms' stages as one-to-one; ranks that
    drift apart overlap them, which it does not see.)

    Fused calls run unfused (this table's all-reduce, then the add + RMSNorm kernel) except at
    W = 2: the fused kernels are the flat one-shot and two-shot exchanges.
    """
    return AlgoTable(defaults.ISLAND_RULES + defaults.FLAT_P2P_RULES, defaults.island_fused_rules())


def load_table(spec: str | os.PathLike[str] | AlgoTable | None = None,
               environ: dict[str, str] | None = None) -> AlgoTable:
    """Resolve the table: an explicit AlgoTable, a path or inline JSON, else ``$PCIE_AR_ALGO_TABLE``, else the default.

    Raises ValueError naming the source when the table cannot be read or used
    (:meth:`AlgoTable.from_json`, :meth:`AlgoTable.coverage_problem`)."""
    if isinstance(spec, AlgoTable):
        return _checked(spec, "algo_table")
    if spec is None:
        spec = (os.environ if environ is None else environ).get(TABLE_ENV) or None
        source = TABLE_ENV
    else:
        source = "algo_table"
    if spec is None:
        return default_table()
    text = os.fspath(spec)
    if text.lstrip().startswith("{"):
        return AlgoTable.from_json(text, source=source)
    try:
        with open(text, encoding="utf-8") as fh:
            content = fh.read()
    except OSError as exc:
        raise ValueError(f"{source}: cannot read algorithm table file {text!r} ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{source}: algorithm table file {text!r} is not UTF-8 text ({exc.reason})") from None
    return AlgoTable.from_json(content, source=f"{source} file {text}")
