"""The rank side of ``python -m bench soak`` (:mod:`bench.soak`): what each of the W ranks runs.

Each rank draws the same calls from a seeded :class:`~bench.soak_schedule.Schedule` and checks
every output on the GPU against an exact sum without a host sync per call: each check adds its
count of wrong elements to a slot of a device tensor read at check-points (every ``check_every``
calls). At each check-point every rank also calls ``comm.check()``, and one gloo all-reduce
carries rank 0's decision to stop, the ranks' failures and their wrong counts, so every rank stops
after the same call. Inputs are :mod:`bench.pattern`'s small integers, so sums are exact in every
dtype and order.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
import traceback
from collections import Counter
from typing import TYPE_CHECKING, Any

from pcie_allreduce.errors import CollectiveError

if TYPE_CHECKING:
    import torch

    from pcie_allreduce.tools.ranks import RankContext

    from bench.soak_schedule import Call, GraphEpisode, Replay, Straggler

DEFAULT_CALLS = 1_000_000
DEFAULT_MINUTES = 10.0
DEFAULT_SEED = 0
CHECK_EVERY = 1000      # calls between check-points (a host sync, comm.check() and one gloo all-reduce)
PROGRESS_S = 30.0       # seconds between progress lines
GRAPH_EVERY = 5000      # calls between CUDA graph episodes (about)
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "soak")
HUNG, ERROR = "hung", "error"
MAX_LISTED = 20         # wrong calls named in a report
# torch.cuda._sleep counts clock cycles: about this many per second (H100/H200 boost ~2 GHz).
# Only the order of magnitude of a straggler's delay matters.
GPU_CYCLES_PER_S = 2e9


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    """A soak run: stop once ``calls`` calls are done and ``minutes`` have passed (both), or at
    ``limit_minutes`` with the targets missed."""

    world: int
    calls: int = DEFAULT_CALLS
    minutes: float = DEFAULT_MINUTES
    seed: int = DEFAULT_SEED
    max_bytes: int = 2 << 20
    timeout_s: float = 10.0
    transport: str = "auto"  # the communicator's (its algorithms join the schedule)
    limit_minutes: float = 0.0  # 0: 3 x minutes + 10
    check_every: int = CHECK_EVERY
    graph_every: int = GRAPH_EVERY
    progress_s: float = PROGRESS_S
    out: str = DEFAULT_OUT

    @property
    def limit_s(self) -> float:
        """Seconds after which rank 0 stops the run even if the targets are not met."""
        return 60 * (self.limit_minutes or 3 * self.minutes + 10)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def make_communicator(ctx: "RankContext", cfg: SoakConfig) -> Any:
    """This rank's communicator (a module function so the CPU tests can put a fake in its place)."""
    import pcie_allreduce

    return pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=cfg.max_bytes, timeout_s=cfg.timeout_s,
                                       transport=cfg.transport)


def soak_rank(ctx: "RankContext", cfg: SoakConfig) -> dict[str, Any]:
    """The rank function: create the communicator and its side stream's workspace, run the loop,
    close. Always returns this rank's result (a failure is in it, not raised)."""
    import torch

    from bench.environment import rank_environment

    comm = make_communicator(ctx, cfg)
    result: dict[str, Any] = {"rank": ctx.rank}
    try:
        # The capture stream, created in the same order on every rank; its workspace is created
        # collectively here, outside any capture.
        side = torch.cuda.Stream(ctx.device)
        with torch.cuda.stream(side):
            comm.prepare_stream()
        result.update(_Soak(ctx, cfg, comm, side).run())
        if ctx.rank == 0:
            result["environment"] = rank_environment(ctx)
            result["communicator"] = {"block_cap": comm.block_cap, "ll_capacity": comm.ll_capacity,
                                      "max_bytes": comm.max_bytes, "timeout_s": comm.timeout_s,
                                      "table_source": getattr(comm, "table_source", ""),
                                      "shares_gpu": getattr(comm, "shares_gpu", None)}
    finally:
        try:
            comm.close()
        except Exception as exc:  # noqa: BLE001 - the result says so; the run still reports
            result.setdefault("error", f"close() failed: {type(exc).__name__}: {exc}")
    return result


@dataclasses.dataclass
class _Data:
    """One dtype's device buffers: this rank's inputs, the exact sums over ranks, the replicated
    residual (fused dtypes), and the pools outputs are sliced from."""

    inp: "torch.Tensor"
    total: "torch.Tensor"
    residual: "torch.Tensor | None"
    out: "torch.Tensor"
    res_out: "torch.Tensor"
    scratch: "torch.Tensor"


def exact_inputs(count: int, world: int, seed: int) -> tuple[list["torch.Tensor"], "torch.Tensor"]:
    """Every rank's inputs (int64, from :mod:`bench.pattern`'s formula) and their exact sum (int64)."""
    from bench import pattern

    per_rank = [pattern.rank_values(count, rank, seed) for rank in range(world)]
    total = per_rank[0].clone()
    for values in per_rank[1:]:
        total += values
    return per_rank, total


def dtype_seed(seed: int, dtype: str) -> int:
    """The pattern seed of one dtype's buffers: different data per dtype, the same on every rank."""
    from bench.soak_schedule import PLAIN_DTYPES

    return seed * len(PLAIN_DTYPES) + PLAIN_DTYPES.index(dtype)


class _Soak:
    """One rank's run: buffers, the step loop, checks and check-points."""

    def __init__(self, ctx: "RankContext", cfg: SoakConfig, comm: Any, side: Any) -> None:
        import torch

        from bench import pattern
        from bench.options import DEFAULT_EPS
        from bench.soak_schedule import (
            FUSED_DTYPES, PLAIN_DTYPES, WEIGHT_FP32, ScheduleParams, buffer_elements, weight_elements,
        )

        self.ctx, self.cfg, self.comm, self.side = ctx, cfg, comm, side
        self.eps = DEFAULT_EPS
        dev = ctx.device
        self.params = ScheduleParams(world=ctx.world_size, max_bytes=cfg.max_bytes, ll_capacity=comm.ll_capacity,
                                     block_cap=comm.block_cap, graph_every=cfg.graph_every,
                                     transport=getattr(comm, "transport", "p2p"),
                                     island_ranks=getattr(comm, "island_ranks", 0))
        self.data: dict[str, _Data] = {}
        for name in PLAIN_DTYPES:
            dtype = getattr(torch, name)
            n = buffer_elements(cfg.max_bytes, name)
            per_rank, total = exact_inputs(n, ctx.world_size, dtype_seed(cfg.seed, name))
            residual = (pattern.residual_input(n, dtype_seed(cfg.seed, name), dtype, dev)
                        if name in FUSED_DTYPES else None)
            self.data[name] = _Data(inp=per_rank[ctx.rank].to(dev, dtype), total=total.to(dev, dtype),
                                    residual=residual, out=torch.empty(n, dtype=dtype, device=dev),
                                    res_out=torch.empty(n, dtype=dtype, device=dev),
                                    scratch=torch.empty(n, dtype=dtype, device=dev))
        self.weights = {name: pattern.weight_values(weight_elements(), getattr(torch, name), dev)
                        for name in (*FUSED_DTYPES, WEIGHT_FP32)}
        # Wrong elements per check, one slot each, read at check-points: no host sync per call.
        # A check-point comes after at most check_every calls plus one graph episode, two slots per call.
        p = self.params
        most_in_episode = p.graph_calls[1] * (p.graph_replays[1] + 1)
        self.slots = torch.zeros(2 * (cfg.check_every + most_in_episode), dtype=torch.int64, device=dev)
        self.labels: list[str] = []
        self.counts: Counter[str] = Counter()
        self.totals = Counter(calls=0, plain=0, fused=0, in_graphs=0, graphs=0, stragglers=0)
        self.wrong = 0              # this rank's wrong elements
        self.wrong_everywhere = 0   # every rank's, as the check-points' all-reduces said
        self.wrong_calls: list[str] = []

    # ---- the loop -----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Steps until the check-point where rank 0 says stop (or any rank failed)."""
        import torch.distributed as dist

        from bench.soak_schedule import Schedule

        schedule = Schedule(self.cfg.seed, self.params)
        warmup = schedule.warmup_calls()
        started = time.monotonic()
        for call in warmup:  # Triton compiles here, off the clock; checked like every call
            self._eager(call)
            self._count_wrong(self._read_slots())
        self.comm.check()
        self.warmup = {"calls": len(warmup), "seconds": time.monotonic() - started, "wrong": self.wrong,
                       "compile_s": dict(getattr(self.comm, "fused_compile_seconds", {}))}
        self.totals = Counter({key: 0 for key in self.totals})  # the soak's figures start now
        self.counts.clear()
        dist.barrier(group=self.ctx.group)
        self.start = time.monotonic()
        self.last_progress = self.start
        failure: tuple[str, str] | None = None
        while True:
            since = self.totals["calls"]
            try:
                while self.totals["calls"] - since < self.cfg.check_every:
                    self._step(schedule.next_step(self.totals["calls"]))
            except CollectiveError as exc:  # the communicator is unusable from here
                failure = (HUNG, f"{type(exc).__name__}: {exc}")
            except Exception:  # noqa: BLE001 - reported; the other ranks stop at the check-point
                failure = (ERROR, traceback.format_exc().rstrip())
            failure, stop = self._checkpoint(failure)
            if stop:
                break
        elapsed = time.monotonic() - self.start
        result = {"calls": self.totals["calls"], "elapsed_s": elapsed, "wrong": self.wrong, "warmup": self.warmup,
                  "wrong_calls": self.wrong_calls, "counts": dict(self.counts), **self.totals}
        if failure is not None:
            result["failure"], result["error"] = failure
        return result

    def _checkpoint(self, failure: tuple[str, str] | None) -> tuple[tuple[str, str] | None, bool]:
        """Read this rank's wrong counts and comm.check(); then one gloo all-reduce of (rank 0's
        stop, failed ranks, wrong elements): every rank stops after the same call."""
        import torch
        import torch.distributed as dist

        wrong = 0
        if failure is None:
            try:
                counts = self._read_slots()  # syncs: a kernel that gave up has recorded it by now
                self.comm.check()
                wrong = self._count_wrong(counts)
            except CollectiveError as exc:
                # Calls that gave up leave NaN by design: counted as this failure, not as wrong sums.
                failure = (HUNG, f"{type(exc).__name__}: {exc}")
            except Exception:  # noqa: BLE001
                failure = (ERROR, traceback.format_exc().rstrip())
            self.labels.clear()
        elapsed = time.monotonic() - self.start
        stop = 0
        if self.ctx.rank == 0:
            done = self.totals["calls"] >= self.cfg.calls and elapsed >= 60 * self.cfg.minutes
            stop = int(done or elapsed >= self.cfg.limit_s)
        flags = torch.tensor([stop, int(failure is not None), wrong], dtype=torch.int64)
        dist.all_reduce(flags, group=self.ctx.group)
        stop_all, failed, wrong_all = (int(v) for v in flags)
        self.wrong_everywhere += wrong_all
        now = time.monotonic()
        if self.ctx.rank == 0 and (now - self.last_progress >= self.cfg.progress_s or stop_all or failed):
            self.last_progress = now
            calls = self.totals["calls"]
            print(f"soak: {calls} calls, {calls / max(elapsed, 1e-9):.0f} calls/s, wrong={self.wrong_everywhere}, "
                  f"failed ranks={failed}, elapsed {elapsed:.0f} s", file=sys.stderr, flush=True)
        return failure, bool(stop_all or failed)

    def _read_slots(self) -> list[int]:
        """The wrong-element counts of the checks since the last check-point (a host sync), reset."""
        used = len(self.labels)
        if not used:
            return []
        counts = self.slots[:used].cpu().tolist()
        self.slots[:used].zero_()
        return counts

    def _count_wrong(self, counts: list[int]) -> int:
        """Add up ``counts`` (one per label) and name the first wrong calls."""
        wrong = 0
        for label, count in zip(self.labels, counts):
            if count:
                wrong += count
                if len(self.wrong_calls) < MAX_LISTED:
                    self.wrong_calls.append(f"rank {self.ctx.rank}: {count} wrong elements in {label}")
        self.wrong += wrong
        return wrong

    # ---- steps -----------------------------------------------------------------------------------

    def _step(self, step: "Call | GraphEpisode") -> None:
        from bench.soak_schedule import Call

        if isinstance(step, Call):
            self._straggle(step.straggler)
            self._eager(step)
        else:
            self._episode(step)

    def _straggle(self, straggler: "Straggler | None") -> None:
        """Make this rank late before a call, if the schedule picked it."""
        if straggler is None:
            return
        self.totals["stragglers"] += 1
        if straggler.rank != self.ctx.rank:
            return
        if straggler.host_s:
            time.sleep(straggler.host_s)
        if straggler.stream_s:
            import torch

            torch.cuda._sleep(int(straggler.stream_s * GPU_CYCLES_PER_S))

    def _count(self, call: "Call", graph: bool = False) -> None:
        import torch

        self.totals["calls"] += 1
        self.totals[call.kind] += 1
        if graph:
            self.totals["in_graphs"] += 1
        algo = call.algo
        if algo == "auto":
            dtype = getattr(torch, call.dtype)
            picked = (self.comm.select_algo(call.nbytes, dtype) if call.kind == "plain"
                      else self.comm.select_fused_algo(call.tokens, call.hidden, dtype))
            algo = f"auto({picked})"
        self.counts[f"{call.kind} {call.dtype} {algo}"] += 1

    def _eager(self, call: "Call") -> None:
        """One eager call on the current stream, poisoned outputs, checked."""
        tensors = self._tensors(call, call.in_offset, call.res_offset)
        self._launch(call, tensors)
        self._check(call, tensors, call.in_offset, call.res_offset, "eager")
        self._count(call)

    def _tensors(self, call: "Call", in_offset: int, res_offset: int) -> dict[str, "torch.Tensor"]:
        """Views into this dtype's buffers at the call's offsets, outputs poisoned with NaN."""
        d = self.data[call.dtype]
        n = call.count
        x = d.inp[in_offset:in_offset + n]
        if call.kind == "plain":
            if call.inplace:
                out = d.scratch[call.out_offset:call.out_offset + n]
                out.copy_(x)
                return {"x": out, "out": out}
            out = d.out[call.out_offset:call.out_offset + n].fill_(math.nan)
            return {"x": x, "out": out}
        assert d.residual is not None
        shape = (call.tokens, call.hidden)
        return {"x": x.view(shape), "residual": d.residual[res_offset:res_offset + n].view(shape),
                "weight": self.weights[call.weight_dtype][call.w_offset:call.w_offset + call.hidden],
                "out": d.out[call.out_offset:call.out_offset + n].fill_(math.nan).view(shape),
                "res_out": d.res_out[call.res_out_offset:call.res_out_offset + n].fill_(math.nan).view(shape)}

    def _launch(self, call: "Call", t: dict[str, "torch.Tensor"]) -> None:
        if call.kind == "plain":
            self.comm.all_reduce(t["x"], out=t["out"], algo=call.algo)
        else:
            self.comm.all_reduce_rmsnorm(t["x"], t["residual"], t["weight"], self.eps, out=t["out"],
                                         residual_out=t["res_out"], algo=call.algo)

    def _slot(self, label: str) -> "torch.Tensor":
        self.labels.append(label)
        return self.slots[len(self.labels) - 1]

    def _check(self, call: "Call", t: dict[str, "torch.Tensor"], in_offset: int, res_offset: int, where: str) -> None:
        """Enqueue the comparison with the exact result; counts go to slots (NaN counts as wrong)."""
        import torch

        from bench.norm_ops import NORMED_ATOL, NORMED_RTOL
        from bench.pattern import expected_norm

        d = self.data[call.dtype]
        expected = d.total[in_offset:in_offset + call.count]
        label = f"{call.label()} ({where}, input @{in_offset})"
        if call.kind == "plain":
            self._slot(label).add_((t["out"] != expected).sum())
            return
        assert d.residual is not None
        residual = d.residual[res_offset:res_offset + call.count].view(call.tokens, call.hidden)
        want_residual = expected.view(call.tokens, call.hidden) + residual  # small integers: exact
        self._slot(f"new residual of {label}").add_((t["res_out"] != want_residual).sum())
        want_normed = expected_norm(want_residual, t["weight"], self.eps).float()
        close = torch.isclose(t["out"].float(), want_normed, rtol=NORMED_RTOL, atol=NORMED_ATOL)
        self._slot(f"normed of {label}").add_((~close).sum())

    # ---- CUDA graphs -----------------------------------------------------------------------------

    def _episode(self, episode: "GraphEpisode") -> None:
        """Capture the episode's calls on the side stream (each run eagerly first, so Triton
        compiles outside the capture), then replay with new inputs each time, checked."""
        import torch

        from bench.soak_schedule import MAX_MISALIGN

        statics = [self._static(call, call.out_offset % MAX_MISALIGN) for call in episode.calls]
        for call, t in zip(episode.calls, statics):
            self._load(call, t, call.in_offset, call.res_offset)
            self._launch(call, t)
            self._check(call, t, call.in_offset, call.res_offset, "before capture")
            self._count(call)
        graph = torch.cuda.CUDAGraph()
        self.side.wait_stream(torch.cuda.current_stream(self.ctx.device))
        with torch.cuda.graph(graph, stream=self.side):
            for call, t in zip(episode.calls, statics):
                self._launch(call, t)
        self.totals["graphs"] += 1
        for number, replay in enumerate(episode.replays):
            self._replay(graph, episode, statics, replay, number)
        # The graph and its static tensors go when this returns; what the checks enqueued is ordered
        # after the replays on this stream, and the caching allocator keeps freed blocks stream-ordered.
        del graph

    def _static(self, call: "Call", misalign: int) -> dict[str, "torch.Tensor"]:
        """A captured call's own tensors, starting ``misalign`` elements into their allocation."""
        import torch

        dev, dtype, n = self.ctx.device, getattr(torch, call.dtype), call.count

        def fresh() -> "torch.Tensor":
            return torch.empty(n + misalign, dtype=dtype, device=dev)[misalign:]

        if call.kind == "plain":
            x = fresh()
            return {"x": x, "out": x if call.inplace else fresh()}
        shape = (call.tokens, call.hidden)
        weight = self.weights[call.weight_dtype][call.w_offset:call.w_offset + call.hidden]
        return {"x": fresh().view(shape), "residual": fresh().view(shape), "weight": weight,
                "out": fresh().view(shape), "res_out": fresh().view(shape)}

    def _load(self, call: "Call", t: dict[str, "torch.Tensor"], in_offset: int, res_offset: int) -> None:
        """New inputs into a captured call's static tensors; its outputs poisoned."""
        d = self.data[call.dtype]
        n = call.count
        t["x"].view(-1).copy_(d.inp[in_offset:in_offset + n])
        if call.kind == "fused":
            assert d.residual is not None
            t["residual"].view(-1).copy_(d.residual[res_offset:res_offset + n])
            t["res_out"].fill_(math.nan)
        if t["out"] is not t["x"]:
            t["out"].fill_(math.nan)

    def _replay(self, graph: Any, episode: "GraphEpisode", statics: list[dict[str, "torch.Tensor"]],
                replay: "Replay", number: int) -> None:
        for call, t, in_offset, res_offset in zip(episode.calls, statics, replay.in_offsets, replay.res_offsets):
            self._load(call, t, in_offset, res_offset)
        self._straggle(replay.straggler)
        graph.replay()
        for call, t, in_offset, res_offset in zip(episode.calls, statics, replay.in_offsets, replay.res_offsets):
            self._check(call, t, in_offset, res_offset, f"graph {self.totals['graphs']} replay {number}")
            self._count(call, graph=True)
