"""The schedule of ``python -m bench soak``: which collective every call is, from a seed alone.

Every rank must issue the same sequence of calls, so each rank builds a :class:`Schedule` from
the same seed and the same :class:`ScheduleParams` (values every rank agreed on when the
communicator was created) and draws the same steps from it: the decisions depend on nothing
else (no clock, no pointer, no rank). Pure Python, so the CPU tests check that two schedules
with one seed are identical and that every call is one the communicator accepts.

A step is an eager :class:`Call` or a :class:`GraphEpisode` (a few calls captured in one CUDA
graph, then replayed with new data). Offsets are element offsets into per-dtype buffers of
:func:`buffer_elements` elements, so slices start at arbitrary (also misaligned) addresses and
consecutive calls read different data.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Union

from pcie_allreduce.plan.algorithms import (ALGORITHMS, DATA_AS_FLAG_ONESHOTS, SYMMETRIC_INPUT_ALGORITHMS, UNFUSED,
                                            fits_capacity, runs_on)
from pcie_allreduce.plan import fused_shapes as shapes
from pcie_allreduce.sizes import DTYPE_SIZES

from bench.options import NORM_DTYPES

# dtypes by name ("bfloat16"; no torch import here, so the CPU tests and --help stay light).
PLAIN_DTYPES: tuple[str, ...] = tuple(DTYPE_SIZES)
FUSED_DTYPES: tuple[str, ...] = NORM_DTYPES
WEIGHT_FP32 = "float32"  # the fused kernels take a weight of x's dtype or fp32
# The in-place algorithms need their input in the symmetric area, which the soak's tensors are not.
PLAIN_ALGOS: tuple[str, ...] = ("auto", *(a for a in ALGORITHMS if a not in SYMMETRIC_INPUT_ALGORITHMS))
# Hidden sizes of the fused calls: models' (7168 twice, to weigh it), powers of two, and odd or
# ragged ones.
FUSED_HIDDENS: tuple[int, ...] = (7168, 7168, 4096, 5120, 8192, 2048, 1000, 2050, 129, 7, 1, 7167)
MAX_TOKENS = 64
# Triton compiles a fused kernel per shape class, dtypes and 16-byte alignment of each of its five
# pointers; a compile stalls every rank (their kernels wait for it), and fully random fused calls
# would need thousands. So each schedule draws this many fused shapes (tokens, hidden, dtype,
# weight dtype) from its seed, and a fused call's tensors are either all 16-byte aligned or all
# one element past that: a few dozen variants per run, each compiled once in the warm-up before
# the clock starts (:meth:`Schedule.warmup_calls`). Plain calls (CUDA kernels, nothing to
# compile) take any shape and any offset.
FUSED_SHAPES = 6
DECODE_SHAPE = (4, 7168, "bfloat16", "bfloat16")  # always among them: the decode shape that matters most
FUSED_ALIGN = 8  # elements: 16 bytes of the 2-byte dtypes, 32 of the fp32 weight
# Extra elements in every buffer beyond the largest message, the range of a largest call's offset.
OFFSET_SPAN = 4096
# Static tensors of a captured call start this many elements (at most) into their allocation.
MAX_MISALIGN = 8
# Seconds a rarely late rank is late: far below any sensible kernel timeout (the soak refuses
# a --timeout-s under twice the upper bound).
LATE_S = (0.8, 1.2)


@dataclasses.dataclass(frozen=True)
class ScheduleParams:
    """What the schedule depends on besides the seed; the same on every rank.

    ``ll_capacity`` and ``block_cap`` are the communicator's (agreed at creation): they decide
    where ``oneshot_ll`` is legal. The rates are per call (a straggler before about 1 call in
    ``1 / host_rate``); ``late_rate`` every ~40 s at the 2,570 calls/s of the W = 8 soak in
    bench/RESULTS.md (one H200 under MPS, 2026-12-01)."""

    world: int
    max_bytes: int
    ll_capacity: int
    block_cap: int
    graph_every: int = 5000
    transport: str = "p2p"  # the communicator's: which algorithms it runs
    island_ranks: int = 0  # the communicator's (Communicator.island_ranks): whether island algorithms run
    host_rate: float = 1 / 400
    stream_rate: float = 1 / 400
    late_rate: float = 1 / 100_000
    host_sleep_s: tuple[float, float] = (1e-4, 20e-3)
    stream_sleep_s: tuple[float, float] = (1e-4, 5e-3)
    late_s: tuple[float, float] = LATE_S
    graph_calls: tuple[int, int] = (3, 6)
    graph_replays: tuple[int, int] = (3, 6)
    fused_fraction: float = 0.25
    inplace_fraction: float = 0.1


@dataclasses.dataclass(frozen=True)
class Straggler:
    """Rank ``rank`` is late: it sleeps ``host_s`` on the host, or delays its stream ``stream_s``."""

    rank: int
    host_s: float = 0.0
    stream_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Call:
    """One collective: plain (``count`` elements) or fused (``[tokens, hidden]``).

    Offsets (elements): ``in_offset`` into the inputs (and the exact sums), ``out_offset`` into
    the outputs; fused also ``res_offset`` (residual), ``res_out_offset`` (new residual) and
    ``w_offset`` (weight). ``inplace``: plain ``out=x``, on a copy of the input."""

    kind: str  # "plain" or "fused"
    dtype: str
    algo: str
    count: int
    in_offset: int
    out_offset: int
    tokens: int = 0
    hidden: int = 0
    weight_dtype: str = ""
    res_offset: int = 0
    res_out_offset: int = 0
    w_offset: int = 0
    inplace: bool = False
    straggler: Straggler | None = None

    @property
    def nbytes(self) -> int:
        return self.count * DTYPE_SIZES[self.dtype]

    def label(self) -> str:
        """A short description for reports: "plain bfloat16 n=7169 twoshot @3+5"."""
        if self.kind == "plain":
            shape = f"n={self.count}{' in place' if self.inplace else ''}"
        else:
            shape = f"[{self.tokens}, {self.hidden}] weight {self.weight_dtype}"
        return f"{self.kind} {self.dtype} {shape} {self.algo} @{self.in_offset}+{self.out_offset}"


@dataclasses.dataclass(frozen=True)
class Replay:
    """One replay of a captured graph: new input offsets per call (and a residual offset for
    fused calls), and maybe a straggler before the replay."""

    in_offsets: tuple[int, ...]
    res_offsets: tuple[int, ...]
    straggler: Straggler | None = None


@dataclasses.dataclass(frozen=True)
class GraphEpisode:
    """Calls captured in one CUDA graph (each run once eagerly first), then replayed."""

    calls: tuple[Call, ...]
    replays: tuple[Replay, ...]

    @property
    def replayed_calls(self) -> int:
        return len(self.calls) * len(self.replays)


Step = Union[Call, GraphEpisode]


def buffer_elements(max_bytes: int, dtype: str) -> int:
    """Elements of every per-dtype buffer: the largest message plus the offset span."""
    return max_bytes // DTYPE_SIZES[dtype] + OFFSET_SPAN


def weight_elements() -> int:
    """Elements of a weight buffer: the largest hidden size plus the offset span."""
    return max(FUSED_HIDDENS) + OFFSET_SPAN


class Schedule:
    """The steps every rank issues, drawn from ``random.Random(seed)`` in one fixed order.

    :meth:`next_step` takes the number of calls done so far (the same on every rank) and returns
    a :class:`GraphEpisode` when a graph is due, else a :class:`Call`."""

    def __init__(self, seed: int, params: ScheduleParams) -> None:
        self.params = params
        self._seed = seed
        self._rng = random.Random(seed)
        self._next_graph = self._graph_gap()
        self.fused_shapes: tuple[tuple[int, int, str, str], ...] = (DECODE_SHAPE, *(
            self._fused_shape() for _ in range(FUSED_SHAPES - 1)))

    def warmup_calls(self) -> list[Call]:
        """Every fused kernel variant the schedule can issue, once: each shape with each algorithm
        it may take, aligned and misaligned. Run before the clock starts, so Triton compiles
        (seconds each, on every rank) do not count as soak time. Drawn from their own RNG: the
        schedule itself is the same with or without them."""
        rng = random.Random(f"warm-up {self._seed}")  # str seeds are hashed the same in every process
        p = self.params
        calls = []
        for tokens, hidden, dtype, weight_dtype in self.fused_shapes:
            tokens = min(tokens, p.max_bytes // (hidden * DTYPE_SIZES[dtype]))
            count = tokens * hidden
            n = buffer_elements(p.max_bytes, dtype)
            for algo in self._fused_algos(tokens, hidden, dtype):
                for misaligned in (False, True):
                    offsets = [rng.randint(0, (n - count - 1) // FUSED_ALIGN) * FUSED_ALIGN + int(misaligned)
                               for _ in range(4)]
                    w_offset = (rng.randint(0, (weight_elements() - hidden - 1) // FUSED_ALIGN) * FUSED_ALIGN
                                + int(misaligned))
                    calls.append(Call("fused", dtype, algo, count, offsets[0], offsets[1], tokens=tokens,
                                      hidden=hidden, weight_dtype=weight_dtype, res_offset=offsets[2],
                                      res_out_offset=offsets[3], w_offset=w_offset))
        return calls

    def next_step(self, calls_done: int) -> Step:
        """The next step; a graph episode once ``calls_done`` passed the next graph point."""
        if self.params.graph_every > 0 and calls_done >= self._next_graph:
            self._next_graph = calls_done + self._graph_gap()
            return self._episode()
        return self._call(stragglers=True)

    # ---- draws ------------------------------------------------------------------------------

    def _graph_gap(self) -> int:
        every = self.params.graph_every
        return max(1, self._rng.randint(every - every // 5, every + every // 5)) if every > 0 else 0

    def _offset(self, dtype: str, count: int) -> int:
        return self._rng.randint(0, buffer_elements(self.params.max_bytes, dtype) - count)

    def _log_uniform(self, bounds: tuple[float, float]) -> float:
        low, high = bounds
        return math.exp(self._rng.uniform(math.log(low), math.log(high)))

    def _straggler(self) -> Straggler | None:
        p, rng = self.params, self._rng
        u = rng.random()
        if u < p.late_rate:
            return Straggler(rng.randrange(p.world), host_s=rng.uniform(*p.late_s))
        u -= p.late_rate
        if u < p.host_rate:
            return Straggler(rng.randrange(p.world), host_s=self._log_uniform(p.host_sleep_s))
        u -= p.host_rate
        if u < p.stream_rate:
            return Straggler(rng.randrange(p.world), stream_s=self._log_uniform(p.stream_sleep_s))
        return None

    def _call(self, stragglers: bool) -> Call:
        fused = self._rng.random() < self.params.fused_fraction
        call = self._fused_call() if fused else self._plain_call()
        straggler = self._straggler() if stragglers else None
        return dataclasses.replace(call, straggler=straggler) if straggler else call

    def _plain_count(self, dtype: str) -> int:
        rng = self._rng
        largest = self.params.max_bytes // DTYPE_SIZES[dtype]
        kind = rng.random()
        if kind < 0.5:  # log-uniform over the whole range: every size class
            return max(1, min(largest, int(math.exp(rng.uniform(0, math.log(largest + 1))))))
        if kind < 0.7:  # tiny and odd
            return rng.randint(1, min(largest, 1024))
        if kind < 0.9:  # model-shaped: tokens x hidden
            count = rng.randint(1, MAX_TOKENS) * rng.choice(FUSED_HIDDENS)
            return count if count <= largest else largest
        return largest - rng.randint(0, min(largest - 1, 7))  # at the top of the range

    def _plain_call(self) -> Call:
        rng, p = self._rng, self.params
        dtype = rng.choice(PLAIN_DTYPES)
        count = self._plain_count(dtype)
        nbytes = count * DTYPE_SIZES[dtype]
        algos = [a for a in PLAIN_ALGOS
                 if a == "auto" or (fits_capacity(a, nbytes, p.ll_capacity) and runs_on(a, p.transport, p.island_ranks))]
        algo = rng.choice(algos)
        inplace = rng.random() < p.inplace_fraction
        return Call("plain", dtype, algo, count, self._offset(dtype, count), self._offset(dtype, count),
                    inplace=inplace)

    def _fused_shape(self) -> tuple[int, int, str, str]:
        rng, p = self._rng, self.params
        dtype = rng.choice(FUSED_DTYPES)
        size = DTYPE_SIZES[dtype]
        hidden = rng.choice([h for h in FUSED_HIDDENS if h * size <= p.max_bytes])
        tokens = rng.randint(1, min(MAX_TOKENS, p.max_bytes // (hidden * size)))
        return tokens, hidden, dtype, rng.choice((dtype, WEIGHT_FP32))

    def _fused_offset(self, elements: int, count: int, misaligned: bool) -> int:
        """An offset that is a multiple of FUSED_ALIGN, plus one element when ``misaligned``."""
        return self._rng.randint(0, (elements - count - 1) // FUSED_ALIGN) * FUSED_ALIGN + int(misaligned)

    def _fused_call(self) -> Call:
        rng, p = self._rng, self.params
        tokens, hidden, dtype, weight_dtype = rng.choice(self.fused_shapes)
        tokens = min(tokens, p.max_bytes // (hidden * DTYPE_SIZES[dtype]))  # DECODE_SHAPE at a small max_bytes
        count = tokens * hidden
        algo = rng.choice(["auto", *self._fused_algos(tokens, hidden, dtype)])
        misaligned = rng.random() < 0.25
        n = buffer_elements(p.max_bytes, dtype)
        in_offset, out_offset, res_offset, res_out_offset = (
            self._fused_offset(n, count, misaligned) for _ in range(4))
        return Call("fused", dtype, algo, count, in_offset, out_offset, tokens=tokens, hidden=hidden,
                    weight_dtype=weight_dtype, res_offset=res_offset, res_out_offset=res_out_offset,
                    w_offset=self._fused_offset(weight_elements(), hidden, misaligned))

    def _fused_algos(self, tokens: int, hidden: int, dtype: str) -> list[str]:
        """The fused kernels that can take ``[tokens, hidden]`` of ``dtype`` (the data-as-flag ones
        where the dispatch finds them a launch shape), and the unfused pair (the plain all-reduce,
        then the add + RMSNorm kernel)."""
        p = self.params
        return ["oneshot", "twoshot", UNFUSED, *(
            k for k in DATA_AS_FLAG_ONESHOTS if shapes.data_as_flag_for_call(
                k, tokens, hidden, DTYPE_SIZES[dtype], p.world, p.ll_capacity, p.block_cap) is not None)]

    def _episode(self) -> GraphEpisode:
        rng, p = self._rng, self.params
        calls = tuple(self._call(stragglers=False) for _ in range(rng.randint(*p.graph_calls)))
        replays = []
        for _ in range(rng.randint(*p.graph_replays)):
            in_offsets = tuple(self._offset(c.dtype, c.count) for c in calls)
            res_offsets = tuple(self._offset(c.dtype, c.count) if c.kind == "fused" else 0 for c in calls)
            replays.append(Replay(in_offsets, res_offsets, self._straggler()))
        return GraphEpisode(calls, tuple(replays))


def steps(seed: int, params: ScheduleParams, calls: int) -> list[Step]:
    """The steps of the first ``calls`` calls (at least) of the schedule of ``seed`` (for tests)."""
    schedule = Schedule(seed, params)
    out: list[Step] = []
    done = 0
    while done < calls:
        step = schedule.next_step(done)
        out.append(step)
        done += step.replayed_calls + len(step.calls) if isinstance(step, GraphEpisode) else 1
    return out
