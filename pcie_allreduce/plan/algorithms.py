"""The all-reduce algorithms: one record each, and every per-algorithm fact derived from the records.

C++ defines the algorithms: their ids, names and the properties it checks before a launch
(``kAlgorithms`` in csrc/protocol_constants.h, exported by the binding as ``ALGO_RECORDS``).
:data:`REGISTRY` is the one Python list of them: name, id, where it runs, its capacity, its kind
(pull, in place, islands, compressed wire), whether a fused kernel of its name exists and the
bytes it puts on a rank's link. Tables, dispatch, validation, tune, the plugins and the harness
read the names and predicates below, all derived from the records, so adding an algorithm is one
record here next to its kernel (and its C++ record). At import the records are checked field by
field against the extension's (:func:`record_problem`): a drift fails loudly instead of launching
the wrong kernel or refusing in C++ what Python allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from pcie_allreduce import _ext
from pcie_allreduce.constants import FP8_BLOCK, FULL_TWOSHOT_MARGIN, MAX_RANKS


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


def fp8_wire_bytes(numel: int) -> int:
    """Bytes a message of ``numel`` elements takes on the FP8 wire: per block of ``FP8_BLOCK``
    elements (a last partial block included) its codes and one fp32 scale (the format:
    pcie_allreduce/fp8_wire.py; csrc/protocol_constants.h's fp8_wire_bytes)."""
    return -(-numel // FP8_BLOCK) * (FP8_BLOCK + 4)


# The wire-bytes formulas, (nbytes N, world W, island_ranks S, elem_size) -> WireBytes. The dtype
# does not enter except on the FP8 wire: every other format moves the message's own bytes. On the
# host transport every byte crosses the link of the GPU that writes or reads it and host memory is
# nobody's: ``out`` counts this rank's writes, ``into`` its reads (the push algorithms there: the
# same counts as on P2P, the writes into the peers' host memory out and the reads of our own in).
WireFormula = Callable[[int, int, int, int], WireBytes]


def _one_shot(n: int, w: int, s: int, e: int) -> WireBytes:
    """The message to each of the W-1 peers, and theirs to us: (W-1)N each way. The pull forms move
    the same bytes as read completions (``out``: what the peers read of ours)."""
    return WireBytes((w - 1) * n, (w - 1) * n)


def _two_shot(n: int, w: int, s: int, e: int) -> WireBytes:
    """A reduce-scatter and an all-gather, each (W-1)/W of the message each way (the staged form in
    ring order, the pull forms as reads; the in-place form saves a local copy, not link bytes)."""
    return WireBytes(2 * (w - 1) * n // w, 2 * (w - 1) * n // w)


def _lines(n: int, w: int, s: int, e: int) -> WireBytes:
    """The one-shot in 16-byte lines of 8 payload bytes: twice its bytes."""
    return WireBytes(2 * (w - 1) * n, 2 * (w - 1) * n)


def _fp8_two_shot(n: int, w: int, s: int, e: int) -> WireBytes:
    """The pull two-shot of the message coded as FP8 blocks (:func:`fp8_wire_bytes` of its elements)."""
    coded = fp8_wire_bytes(n // e)
    return WireBytes(2 * (w - 1) * coded // w, 2 * (w - 1) * coded // w)


def _island_two_shot(n: int, w: int, s: int, e: int) -> WireBytes:
    """A two-shot inside each island of S ranks, plus one shard across islands as an fp32 partial
    (2N/S for a 16-bit dtype) and the reduced shard back: the busiest rank carries 2N each way."""
    return WireBytes(2 * n, 2 * n)


def _island_one_shot(n: int, w: int, s: int, e: int) -> WireBytes:
    """The message to the S-1 island peers and theirs to us, plus the fp32 partial (2N) to the next
    island or, from the last island, the result to the K-1 = W/S - 1 others; in: the previous
    island's partial (2N) or the result (N). Busiest: (S-1)N + max(2N, (K-1)N) out, (S+1)N in."""
    return WireBytes((s - 1) * n + max(2, w // s - 1) * n, (s + 1) * n)


def _host_one_shot(n: int, w: int, s: int, e: int) -> WireBytes:
    """The message written once and the previous call's re-poisoned (2N out), the W-1 others read."""
    return WireBytes(2 * n, (w - 1) * n)


def _host_two_shot(n: int, w: int, s: int, e: int) -> WireBytes:
    """The message and the reduced shard written once and both re-poisoned (2(N + N/W) out); W-1
    shards of the others' messages, then W-1 reduced shards, read (2(W-1)N/W in)."""
    return WireBytes(2 * (n + n // w), 2 * (w - 1) * n // w)


@dataclass(frozen=True)
class Algorithm:
    """What Python knows of one all-reduce kernel.

    ``transport``: None where it runs on either transport, "host" where its buffers exist only in
    shared host memory. ``capacity_margin``: None where a message may fill ``max_bytes``, else the
    kernel takes messages up to the workspace's low-latency capacity less this many bytes (the
    lines, and the full-payload slots). ``pull``: peers read each rank's staged input out of its
    own workspace (csrc/pull.cuh). ``symmetric_input``: reads every rank's input in place, so the
    input must be the symmetric input area (p2p only); a table rule naming it serves only such
    calls. ``island``: for ranks in two or more islands of one size, each a run of consecutive
    ranks. ``compressed_wire``: the name ``all_reduce(x, wire=...)`` asks for this lossy wire by
    (never named by a table, tuned or chosen by auto). ``fused``: a fused all-reduce + RMSNorm
    kernel of this name exists; ``data_as_flag``: the data is its own flag (one fused kernel serves
    every such one-shot). ``wire_bytes``: the bytes on a rank's link per call. C++'s record of the
    algorithm (csrc/protocol_constants.h, kAlgorithms) has the name and id and the fields it checks
    before a launch (``transport``, ``capacity_margin``, ``island``, ``symmetric_input``,
    ``compressed_wire``); :func:`record_problem` compares them at import."""

    name: str
    id: int
    wire_bytes: WireFormula
    transport: str | None = None
    capacity_margin: int | None = None
    pull: bool = False
    symmetric_input: bool = False
    island: bool = False
    compressed_wire: str | None = None
    fused: bool = False
    data_as_flag: bool = False

    @property
    def lossy(self) -> bool:
        """A compressed wire: changes the result (bounded, pcie_allreduce/fp8_wire.py)."""
        return self.compressed_wire is not None


#: Every algorithm the kernels implement, in id order (csrc/protocol_constants.h, kAlgorithms).
REGISTRY: tuple[Algorithm, ...] = (
    Algorithm("oneshot", 0, _one_shot, fused=True),
    Algorithm("staged", 1, _one_shot),
    Algorithm("twoshot", 2, _two_shot, fused=True),
    Algorithm("oneshot_ll", 3, _lines, capacity_margin=0, fused=True, data_as_flag=True),
    Algorithm("host_oneshot", 4, _host_one_shot, transport="host"),
    Algorithm("host_twoshot", 5, _host_two_shot, transport="host"),
    Algorithm("oneshot_full", 6, _one_shot, capacity_margin=0, fused=True, data_as_flag=True),
    Algorithm("twoshot_full", 7, _two_shot, capacity_margin=FULL_TWOSHOT_MARGIN),
    Algorithm("island_twoshot", 8, _island_two_shot, island=True),
    Algorithm("oneshot_pull", 9, _one_shot, pull=True),
    Algorithm("twoshot_pull", 10, _two_shot, pull=True),
    Algorithm("twoshot_staged", 11, _two_shot),
    Algorithm("island_oneshot", 12, _island_one_shot, island=True),
    Algorithm("twoshot_symm", 13, _two_shot, symmetric_input=True),
    Algorithm("twoshot_fp8", 14, _fp8_two_shot, compressed_wire="fp8"),
)


def record_problem(records: Sequence[Algorithm], exported: Sequence[Mapping[str, Any]] | None) -> str | None:
    """Why ``records`` disagree with the algorithm records the extension exports (``ALGO_RECORDS``:
    one mapping per algorithm from a field name of :class:`Algorithm` to its value in C++; None: no
    extension, only the records' own consistency is checked), or None. Names and ids first; then,
    for every algorithm both sides have under the same id, each field C++ exports."""
    names = [r.name for r in records]
    ids = [r.id for r in records]
    if len(set(names)) != len(names) or len(set(ids)) != len(ids):
        return f"algorithm records repeat a name or an id: {dict(zip(names, ids))}"
    if exported is None:
        return None
    ours = dict(zip(names, ids))
    theirs = {str(e["name"]): int(e["id"]) for e in exported}
    parts = []
    if missing := sorted(set(theirs) - set(ours)):
        parts.append(f"no record for {', '.join(f'{n}={theirs[n]}' for n in missing)}")
    if extra := sorted(set(ours) - set(theirs)):
        parts.append(f"records the kernels lack: {', '.join(f'{n}={ours[n]}' for n in extra)}")
    if differ := sorted(n for n in set(ours) & set(theirs) if ours[n] != theirs[n]):
        parts.append("ids differ: " + ", ".join(f"{n} is {ours[n]} here, {theirs[n]} in C++" for n in differ))
    by_name = {r.name: r for r in records}
    fields = []
    for entry in exported:
        record = by_name.get(str(entry["name"]))
        if record is None or record.id != int(entry["id"]):
            continue
        for field, value in entry.items():
            if field in ("name", "id"):
                continue
            if not hasattr(record, field):
                fields.append(f"{record.name}.{field} is not a field here, {value!r} in C++")
            elif getattr(record, field) != value:
                fields.append(f"{record.name}.{field} is {getattr(record, field)!r} here, {value!r} in C++")
    if fields:
        parts.append("fields differ: " + ", ".join(fields))
    if not parts:
        return None
    return ("the algorithm records of pcie_allreduce.plan.algorithms disagree with those pcie_allreduce._C "
            f"exports (csrc/protocol_constants.h, kAlgorithms): {'; '.join(parts)}; update the records or "
            "rebuild the extension")


def check_records(records: Sequence[Algorithm], exported: Sequence[Mapping[str, Any]] | None) -> None:
    """Raise ImportError where :func:`record_problem` finds one (run at import against the extension)."""
    problem = record_problem(records, exported)
    if problem is not None:
        raise ImportError(problem)


def _exported_records() -> list[dict[str, Any]] | None:
    module = _ext.load()
    exported = None if module is None else getattr(module, "ALGO_RECORDS", None)
    return None if exported is None else [dict(entry) for entry in exported]


check_records(REGISTRY, _exported_records())

#: Algorithm name -> its record.
BY_NAME: dict[str, Algorithm] = {r.name: r for r in REGISTRY}
#: Algorithm name -> the kernels' algorithm id.
ALGO_IDS: dict[str, int] = {r.name: r.id for r in REGISTRY}


def _names(keep: Callable[[Algorithm], bool]) -> tuple[str, ...]:
    return tuple(r.name for r in REGISTRY if keep(r))


# The compressed wires: all_reduce(x, wire=NAME) runs the kernel named here. They change the
# result, so they are asked for per call and never named by a table, chosen by auto, tuned or
# forced in a sweep: they are not in ALGORITHMS.
WIRE_ALGORITHMS: dict[str, str] = {r.compressed_wire: r.name for r in REGISTRY if r.compressed_wire is not None}
LOSSY_ALGORITHMS: tuple[str, ...] = _names(lambda r: r.lossy)
#: The lossless algorithms: what a table may name, tune may time and a caller may force.
ALGORITHMS: tuple[str, ...] = _names(lambda r: not r.lossy)
#: What ``algo=`` takes besides "auto": the lossless algorithms and the wires' kernels by name.
FORCEABLE_ALGORITHMS: tuple[str, ...] = ALGORITHMS + LOSSY_ALGORITHMS
# The pull forms: tune times them on P2P, and the host table takes them for large messages.
PULL_ALGORITHMS: tuple[str, ...] = _names(lambda r: r.pull)
# Algorithms whose messages must fit the workspace's low-latency capacity (Layout.ll_capacity).
CAPPED_ALGORITHMS: tuple[str, ...] = _names(lambda r: r.capacity_margin is not None)
# The one-shots whose data is its own flag (lines; full payload): one fused kernel serves both.
DATA_AS_FLAG_ONESHOTS: tuple[str, ...] = _names(lambda r: r.data_as_flag)
# Algorithms that read every rank's input in place (Communicator.symmetric_input).
SYMMETRIC_INPUT_ALGORITHMS: tuple[str, ...] = _names(lambda r: r.symmetric_input)
# Algorithms that need the host transport.
HOST_ONLY_ALGORITHMS: tuple[str, ...] = _names(lambda r: r.transport == "host")
# Algorithms for ranks in two or more islands of one size (Communicator.island_ranks): the
# one-shot for small messages, the two-shot for large; only fp32 partials cross islands.
ISLAND_ALGORITHMS: tuple[str, ...] = _names(lambda r: r.island)
# The fused all-reduce + residual + RMSNorm: its Triton kernels, and "unfused", the plain
# all-reduce then the library's one add + RMSNorm kernel (add_rmsnorm.py), taken where no fused
# kernel beats that pair.
FUSED_KERNELS: tuple[str, ...] = _names(lambda r: r.fused)
UNFUSED = "unfused"
FUSED_ALGORITHMS: tuple[str, ...] = (*FUSED_KERNELS, UNFUSED)
# The fused kernels read every rank's workspace base from one array (WorkspaceView.bases_ptr)
# and the flags are laid out for MAX_RANKS senders: they serve every world a communicator has.
FUSED_MAX_WORLD: int = MAX_RANKS


def fused_problem(algo: str, world: int) -> str | None:
    """Why the fused all-reduce + RMSNorm cannot run ``algo`` on ``world`` ranks, or None."""
    if algo in FUSED_KERNELS and world > FUSED_MAX_WORLD:
        return (f"the fused kernel {algo!r} serves world sizes up to {FUSED_MAX_WORLD} (MAX_RANKS), got {world} "
                f"ranks; use algo='auto' or {UNFUSED!r} (the all-reduce, then one add + RMSNorm kernel)")
    return None


def call_problem(algo: str, nbytes: int, elem_size: int, transport: str, island_ranks: int, slot_bytes: int,
                 ll_capacity: int | None) -> str | None:
    """Why a call forcing ``algo`` on a message of ``nbytes`` cannot run on this communicator, or
    None: :func:`availability_problem`; a message above the algorithm's capacity (given the
    workspace's low-latency capacity ``ll_capacity``); a lossy wire's coded message larger than
    a workspace slot of ``slot_bytes``. The plain and the fused call both ask it before they
    launch; "auto" always has an answer."""
    problem = availability_problem(algo, transport, island_ranks)
    if problem is None and not fits_capacity(algo, nbytes, ll_capacity):
        problem = (f"algo={algo!r} takes messages up to {capacity_of(algo, ll_capacity)} bytes (the low-latency "
                   f"capacity of this communicator), got {nbytes}; use 'auto' or another algorithm")
    if problem is None and algo in LOSSY_ALGORITHMS:
        coded = fp8_wire_bytes(nbytes // elem_size)
        if coded > slot_bytes:
            problem = (f"wire='fp8': the coded message takes {coded} bytes, more than the workspace slot's "
                       f"{slot_bytes}; create the Communicator with a larger max_bytes")
    return problem


def availability_problem(algo: str, transport: str, island_ranks: int = 0) -> str | None:
    """Why ``algo`` cannot run on a communicator of ``transport`` ("p2p" or "host") whose ranks
    form islands of ``island_ranks`` ranks each (0: no such islands), or None."""
    record = BY_NAME.get(algo)
    if record is None:
        return None
    if record.transport is not None and transport != record.transport:
        return (f"algo={algo!r} runs on the {record.transport} transport only; this communicator's transport is "
                f"{transport!r} (Communicator(..., transport={record.transport!r}))")
    if record.island and not island_ranks:
        return (f"algo={algo!r} needs the ranks in two or more islands of one size >= 2, each a run of consecutive "
                "ranks (Communicator.islands, e.g. 0-3;4-7); this communicator has no such islands")
    return None


def runs_on(algo: str, transport: str, island_ranks: int = 0) -> bool:
    """Whether ``algo`` can run on a communicator of ``transport`` with islands of ``island_ranks``
    ranks (0: none): :func:`availability_problem` finds nothing."""
    return availability_problem(algo, transport, island_ranks) is None


def capacity_of(algo: str, ll_capacity: int | None) -> int | None:
    """Largest message ``algo`` takes on a workspace of low-latency capacity ``ll_capacity``
    (None: unbounded)."""
    record = BY_NAME.get(algo)
    if ll_capacity is None or record is None or record.capacity_margin is None:
        return None
    return ll_capacity - record.capacity_margin


def fits_capacity(algo: str, nbytes: int, ll_capacity: int | None) -> bool:
    """Whether ``algo`` can take ``nbytes`` given the low-latency capacity (None: unbounded)."""
    limit = capacity_of(algo, ll_capacity)
    return limit is None or nbytes <= limit


def wire_bytes(algo: str, nbytes: int, world: int, island_ranks: int = 0, elem_size: int = 2) -> WireBytes:
    """Bytes on this rank's link for one all-reduce of ``nbytes`` by ``algo`` on ``world`` ranks
    (islands of ``island_ranks``; ``elem_size`` counts only on the FP8 wire), a pure function of
    the call: the record's formula (each formula's docstring says what it counts)."""
    record = BY_NAME.get(algo)
    if record is None:
        raise ValueError(f"no wire accounting for algo {algo!r}; expected one of {ALGORITHMS}")
    if record.island and (not island_ranks or world % island_ranks or world // island_ranks < 2):
        raise ValueError(f"{algo!r} needs island_ranks dividing world {world} into >= 2 islands, got {island_ranks}")
    return record.wire_bytes(nbytes, world, island_ranks, elem_size)
