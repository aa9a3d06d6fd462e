"""Algorithm tables: the data the plain choice of :mod:`pcie_allreduce.dispatch` reads.

Every rank must launch the same algorithm with the same launch shape for the same call (the
kernels' flags are per block), so the choice depends only on the call's shape and on a table
that all ranks agree on when the communicator is created. The default table below can be
replaced by a JSON file or inline JSON in ``PCIE_AR_ALGO_TABLE``::

    {"rules": [
        {"world": [2, 3, 4], "max_bytes": 262144, "algo": "oneshot", "bytes_per_block": 16384, "max_blocks": 16},
        {"world": "*",       "max_bytes": null,   "algo": "twoshot", "bytes_per_block": 65536, "max_blocks": 32}
    ]}

Rules are tried in order; the first whose ``world`` contains W and whose ``max_bytes`` (null:
unbounded) is >= the message size wins. ``dtype`` may restrict a rule to some dtypes. A
``oneshot_ll`` rule is passed over for messages above the communicator's low-latency capacity
(derived from its agreed ``max_bytes``, so still the same choice on every rank).

Loading checks every field's type strictly (integers are JSON integers, ``world`` is ``"*"``,
null, an integer or a list of integers from MIN_RANKS to MAX_RANKS, ``dtypes`` null or a list of
``"float32"``, ``"float16"``, ``"bfloat16"``) and that every world size and dtype has a rule with
``max_bytes`` null and an uncapped algorithm, so no call finds the table without a rule; any
problem is a ValueError naming the table's source, the rule's index and the field.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pcie_allreduce.constants import (ALGO_IDS, DTYPE_IDS, FP8_BLOCK, FULL_TWOSHOT_MARGIN, MAX_LAUNCH_BLOCKS, MAX_RANKS,
                                      MIN_RANKS, SMALL_WORLD)

# The compressed wires: all_reduce(x, wire=NAME) runs the kernel named here. They change the
# result (bounded, documented: pcie_allreduce/fp8_wire.py), so they are asked for per call and
# never named by a table, chosen by auto, tuned or forced in a sweep: they are not in ALGORITHMS.
WIRE_ALGORITHMS: dict[str, str] = {"fp8": "twoshot_fp8"}
LOSSY_ALGORITHMS: tuple[str, ...] = tuple(WIRE_ALGORITHMS.values())
#: The lossless algorithms: what a table may name, tune may time and a caller may force.
ALGORITHMS: tuple[str, ...] = tuple(a for a in sorted(ALGO_IDS, key=ALGO_IDS.__getitem__) if a not in LOSSY_ALGORITHMS)
#: What ``algo=`` takes besides "auto": the lossless algorithms and the wires' kernels by name.
FORCEABLE_ALGORITHMS: tuple[str, ...] = ALGORITHMS + LOSSY_ALGORITHMS


def fp8_wire_bytes(numel: int) -> int:
    """Bytes a message of ``numel`` elements takes on the FP8 wire: per block of ``FP8_BLOCK``
    elements (a last partial block included) its codes and one fp32 scale (the format:
    pcie_allreduce/fp8_wire.py; csrc/protocol_constants.h's fp8_wire_bytes)."""
    return -(-numel // FP8_BLOCK) * (FP8_BLOCK + 4)


# The pull forms (csrc/pull.cuh): peers read each rank's staged input out of its own workspace,
# for fabrics whose peer reads beat their peer writes; tune times them on P2P, and the host
# table takes them for large messages (each byte written once, no re-poisoning: default_table).
PULL_ALGORITHMS: tuple[str, ...] = ("oneshot_pull", "twoshot_pull")
# Algorithms whose messages must fit the workspace's low-latency capacity (Layout.ll_capacity):
# the lines, and the full-payload slots (the two-shot's inboxes a margin less, csrc/twoshot_full.cuh).
CAPPED_ALGORITHMS: tuple[str, ...] = ("oneshot_ll", "oneshot_full", "twoshot_full")
# The one-shots whose data is its own flag, in two wire formats (lines; full payload): one fused
# all-reduce + RMSNorm kernel serves both (fused_oneshot_ll.py).
DATA_AS_FLAG_ONESHOTS: tuple[str, ...] = ("oneshot_ll", "oneshot_full")
# Algorithms that read every rank's input in place: the input must be the communicator's
# symmetric input area (Communicator.symmetric_input) on every rank, which only p2p workspaces
# have (so on the host transport such a rule never matches, and forcing one is refused). A table
# rule naming one matches only such calls (Rule.matches), so it never covers a size for other
# inputs (AlgoTable.coverage_problem). They pull like PULL_ALGORITHMS, but only for a caller who
# placed the input there: reading in place is the point of the area.
SYMMETRIC_INPUT_ALGORITHMS: tuple[str, ...] = ("twoshot_symm",)
# Algorithms that need the host transport (their buffers exist only in shared host memory).
HOST_ONLY_ALGORITHMS: tuple[str, ...] = ("host_oneshot", "host_twoshot")
# The fused all-reduce + residual + RMSNorm: its Triton kernels, and "unfused", the plain
# all-reduce then the library's one add + RMSNorm kernel (add_rmsnorm.py), taken where no fused
# kernel beats that pair.
FUSED_KERNELS: tuple[str, ...] = ("oneshot", "twoshot", *DATA_AS_FLAG_ONESHOTS)
UNFUSED = "unfused"
FUSED_ALGORITHMS: tuple[str, ...] = (*FUSED_KERNELS, UNFUSED)
# The fused kernels take one base address per rank as separate arguments, SMALL_WORLD of them;
# larger worlds run every fused call unfused (the one-shots' (W - 1) x message per rank makes the
# pair the better choice there anyway, and the pair keeps the whole results contract).
FUSED_MAX_WORLD: int = SMALL_WORLD


def fused_problem(algo: str, world: int) -> str | None:
    """Why the fused all-reduce + RMSNorm cannot run ``algo`` on ``world`` ranks, or None."""
    if algo in FUSED_KERNELS and world > FUSED_MAX_WORLD:
        return (f"the fused kernel {algo!r} serves world sizes up to {FUSED_MAX_WORLD}, this communicator has "
                f"{world} ranks; use algo='auto' or {UNFUSED!r} (the all-reduce, then one add + RMSNorm kernel)")
    return None


# Algorithms for ranks in two or more islands of one size, each a run of consecutive ranks
# (Communicator.island_ranks): everything but one chain of fp32 partials (and its result) stays
# inside the islands. The one-shot for small messages (three exchanges), the two-shot for large.
ISLAND_ALGORITHMS: tuple[str, ...] = ("island_twoshot", "island_oneshot")


def availability_problem(algo: str, transport: str, island_ranks: int = 0) -> str | None:
    """Why ``algo`` cannot run on a communicator of ``transport`` ("p2p" or "host") whose ranks
    form islands of ``island_ranks`` ranks each (0: no such islands), or None."""
    if transport != "host" and algo in HOST_ONLY_ALGORITHMS:
        return (f"algo={algo!r} runs on the host transport only; this communicator's transport is {transport!r} "
                "(Communicator(..., transport='host'))")
    if algo in ISLAND_ALGORITHMS and not island_ranks:
        return (f"algo={algo!r} needs the ranks in two or more islands of one size >= 2, each a run of consecutive "
                "ranks (Communicator.islands, e.g. 0-3;4-7); this communicator has no such islands")
    return None


def runs_on(algo: str, transport: str, island_ranks: int = 0) -> bool:
    """Whether ``algo`` can run on a communicator of ``transport`` with islands of ``island_ranks``
    ranks (0: none): :func:`availability_problem` finds nothing."""
    return availability_problem(algo, transport, island_ranks) is None


TABLE_ENV = "PCIE_AR_ALGO_TABLE"
#: The dtype names a rule's ``dtypes`` may list.
DTYPE_NAMES: tuple[str, ...] = tuple(sorted(DTYPE_IDS, key=DTYPE_IDS.__getitem__))
# Sizes in a table are bounded like the C++ side's uint64 byte counts (and so never make the
# arithmetic of a launch shape overflow).
_SIZE_LIMIT = (1 << 63) - 1


def capacity_of(algo: str, ll_capacity: int | None) -> int | None:
    """Largest message ``algo`` takes on a workspace of low-latency capacity ``ll_capacity``
    (None: unbounded)."""
    if ll_capacity is None or algo not in CAPPED_ALGORITHMS:
        return None
    return ll_capacity - (FULL_TWOSHOT_MARGIN if algo == "twoshot_full" else 0)


def fits_capacity(algo: str, nbytes: int, ll_capacity: int | None) -> bool:
    """Whether ``algo`` can take ``nbytes`` given the low-latency capacity (None: unbounded)."""
    limit = capacity_of(algo, ll_capacity)
    return limit is None or nbytes <= limit


@dataclass(frozen=True)
class WireBytes:
    """Bytes one rank's link carries in one call: ``out``, what this rank sends across it (its
    posted writes into peers' memory); ``into``, what crosses it toward this rank (peers' writes
    into its memory). Payload only: the flags (8 bytes per block, peer and exchange) are left out."""

    out: int
    into: int

    @property
    def busiest(self) -> int:
        """The direction that limits a call on a full-duplex link."""
        return max(self.out, self.into)


def wire_bytes(algo: str, nbytes: int, world: int, island_ranks: int = 0, elem_size: int = 2) -> WireBytes:
    """Bytes on this rank's link for one all-reduce of ``nbytes`` by ``algo`` on ``world`` ranks, a
    pure function of the call (the dtype does not enter: every format here moves the message's
    own bytes, the lines twice as many).

    - ``oneshot``, ``staged``: the message to each of the W-1 peers, and theirs to us: (W-1)N each way.
    - ``twoshot``, ``twoshot_staged``: a reduce-scatter and an all-gather, each (W-1)/W of the
      message each way (the staged form in ring order, one peer at a time).
    - ``oneshot_ll``: as ``oneshot`` in 16-byte lines of 8 payload bytes: twice the bytes.
    - ``oneshot_full``: as ``oneshot``, the data its own flag (no flag round trip, no line overhead).
    - ``twoshot_full``: as ``twoshot``, the data its own flag in both exchanges.
    - ``oneshot_pull``, ``twoshot_pull``: as ``oneshot`` and ``twoshot``, each rank's data read
      by the peers out of its own workspace instead of written into theirs (the same bytes cross
      each link, as read completions: ``out`` counts what peers read of ours).
    - ``twoshot_fp8``: as ``twoshot_pull``, the message coded as FP8 blocks (132 bytes per 128
      elements of ``elem_size`` bytes, fp8_wire_bytes), the only count the dtype enters.
    - ``twoshot_symm``: as ``twoshot_pull`` on the link (the reduce-scatter reads every rank's
      input in place, so it saves a local copy, not link bytes).
    - ``island_twoshot`` (islands of S = ``island_ranks`` ranks): a reduce-scatter and an
      all-gather inside the island, (S-1)/S of the message each way each, plus one shard across
      islands as an fp32 partial (2N/S for a 16-bit dtype, counted so) and the reduced shard
      back; the busiest rank (an owner of the first or a middle island out, of the last in)
      carries 2N each way. Only a shard's partial and its result cross from island to island.
    - ``island_oneshot``: the message to each of the S-1 island peers and theirs to us, plus
      the whole message's fp32 partial out to the next island (2N, counted so) or, in the last
      island, the result to the K-1 = W/S - 1 other islands; in: the previous island's partial
      (2N) or the result (N). The busiest rank: (S-1)N + max(2N, (K-1)N) out, (S+1)N in.

    On the host transport every byte crosses the link of the GPU that writes or reads it, and
    host memory is nobody's: ``out`` counts this rank's writes, ``into`` its reads.

    - ``host_oneshot``: the message written once, and the previous call's re-poisoned (2N out),
      the W-1 others read ((W-1)N in).
    - ``host_twoshot``: the message and the reduced shard written once, and both re-poisoned
      (2(N + N/W) out); W-1 shards of the others' messages, then W-1 reduced shards, read
      (2(W-1)N/W in).

    (The push algorithms on the host transport: the same counts as on P2P, the writes into the
    peers' host memory out and the reads of our own in.)
    """
    others = world - 1
    if algo in ("oneshot", "staged", "oneshot_full", "oneshot_pull"):
        return WireBytes(others * nbytes, others * nbytes)
    if algo in ("twoshot", "twoshot_staged", "twoshot_full", "twoshot_pull", "twoshot_symm"):
        return WireBytes(2 * others * nbytes // world, 2 * others * nbytes // world)
    if algo == "oneshot_ll":
        return WireBytes(2 * others * nbytes, 2 * others * nbytes)
    if algo in LOSSY_ALGORITHMS:
        coded = fp8_wire_bytes(nbytes // elem_size)
        return WireBytes(2 * others * coded // world, 2 * others * coded // world)
    if algo in ISLAND_ALGORITHMS:
        if not island_ranks or world % island_ranks or world // island_ranks < 2:
            raise ValueError(f"{algo!r} needs island_ranks dividing world {world} into >= 2 islands, got {island_ranks}")
        if algo == "island_oneshot":
            peers, islands = island_ranks - 1, world // island_ranks
            return WireBytes(peers * nbytes + max(2, islands - 1) * nbytes, (peers + 2) * nbytes)
        return WireBytes(2 * nbytes, 2 * nbytes)
    if algo == "host_oneshot":
        return WireBytes(2 * nbytes, others * nbytes)
    if algo == "host_twoshot":
        return WireBytes(2 * (nbytes + nbytes // world), 2 * others * nbytes // world)
    raise ValueError(f"no wire accounting for algo {algo!r}; expected one of {ALGORITHMS}")


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
                and (self.world is None or world in self.world)
                and (self.dtypes is None or dtype in self.dtypes)
                and (self.max_bytes is None or nbytes <= self.max_bytes)
                and fits_capacity(self.algo, nbytes, ll_capacity))

    def blocks_for(self, nbytes: int) -> int:
        return max(1, min(self.max_blocks, math.ceil(nbytes / self.bytes_per_block)))


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
    ``max_tokens`` tokens (None: any), what ``all_reduce_rmsnorm(algo="auto")`` runs: ``"kernel"``
    (the fused Triton kernel that follows the plain table's choice for the message, see
    ``dispatch.fused_kernel``), a named fused kernel, or ``"unfused"`` (the plain all-reduce, then
    one add + RMSNorm kernel). A named kernel that cannot take a call's shape runs unfused."""

    algo: str
    max_tokens: int | None = None
    world: tuple[int, ...] | None = None  # None: any world size

    def __post_init__(self) -> None:
        if self.algo not in FUSED_CHOICES:
            raise ValueError(f"fused table: unknown algo {self.algo!r}; expected one of {FUSED_CHOICES}")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise ValueError(f"fused table: max_tokens must be a positive int or null, got {self.max_tokens!r}")
        problem = _world_problem(self.world)
        if problem is not None:
            raise ValueError(f"fused table: {problem}")

    def matches(self, tokens: int, world: int) -> bool:
        return (self.world is None or world in self.world) and (self.max_tokens is None or tokens <= self.max_tokens)


#: What a fused rule may name: "kernel" (follow the plain table), a fused kernel, or "unfused".
FUSED_CHOICES: tuple[str, ...] = ("kernel", *FUSED_ALGORITHMS)


def default_fused_rules() -> tuple[FusedRule, ...]:
    """Where a fused kernel beats the plain all-reduce followed by the one add + RMSNorm kernel,
    and which: measured on one H200 under MPS, hidden 7168 bf16, every fused kernel against that
    pair in one run (bench/RESULTS.md, "Fused all-reduce + residual add + RMSNorm"); W = 3
    follows W = 4 and W = 5-7 follow W = 8, unmeasured. ``pcie-allreduce tune`` does not measure
    these yet: a table in $PCIE_AR_ALGO_TABLE may carry its own ``"fused"`` rules.

    - Few tokens: the data-as-flag one-shot in the plain table's wire format ("kernel"), up to
      8 tokens at W <= 4 and 4 at W >= 5 (W = 8, 4 x 7168: 11.2 us against 12.5 for the pair).
    - W = 2: the flag-based one-shot beyond (128 tokens: 12.3 against 16.4).
    - W = 3-4: the pair up to 16 tokens (W = 4, 16 tokens: 9.2 against 9.7 for the flag-based
      one-shot), then the fused kernel the plain table's size gives (32 tokens: the flag-based
      one-shot, 10.6 against 11.1; 128: the token-split two-shot, 24.7 against 32.9).
    - W >= 5: the pair up to 64 tokens (W = 8, 32 tokens: 29.5 against 32.2 for the best fused
      kernel), then the kernel the plain table's size gives (128 tokens: the token-split
      two-shot, 48.6 against 62.5).
    - W > 8 (``FUSED_MAX_WORLD``): every call runs unfused, whatever the rules say (the fused
      kernels serve up to 8 ranks)."""
    return (
        FusedRule("kernel", max_tokens=8, world=(2, 3, 4)),
        FusedRule("oneshot", world=(2,)),
        FusedRule("unfused", max_tokens=16, world=(3, 4)),
        FusedRule("kernel", world=(3, 4)),
        FusedRule("kernel", max_tokens=4),
        FusedRule("unfused", max_tokens=64),
        FusedRule("kernel"),
    )


@dataclass(frozen=True)
class AlgoTable:
    """An ordered list of rules; loading one checks that every call has a rule (:meth:`coverage_problem`).
    ``fused``: the fused table (:class:`FusedRule`), tried in order; a call past its last rule runs
    unfused."""

    rules: tuple[Rule, ...] = field(default_factory=tuple)
    fused: tuple[FusedRule, ...] = field(default_factory=default_fused_rules)

    def select_fused(self, tokens: int, world: int) -> str:
        """The fused table's choice for ``tokens`` rows on ``world`` ranks (a name of FUSED_CHOICES)."""
        for rule in self.fused:
            if rule.matches(tokens, world):
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
        """Launch shape when the caller forces ``algo``: the first rule for that algorithm that fits,
        else that algorithm's first rule; an algorithm the table never names launches as the
        table's choice for this message does (its rules' shapes are sized for the message: a
        generic shape would give a 14 KiB message one block where the table's gives four, and
        make a comparison of algorithms a comparison of launch shapes)."""
        candidates = [r for r in self.rules if r.algo == algo and r.matches(nbytes, world, dtype, symmetric=True)]
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
                           and (r.world is None or world in r.world) and (r.dtypes is None or dtype in r.dtypes)
                           for r in self.rules):
                    return (f"no rule covers every message size at world size {world} for {dtype}: the table "
                            f'needs a last rule with "max_bytes": null and an algorithm other than '
                            f'{CAPPED_ALGORITHMS + SYMMETRIC_INPUT_ALGORITHMS} for it (e.g. {{"algo": "twoshot", "world": "*"}})')
        return None

    def availability_problem(self, transport: str, island_ranks: int = 0) -> str | None:
        """Why this table cannot serve a communicator of ``transport`` with islands of
        ``island_ranks`` ranks (0: none): the module's :func:`availability_problem` of the first
        algorithm it names that cannot run there, or None."""
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
        fused = [{"algo": r.algo, "max_tokens": r.max_tokens, "world": "*" if r.world is None else list(r.world)}
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
        rules = tuple(_rule_from_dict(row, source, i) for i, row in enumerate(data["rules"]))
        if "fused" not in data:
            return _checked(cls(rules), source)
        fused = data["fused"]
        if not isinstance(fused, list) or not fused:
            raise ValueError(f'{source}: "fused" must be a list of at least one rule')
        return _checked(cls(rules, tuple(_fused_rule_from_dict(row, source, i) for i, row in enumerate(fused))), source)


def _checked(table: AlgoTable, source: str) -> AlgoTable:
    problem = table.coverage_problem()
    if problem is not None:
        raise ValueError(f"{source}: {problem}")
    return table


def _rule_from_dict(row: Any, source: str, index: int) -> Rule:
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


def _fused_rule_from_dict(row: Any, source: str, index: int) -> FusedRule:
    where = f"{source}: fused rule {index}"
    if not isinstance(row, dict):
        raise ValueError(f"{where} must be an object, got {type(row).__name__}")
    unknown = set(row) - {"algo", "max_tokens", "world"}
    if unknown:
        raise ValueError(f"{where} has unknown keys {sorted(unknown)}; known: algo, max_tokens, world")
    # Only the JSON shapes are converted here (a list becomes a tuple); FusedRule checks every value.
    world = row.get("world", "*")
    if world == "*" or world is None:
        world_t = None
    elif isinstance(world, list):
        world_t = tuple(world)
    else:
        raise ValueError(f'{where}: world must be "*", null or a non-empty list of integers, got {world!r}')
    try:
        return FusedRule(algo=row.get("algo", ""), max_tokens=row.get("max_tokens"), world=world_t)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def default_table(transport: str = "p2p", islands: int = 1) -> AlgoTable:
    """The built-in table of ``transport`` for a group of ``islands`` islands (GPUs under one PCIe
    switch or one NUMA node: :attr:`pcie_allreduce.Communicator.islands`); P2P groups of two or
    more islands take :func:`island_fabric_table`. P2P: crossovers measured on one H200 under MPS
    (`pcie-allreduce tune` measures yours), and for the two data-as-flag one-shots the bytes a
    PCIe link carries. Why each rule sits where it does, with the figures and the link model behind
    it: bench/PERF_NOTES.md, "Why the built-in tables choose what they do".
    """
    if transport == "host":
        return AlgoTable((
            Rule("host_oneshot", max_bytes=64 << 10, world=(2,), bytes_per_block=8 << 10, max_blocks=32),
            Rule("oneshot_pull", max_bytes=1 << 20, world=(2,), bytes_per_block=8 << 10, max_blocks=32),
            Rule("host_oneshot", max_bytes=96 << 10, world=(3,), bytes_per_block=8 << 10, max_blocks=32),
            Rule("host_oneshot", max_bytes=48 << 10, world=(4,), bytes_per_block=8 << 10, max_blocks=32),
            Rule("host_twoshot", max_bytes=64 << 10, world=(4,), bytes_per_block=32 << 10, max_blocks=32),
            Rule("host_oneshot", max_bytes=24 << 10, world=(5, 6), bytes_per_block=8 << 10, max_blocks=32),
            Rule("host_oneshot", max_bytes=16 << 10, world=(7, 8), bytes_per_block=8 << 10, max_blocks=32),
            Rule("host_twoshot", max_bytes=128 << 10, world=(5, 6, 7, 8), bytes_per_block=32 << 10, max_blocks=32),
            Rule("oneshot_pull", max_bytes=4 << 10, world=_WIDE_WORLDS, bytes_per_block=8 << 10, max_blocks=32),
            Rule("twoshot_pull", max_bytes=None, world=None, bytes_per_block=32 << 10, max_blocks=32),
        ))
    if islands > 1:
        return island_fabric_table()
    return AlgoTable(_FLAT_P2P_RULES)


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
    crossing = tuple(range(3, MAX_RANKS + 1))
    island_rules = (
        Rule("oneshot_full", max_bytes=512, world=crossing, bytes_per_block=4 << 10, max_blocks=32),
        Rule("twoshot_full", max_bytes=24 << 10, world=crossing, bytes_per_block=4 << 10, max_blocks=32),
        Rule("twoshot_staged", max_bytes=None, world=crossing, bytes_per_block=4 << 10, max_blocks=32),
    )
    flat_fused = tuple(r for r in default_fused_rules() if r.world is not None and 2 in r.world)
    fused = tuple(replace(r, world=(2,)) for r in flat_fused) + (FusedRule(UNFUSED),)
    return AlgoTable(island_rules + _FLAT_P2P_RULES, fused)


_SMALL_WORLDS = (2, 3, 4)
_LARGE_WORLDS = (5, 6, 7, 8)
_WIDE_WORLDS = tuple(range(SMALL_WORLD + 1, MAX_RANKS + 1))  # 9..16
# The built-in P2P rules of a single-island group (default_table's docstring says why).
_FLAT_P2P_RULES: tuple[Rule, ...] = (
    Rule("oneshot_ll", max_bytes=4 << 10, world=_SMALL_WORLDS + _LARGE_WORLDS, bytes_per_block=4 << 10, max_blocks=32),
    Rule("oneshot_full", max_bytes=512 << 10, world=_SMALL_WORLDS, bytes_per_block=4 << 10, max_blocks=32),
    Rule("oneshot_full", max_bytes=192 << 10, world=_LARGE_WORLDS, bytes_per_block=4 << 10, max_blocks=32),
    Rule("oneshot", max_bytes=1 << 20, world=_SMALL_WORLDS, bytes_per_block=4 << 10, max_blocks=32),
    Rule("oneshot", max_bytes=512 << 10, world=_LARGE_WORLDS, bytes_per_block=2 << 10, max_blocks=16),
    Rule("oneshot_full", max_bytes=16 << 10, world=_WIDE_WORLDS, bytes_per_block=4 << 10, max_blocks=32),
    Rule("twoshot_symm", max_bytes=None, world=(2,), bytes_per_block=64 << 10, max_blocks=64),
    Rule("twoshot_symm", max_bytes=None, world=None, bytes_per_block=64 << 10, max_blocks=32),
    Rule("twoshot", max_bytes=None, world=None, bytes_per_block=64 << 10, max_blocks=32),
)


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
