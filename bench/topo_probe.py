"""``python -m bench topo`` measurements: W ranks (one per GPU, or W on one GPU under MPS) measure

- the flag round-trip latency of every pair (a counter bounced through each other's memory,
  system-scope release stores and acquire loads, as our kernels signal);
- the one-way write bandwidth of every ordered pair, the writer alone;
- one-to-one (every rank writes to the next, all at once) vs all-to-all (every rank writes a
  1/(W-1) share to every peer, all at once) write bandwidth per rank, the same bytes per rank:
  the collapse that staging avoids shows as all-to-all << one-to-one;
- the one-way READ bandwidth of every ordered pair (the reader alone, loads that cache nothing,
  as the pull kernels read) and the all-to-all read rate per rank: where reads beat writes
  (b12x's switch box: 52 against 2.6 GB/s), the pull forms pay;
- where the ranks form two or more islands (``ProbeJob.islands``): the cross-island rate, every
  rank writing (then reading) its partner in the next island, all at once, per rank.

Memory: a dedicated ``_C.Workspace`` (IPC-mapped into every rank, exactly the memory our
all-reduce writes into); flags at its start, the receive area after. Each rank arms a watchdog;
kernels give up after ``timeout_s`` and report it. :func:`assemble` is pure.
"""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any

FLAGS_BYTES = 4096  # 8-byte flag words, one per peer, at the start of each rank's region


@dataclasses.dataclass(frozen=True)
class ProbeJob:
    """Knobs of one probe run (picklable)."""

    nbytes: int = 16 << 20     # bytes each rank writes in a bandwidth measurement
    pingpong_iters: int = 2000
    reps: int = 10             # timed kernel launches per bandwidth measurement
    programs: int = 32         # CTAs per writing rank (split over peers for all-to-all)
    timeout_s: float = 5.0     # a kernel waiting for a peer gives up after this
    step_timeout_s: float = 60.0
    watchdog_dir: str = ""
    islands: tuple[tuple[int, ...], ...] = ()  # groups of ranks; two or more: the cross-island rates


def partner_across(islands: tuple[tuple[int, ...], ...], rank: int) -> int | None:
    """The rank at our index in the next island (round the islands), or None without islands."""
    if len(islands) < 2:
        return None
    for g, group in enumerate(islands):
        if rank in group:
            nxt = islands[(g + 1) % len(islands)]
            return nxt[group.index(rank) % len(nxt)]
    return None


def pairs(world: int) -> list[tuple[int, int]]:
    """Unordered pairs (i < j), in a fixed order every rank follows."""
    return [(i, j) for i in range(world) for j in range(i + 1, world)]


def ordered_pairs(world: int) -> list[tuple[int, int]]:
    return [(i, j) for i in range(world) for j in range(world) if i != j]


def gbps(nbytes: int, seconds: float) -> float | None:
    return None if seconds <= 0 else nbytes / seconds / 1e9


def assemble(world: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The matrices and per-rank figures from every rank's measurements (pure).

    Each rank reports {"rtt_us": {peer: us or None}, "write_gbps": {peer: GB/s or None},
    "read_gbps": {peer: GB/s or None}, "one_to_one_gbps": x, "all_to_all_gbps": x,
    "all_to_all_read_gbps": x, "cross_write_gbps": x, "cross_read_gbps": x}; entries it
    initiated only (a reader's row is the rank that reads; the cross-island ones are absent
    without islands).
    """
    rtt: list[list[float | None]] = [[None] * world for _ in range(world)]
    bw: list[list[float | None]] = [[None] * world for _ in range(world)]
    rd: list[list[float | None]] = [[None] * world for _ in range(world)]
    for rank, data in enumerate(per_rank):
        for peer, us in data.get("rtt_us", {}).items():
            rtt[rank][int(peer)] = rtt[int(peer)][rank] = us  # a round trip is symmetric
        for peer, value in data.get("write_gbps", {}).items():
            bw[rank][int(peer)] = value
        for peer, value in data.get("read_gbps", {}).items():
            rd[rank][int(peer)] = value

    def column(key: str) -> list[float | None]:
        return [d.get(key) for d in per_rank]

    def stats(values: list[float | None]) -> dict[str, float | None]:
        got = [v for v in values if v is not None]
        return {"min": min(got) if got else None, "mean": sum(got) / len(got) if got else None}

    one, many, many_read = column("one_to_one_gbps"), column("all_to_all_gbps"), column("all_to_all_read_gbps")
    one_s, many_s = stats(one), stats(many)
    ratio = (many_s["mean"] / one_s["mean"]) if one_s["mean"] and many_s["mean"] is not None else None
    result = {"world": world, "rtt_us": rtt, "write_gbps": bw, "read_gbps": rd,
              "one_to_one_gbps": one, "all_to_all_gbps": many, "all_to_all_read_gbps": many_read,
              "one_to_one": one_s, "all_to_all": many_s, "all_to_all_read": stats(many_read),
              "all_to_all_over_one_to_one": ratio}
    if any("cross_write_gbps" in d for d in per_rank):
        result["cross_write"] = stats(column("cross_write_gbps"))
        result["cross_read"] = stats(column("cross_read_gbps"))
    return result


# ---- rank side ---------------------------------------------------------------------------


class _Peers:
    """A probe workspace: this rank's region and every peer's, as addresses mapped here."""

    def __init__(self, ctx: Any, job: ProbeJob) -> None:
        import torch.distributed as dist

        from pcie_allreduce import _ext
        from pcie_allreduce.layout import WorkspaceView

        ext = _ext.require()
        self._ws = ext.Workspace(ctx.device.index, ctx.rank, ctx.world_size, FLAGS_BYTES + job.nbytes, job.timeout_s)
        handles: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(handles, self._ws.ipc_handle(), group=ctx.group)
        self._ws.open_peers(handles)
        dist.barrier(group=ctx.group)
        self.bases = WorkspaceView.of(self._ws).bases

    def flag(self, owner: int, sender: int) -> int:
        """Address of owner's flag word that ``sender`` writes."""
        return self.bases[owner] + 8 * sender

    def recv(self, owner: int, offset: int = 0) -> int:
        return self.bases[owner] + FLAGS_BYTES + offset

    def close(self) -> None:
        self._ws.close()


def _timed_push(src: Any, dests: list[int], words_per_peer: int, job: ProbeJob) -> float:
    """Seconds per push of ``words_per_peer`` words to every address in ``dests`` (mean of ``reps``)."""
    from bench import probe_kernels

    return _timed(probe_kernels.push, src, dests, words_per_peer, job)


def _timed_pull(dst: Any, sources: list[int], words_per_peer: int, job: ProbeJob) -> float:
    """Seconds per read of ``words_per_peer`` words from every address in ``sources`` into ``dst``."""
    from bench import probe_kernels

    return _timed(probe_kernels.pull, dst, sources, words_per_peer, job)


def _timed(kernel: Any, local: Any, remote: list[int], words_per_peer: int, job: ProbeJob) -> float:
    import torch

    addrs = torch.tensor(remote, dtype=torch.int64, device=local.device)
    per_peer = max(1, job.programs // len(remote))
    kernel(local, addrs, words_per_peer, per_peer)  # warm-up (and compile)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(job.reps):
        kernel(local, addrs, words_per_peer, per_peer)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / job.reps


def probe_rank(ctx: Any, job: ProbeJob) -> dict[str, Any] | None:
    """Run in every rank by ``run_ranks``; rank 0 returns :func:`assemble`'s result."""
    import torch
    import torch.distributed as dist

    from bench import probe_kernels
    from bench.watchdog import Watchdog

    world, rank = ctx.world_size, ctx.rank
    mine: dict[str, Any] = {"rtt_us": {}, "write_gbps": {}, "read_gbps": {}}
    with Watchdog(job.watchdog_dir, rank) as dog:
        dog.arm(job.step_timeout_s, "setup")
        peers = _Peers(ctx, job)
        probe_kernels.fill(peers.flag(rank, 0), world)
        words = job.nbytes // 16 * 2  # even (the push kernel's 16-byte accesses)
        src = torch.randint(-(1 << 40), 1 << 40, (words,), dtype=torch.int64, device=ctx.device)
        sink = torch.empty_like(src)  # where reads land
        torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        timeout_ns = int(job.timeout_s * 1e9)
        out = torch.zeros(2, dtype=torch.int64, device=ctx.device)
        # Compile both ping-pong variants now, on local words whose waits are already satisfied: a
        # cold compile during a measurement would stall the peer, which is spinning by then.
        scratch = torch.full((2,), 1 << 40, dtype=torch.int64, device=ctx.device)
        for initiator in (True, False):
            probe_kernels.pingpong(scratch.data_ptr(), scratch.data_ptr() + 8, out, 1, timeout_ns, initiator)
        torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        for i, j in pairs(world):
            dog.arm(job.step_timeout_s, "pingpong", pair=[i, j])
            dist.barrier(group=ctx.group)
            if rank in (i, j):
                peer = j if rank == i else i
                probe_kernels.pingpong(peers.flag(rank, peer), peers.flag(peer, rank), out, job.pingpong_iters,
                                       timeout_ns, initiator=rank == i)
                torch.cuda.synchronize()
                ok, ns = (int(v) for v in out.tolist())
                if rank == i:
                    mine["rtt_us"][peer] = ns / 1e3 / max(1, job.pingpong_iters - 1) if ok else None
        for i, j in ordered_pairs(world):
            dog.arm(job.step_timeout_s, "pair bandwidth", pair=[i, j])
            dist.barrier(group=ctx.group)
            if rank == i:
                mine["write_gbps"][j] = gbps(8 * words, _timed_push(src, [peers.recv(j)], words, job))
        # Reads: each rank's receive area holds what the write measurements left (any bytes do).
        for i, j in ordered_pairs(world):
            dog.arm(job.step_timeout_s, "pair read bandwidth", pair=[i, j])
            dist.barrier(group=ctx.group)
            if rank == i:
                mine["read_gbps"][j] = gbps(8 * words, _timed_pull(sink, [peers.recv(j)], words, job))
        dog.arm(job.step_timeout_s, "one-to-one bandwidth")
        dist.barrier(group=ctx.group)
        seconds = _timed_push(src, [peers.recv((rank + 1) % world)], words, job)
        mine["one_to_one_gbps"] = gbps(8 * words, seconds)
        dog.arm(job.step_timeout_s, "all-to-all bandwidth")
        share = words // (world - 1) // 2 * 2  # even: every destination stays 16-byte aligned
        others = [p for p in range(world) if p != rank]
        # A writer's share lands at its index among the receiver's peers: no two writers overlap.
        dests = [peers.recv(p, 8 * share * (rank if rank < p else rank - 1)) for p in others]
        dist.barrier(group=ctx.group)
        seconds = _timed_push(src, dests, share, job)
        mine["all_to_all_gbps"] = gbps(8 * share * len(others), seconds)
        dog.arm(job.step_timeout_s, "all-to-all read bandwidth")
        dist.barrier(group=ctx.group)
        seconds = _timed_pull(sink, [peers.recv(p) for p in others], share, job)
        mine["all_to_all_read_gbps"] = gbps(8 * share * len(others), seconds)
        partner = partner_across(job.islands, rank)
        if partner is not None:  # every rank and its partner in the next island, all at once
            dog.arm(job.step_timeout_s, "cross-island bandwidth")
            dist.barrier(group=ctx.group)
            mine["cross_write_gbps"] = gbps(8 * words, _timed_push(src, [peers.recv(partner)], words, job))
            dist.barrier(group=ctx.group)
            mine["cross_read_gbps"] = gbps(8 * words, _timed_pull(sink, [peers.recv(partner)], words, job))
        dog.arm(job.step_timeout_s, "teardown")
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine, group=ctx.group)
        torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        peers.close()
    if rank != 0:
        return None
    return {**assemble(world, gathered), "mps": bool(ctx.mps), "shared_gpu": bool(ctx.shared_gpu)}


def run_probe(world: int, job: ProbeJob) -> dict[str, Any]:
    """Parent: spawn ``world`` ranks (MPS when they share a GPU) and return rank 0's matrices.

    Raises RuntimeError with a one-line reason (a watchdog's phase when a rank hung).
    """
    import warnings

    from pcie_allreduce.tools import ranks
    from bench import runner, watchdog

    with tempfile.TemporaryDirectory(prefix="pcie_ar_topo_") as directory:
        probe = dataclasses.replace(job, watchdog_dir=directory)
        steps = len(pairs(world)) + 2 * len(ordered_pairs(world)) + 6
        backstop = job.step_timeout_s * steps + runner.SPAWN_SLACK_S
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ranks.MpsUnavailableWarning)
                results = ranks.run_ranks(probe_rank, world, probe, timeout_s=backstop, gpu=True, mps="auto")
        except Exception as exc:  # noqa: BLE001 - one line for the report, whatever went wrong
            failure = runner.describe_failure(exc, watchdog.read_hang(directory, world))
            raise RuntimeError(failure.reason) from None
    data = results[0]
    data["nbytes"] = job.nbytes
    data["pingpong_iters"] = job.pingpong_iters
    return data
