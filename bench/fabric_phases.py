"""The fabric model's parts (:mod:`bench.fabric_model` explains the model and calibrates it): a
fabric, the phases an all-reduce sends, the rules that turn them into a time, and the algorithms
as phases (ours as the kernels are, planned forms, FlashInfer's PCIe variants as its header
describes them). Pure Python (no torch, no GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from pcie_allreduce.plan.tables import default_table

KIB = 1024


@dataclass(frozen=True)
class Fabric:
    """A box as the model sees it. Rates in GB/s (1e9 B/s, each way), times in us."""

    name: str
    world: int = 8
    islands: int = 2                 # equal islands of consecutive ranks (NUMA nodes)
    link_gbps: float = 53.0          # one GPU's link, one way, one-to-one writes
    a2a_fraction: float = 0.072      # share of link_gbps a rank gets writing (reading) to several peers at once
    read_gbps: float = 50.0          # one-to-one peer reads (pull)
    cross_gbps: float = 23.75        # per rank across the island boundary, every rank of an island crossing
    hop_us: float = 0.4              # a posted write until the peer's poll sees it (data-as-flag)
    flag_us: float = 0.8             # a flag after data: release store until the waiter's acquire sees it
    cross_hop_us: float = 0.0        # extra latency across the island boundary
    fixed_us: float = 1.7            # launch + fixed per-call cost, CUDA-graph replay
    block_iter_us: float = 0.159     # one 16-byte load-and-store iteration of a copy loop (per thread)
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def island_size(self) -> int:
        return self.world // self.islands


@dataclass(frozen=True)
class Phase:
    """What every sending rank does at one step: ``bytes_per_peer`` x N payload bytes to each of
    ``intra_peers`` island peers and ``cross_peers`` peers across the boundary."""

    name: str
    intra_peers: int = 0
    cross_peers: int = 0
    bytes_per_peer: float = 1.0      # multiple of the message size N
    schedule: str = "concurrent"     # "concurrent": all peers at once; "staged": one peer at a time
    wire: float = 1.0                # wire bytes per payload byte (lines: 2; fp32 partials of bf16: 2)
    header_bytes: int = 0            # per block and destination
    sync: str = "data"               # "data": the data is the flag (hop_us); "flag": a flag after it (flag_us)
    stage_barriers: bool = False     # staged: every rank waits for every stage (flag_us per stage)
    barriers: int = 0                # barriers after the phase (flag_us each)
    pipelined: bool = False          # chained element by element to the phase before: transfers overlap
    senders: float = 1.0             # fraction of the ranks that send (owner forms: 1 / island size)
    fan_in: int | None = None        # peers a receiving rank hears from (None: as many as it sends to)
    pull: bool = False               # reads of the peers' memory instead of writes into it

    @property
    def peers(self) -> int:
        return self.intra_peers + self.cross_peers


@dataclass(frozen=True)
class Algorithm:
    """An all-reduce as phases. ``blocks(nbytes)`` is its launch width, ``threads`` per block."""

    name: str
    phases: tuple[Phase, ...]
    origin: str                      # "ours", "planned", "FlashInfer (modelled)", ...
    blocks: Callable[[int], int] = lambda nbytes: 16
    threads: int = 512
    note: str = ""


# ----------------------------------------------------------------------------------------------
# The model


def _rate(fab: Fabric, fanout: int, pull: bool) -> float:
    """Rules 1 and 2: a rank's rate (GB/s) to ``fanout`` peers at once."""
    if pull:
        return fab.read_gbps
    return fab.link_gbps * (fab.a2a_fraction if fanout > 1 else 1.0)


def _block_cap_us(per_peer_wire: float, blocks: int, threads: int, fab: Fabric) -> float:
    """Rule 4: the time ``blocks`` blocks need to push ``per_peer_wire`` bytes to each peer."""
    return per_peer_wire / (blocks * threads * 16) * fab.block_iter_us


def phase_terms(fab: Fabric, ph: Phase, nbytes: int, blocks: int, threads: int) -> tuple[float, float]:
    """(latency, transfer) of one phase in us."""
    if ph.peers == 0:
        return 0.0, 0.0
    per_peer = ph.bytes_per_peer * nbytes * ph.wire + ph.header_bytes * blocks
    crosses = ph.cross_peers > 0
    base_latency = fab.hop_us if ph.sync == "data" else fab.flag_us
    if ph.pull:
        base_latency += fab.hop_us  # a read is a round trip: the request goes out first
    if crosses:
        base_latency += fab.cross_hop_us
    if ph.schedule == "staged":
        stages = ph.peers
        latency = (stages * fab.flag_us if ph.stage_barriers else base_latency)
        if ph.stage_barriers and crosses:
            latency += fab.cross_hop_us
        cap = _block_cap_us(per_peer, blocks, threads, fab)
        intra_rate = fab.read_gbps if ph.pull else fab.link_gbps
        cross_rate = min(intra_rate, fab.cross_gbps)
        transfer = (ph.intra_peers * max(per_peer / (intra_rate * 1e3), cap)
                    + ph.cross_peers * max(per_peer / (cross_rate * 1e3), cap))
    else:
        latency = base_latency
        out_bytes = ph.peers * per_peer
        fan_in = ph.peers if ph.fan_in is None else ph.fan_in
        in_bytes = fan_in * per_peer
        t_out = out_bytes / (_rate(fab, ph.peers, ph.pull) * 1e3)
        t_in = in_bytes / (_rate(fab, max(fan_in, ph.peers), ph.pull) * 1e3)
        # Rule 3: every sending rank of an island puts cross_peers * per_peer on the boundary.
        boundary = ph.senders * fab.island_size * ph.cross_peers * per_peer
        t_cross = boundary / (fab.cross_gbps * fab.island_size * 1e3) if crosses else 0.0
        t_cap = _block_cap_us(per_peer, blocks, threads, fab)
        transfer = max(t_out, t_in, t_cross, t_cap)
    latency += ph.barriers * fab.flag_us
    return latency, transfer


def predict_us(fab: Fabric, algo: Algorithm, nbytes: int) -> float:
    """The model's time for one call of ``algo`` on ``nbytes`` (an estimate)."""
    blocks = max(1, algo.blocks(nbytes))
    total = fab.fixed_us
    chain_latency, chain_transfer = 0.0, 0.0
    for i, ph in enumerate(algo.phases):
        latency, transfer = phase_terms(fab, ph, nbytes, blocks, algo.threads)
        if i > 0 and not ph.pipelined:
            total += chain_latency + chain_transfer
            chain_latency, chain_transfer = 0.0, 0.0
        chain_latency += latency
        chain_transfer = max(chain_transfer, transfer)
    return total + chain_latency + chain_transfer


def algbw_gbps(nbytes: int, us: float) -> float:
    return nbytes / us / 1e3


def busbw_gbps(nbytes: int, us: float, world: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: algbw * 2(W-1)/W."""
    return algbw_gbps(nbytes, us) * 2 * (world - 1) / world


# ----------------------------------------------------------------------------------------------
# Algorithms


def _table_blocks(algo: str, fab: Fabric) -> Callable[[int], int]:
    table = default_table(islands=fab.islands)
    return lambda nbytes: table.blocks_for(algo, nbytes, fab.world, "bfloat16")


def _per_block(bytes_per_block: int, max_blocks: int) -> Callable[[int], int]:
    return lambda nbytes: max(1, min(max_blocks, math.ceil(nbytes / bytes_per_block)))


def ours(fab: Fabric) -> list[Algorithm]:
    """This library's algorithms as they are (csrc/*.cuh), flat over all W ranks, launch widths
    from the built-in table a group of the fabric's islands takes (pcie_allreduce.plan.tables.default_table)."""
    w, i = fab.world, fab.island_size
    intra, cross = i - 1, w - i
    shard = 1.0 / w
    header = 8  # bytes per block and peer: a flag (flag-based) or a header (full payload)
    return _flat_ours(fab, intra, cross, shard, header) + _island_ours(fab, header)


def _island_ours(fab: Fabric, header: int) -> list[Algorithm]:
    """island_twoshot.cuh where the fabric has islands: the reduce-scatter inside the island, the
    chain of fp32 partials island to island, the last island's sum back to every island's owner,
    and the all-gather inside each island (the critical path is a non-last island's)."""
    k, i = fab.islands, fab.island_size
    if k < 2 or i < 2:
        return []
    q = 1.0 / i
    phases = (
        Phase("island reduce-scatter (owners in turn), flag", i - 1, 0, q, schedule="staged", header_bytes=header,
              sync="flag"),
        *[Phase("fp32 partial to the next island's owner, flag", 0, 1, q, wire=2.0, header_bytes=header,
                sync="flag")] * (k - 1),
        Phase("the last island's sums to the other owners, then its peers, in turn, flag", i - 1, k - 1, q,
              schedule="staged", header_bytes=header, sync="flag"),
        Phase("the other owners forward to their island peers in turn, flag", i - 1, 0, q, schedule="staged",
              header_bytes=header, sync="flag"),
    )
    oneshot = (
        Phase("push to the island peers in turn, flag", i - 1, 0, 1.0, schedule="staged", header_bytes=header,
              sync="flag"),
        *[Phase("fp32 partial to the partner in the next island, flag", 0, 1, 1.0, wire=2.0, header_bytes=header,
                sync="flag")] * (k - 1),
        Phase("the last island's result to its partners in turn, flag", 0, k - 1, 1.0, schedule="staged",
              header_bytes=header, sync="flag"),
    )
    return [Algorithm("island_twoshot", phases, "ours", _table_blocks("island_twoshot", fab),
                      note="bitwise the flat sum: one chain of fp32 partials per shard in rank order"),
            Algorithm("island_oneshot", oneshot, "ours", _table_blocks("island_oneshot", fab),
                      note="island_oneshot.cuh: gather in the island, the whole message's fp32 chain, result back")]


def _flat_ours(fab: Fabric, intra: int, cross: int, shard: float, header: int) -> list[Algorithm]:
    return [
        Algorithm("oneshot_ll", (Phase("push lines to all", intra, cross, 1.0, wire=2.0),), "ours",
                  _table_blocks("oneshot_ll", fab),
                  note="16-byte lines carry 8 payload bytes and their flag (oneshot_ll.cuh)"),
        Algorithm("oneshot_full", (Phase("push to all", intra, cross, 1.0, header_bytes=header),), "ours",
                  _table_blocks("oneshot_full", fab),
                  note="full payload, the data its own flag, a header per block beside it (oneshot_full.cuh)"),
        Algorithm("oneshot", (Phase("push to all, flag", intra, cross, 1.0, header_bytes=header, sync="flag"),),
                  "ours", _table_blocks("oneshot", fab), note="flag after data per block and peer (oneshot.cuh)"),
        Algorithm("staged", (Phase("push one peer at a time, flag", intra, cross, 1.0, schedule="staged",
                                   header_bytes=header, sync="flag"),), "ours", _table_blocks("staged", fab),
                  note="stage s writes only to rank+s; flags go out per stage, nobody waits between stages"),
        Algorithm("twoshot", (
            Phase("reduce-scatter (owners in turn), flag", intra, cross, shard, schedule="staged",
                  header_bytes=header, sync="flag"),
            Phase("all-gather to all, flag", intra, cross, shard, header_bytes=header, sync="flag"),
        ), "ours", _table_blocks("twoshot", fab), note="twoshot.cuh: each block pushes to the owners in turn"),
        Algorithm("twoshot_staged", (
            Phase("reduce-scatter (owners in turn), flag", intra, cross, shard, schedule="staged",
                  header_bytes=header, sync="flag"),
            Phase("all-gather (peers in turn), flag", intra, cross, shard, schedule="staged", header_bytes=header,
                  sync="flag"),
        ), "ours", _table_blocks("twoshot_staged", fab),
                  note="twoshot.cuh, staged: both exchanges one peer at a time in ring order"),
        Algorithm("twoshot_full", (
            Phase("reduce-scatter (owners in turn)", intra, cross, shard, schedule="staged", header_bytes=header),
            Phase("owner sums, pushes to all", intra, cross, shard, pipelined=True),
        ), "ours", _table_blocks("twoshot_full", fab),
                  note="twoshot_full.cuh: data as flag in both phases, the owner forwards each unit as it sums it"),
        Algorithm("oneshot_pull", (Phase("stage locally, flag; read from every peer", intra, cross, 1.0,
                                         header_bytes=header, sync="flag", pull=True),), "ours",
                  _table_blocks("oneshot_pull", fab), note="pull.cuh: peers read each rank's staged input"),
        Algorithm("twoshot_pull", (
            Phase("read our shard from every peer, flag", intra, cross, shard, header_bytes=header, sync="flag",
                  pull=True),
            Phase("read every owner's sum, flag", intra, cross, shard, header_bytes=header, sync="flag", pull=True),
        ), "ours", _table_blocks("twoshot_pull", fab), note="pull.cuh: owners read their shard, then everyone the sums"),
    ]


def planned(fab: Fabric) -> list[Algorithm]:
    """Island two-level forms not written yet: reduce inside each island, exchange partials with
    the partner rank across (rank r and r + W/2), distribute inside. Quarter q of the message
    belongs to island rank q (its owner)."""
    i = fab.island_size
    if fab.islands != 2:
        return []
    q = 1.0 / i
    small = _per_block(4 * KIB, 32)
    large = _per_block(16 * KIB, 32)
    algos = []
    for part, wire in (("fp32", 2.0), ("bf16", 1.0)):
        algos.append(Algorithm(f"island_flagless_{part}", (
            Phase("island reduce-scatter", i - 1, 0, q),
            Phase(f"{part} partials with the partner", 0, 1, q, wire=wire, pipelined=True),
            Phase("island all-gather", i - 1, 0, q, pipelined=True),
        ), "planned", small, note="small messages: data as flag throughout, chained per unit"))
    algos.append(Algorithm("island_flagless_exact", (
        Phase("every quarter to both its owners", i - 1, i, q),
        Phase("island all-gather", i - 1, 0, q, pipelined=True),
    ), "planned", small, note="each owner sums all W inputs in rank order: bitwise the flat algorithms' result"))
    for part, wire in (("fp32", 2.0), ("bf16", 1.0)):
        algos.append(Algorithm(f"island_staged_{part}", (
            Phase("island reduce-scatter, one peer at a time", i - 1, 0, q, schedule="staged", sync="flag",
                  header_bytes=8),
            Phase(f"{part} partials with the partner", 0, 1, q, wire=wire, sync="flag", header_bytes=8),
            Phase("island all-gather, one peer at a time", i - 1, 0, q, schedule="staged", sync="flag",
                  header_bytes=8),
        ), "planned", large, note="large messages: one-to-one inside the islands, three flag exchanges"))
    return algos


FI = "FlashInfer (modelled from include/flashinfer/comm/pcie_ipc_all_reduce.cuh)"


def flashinfer_default_blocks(world: int, nbytes: int) -> tuple[str, int, int]:
    """FlashInfer's untuned seed policy (flashinfer/comm/pcie_ipc_policy.py): variant, blocks, threads."""
    if world == 2:
        return "UNSTAGED", 16, 128
    if nbytes >= 32 * KIB:
        return "STAGED_RING", max(1, min(4, nbytes // (256 * KIB))), 256
    if world == 4:
        return "STAGED", 1, 256
    return "UNSTAGED", 16, 256


def flashinfer(fab: Fabric) -> list[Algorithm]:
    """FlashInfer's PCIe IPC variants at W = 8 on 4 + 4 islands, as its kernel header describes
    them: sentinel (+0.0 = empty) kernels are data-as-flag, barrier kernels add flag_us per barrier.
    Launch widths: the seed policy's (``flashinfer_default_blocks``), else 16 blocks."""
    if fab.world != 8 or fab.islands != 2:
        return []
    q, e = 1.0 / 4, 1.0 / 8
    ring_blocks = lambda n: flashinfer_default_blocks(8, n)[1] if n >= 32 * KIB else 1  # noqa: E731
    return [
        Algorithm("fi_UNSTAGED", (
            Phase("island reduce-scatter to 4 owners", 3, 0, q),
            Phase("island sum to the partner", 0, 1, q, pipelined=True),
            Phase("island all-gather", 3, 0, q, pipelined=True),
        ), FI, lambda n: 16, 256, note="TP8 default < 32 KiB: island push, sentinels, no barriers"),
        Algorithm("fi_STAGED", (
            Phase("island reduce-scatter (4 block groups at once)", 3, 0, q, sync="flag"),
            Phase("owner pair exchange", 0, 1, q, sync="flag"),
            Phase("island all-gather", 3, 0, q, sync="flag", barriers=1),
        ), FI, lambda n: 16, 256, note="island decomposition, concurrent pushes, 4 barriers"),
        Algorithm("fi_STAGED_RING", (
            Phase("island reduce-scatter, 3 passes", 3, 0, q, schedule="staged", stage_barriers=True),
            Phase("pair exchange across", 0, 1, q, schedule="staged", stage_barriers=True),
            Phase("island all-gather, 3 passes", 3, 0, q, schedule="staged", stage_barriers=True, barriers=1),
        ), FI, ring_blocks, 256, note="TP8 default >= 32 KiB: <= 4 blocks, 8 barriers"),
        Algorithm("fi_FLAT_STAGED", (
            Phase("flat reduce-scatter to all", 3, 4, e),
            Phase("owners push to all", 3, 4, e, pipelined=True),
        ), FI, lambda n: 16, 256, note="W = 8 only: flat RS/AG push with sentinels, no island decomposition"),
    ]


def flashinfer_default(fab: Fabric, nbytes: int) -> Algorithm:
    """The algorithm FlashInfer's untuned policy runs at W = 8 for ``nbytes``."""
    variant = flashinfer_default_blocks(fab.world, nbytes)[0]
    return next(a for a in flashinfer(fab) if a.name == f"fi_{variant}")


def all_algorithms(fab: Fabric) -> list[Algorithm]:
    return ours(fab) + planned(fab) + flashinfer(fab)


def our_default(fab: Fabric, nbytes: int) -> Algorithm:
    """What this library's built-in table for a group of the fabric's islands runs for ``nbytes``
    bf16 at the fabric's W (pcie_allreduce.plan.tables.default_table: the island table from 2 islands)."""
    choice = default_table(islands=fab.islands).select(nbytes, fab.world, "bfloat16", ll_capacity=512 * KIB)
    return next(a for a in ours(fab) if a.name == choice.algo)
