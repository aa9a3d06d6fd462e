"""The fused all-reduce + residual + RMSNorm call, from its validated arguments to the launch.

One object, :class:`FusedPath`, per communicator owns what a fused call does after the
communicator checked its arguments: the plan of each call shape (which fused kernel, or the
unfused pair, with its launch shape and signature: :func:`pcie_allreduce.plan.dispatch.fused_plan`,
computed once per shape and cached), the first-call compile meeting (every rank compiles a call
shape's kernels before any rank launches them), and the launch on the current stream. The
unfused pair launches the plain all-reduce straight from the plan, never through the public
``all_reduce`` (the call was validated once). The Triton kernels live in their modules
(:mod:`~pcie_allreduce.fused.rmsnorm`, :mod:`~pcie_allreduce.fused.oneshot_ll`,
:mod:`~pcie_allreduce.fused.oneshot_quads`, :mod:`~pcie_allreduce.fused.add_rmsnorm`), imported on the
first launch: choosing needs no Triton.
"""

from __future__ import annotations

import functools
import time
import zlib
from types import ModuleType
from typing import Any, Callable

import torch

from pcie_allreduce import outcomes, workspaces
from pcie_allreduce.constants import FULL_HEADER_BYTES
from pcie_allreduce.errors import CollectiveMismatch
from pcie_allreduce.plan import fused_shapes
from pcie_allreduce.layout import Layout, WorkspaceView
from pcie_allreduce.plan import dispatch
from pcie_allreduce.plan.algorithms import DATA_AS_FLAG_ONESHOTS, UNFUSED, fits_capacity

# How long a rank waits for the others at the first fused call of a shape, while they compile it
# (a cold Triton cache on a loaded host takes tens of seconds); past it the ranks' calls must differ.
FIRST_FUSED_CALL_WAIT_S = 300
MEETING_STAGE = "first-call compile meeting"
VECTOR_BYTES = 16  # the widest access a kernel's thread makes (its aligned variant)
_MAX_PLANS = 4096  # bounded caches: the shapes a server serves are few


class FusedPath:
    """A communicator's fused all-reduce + residual + RMSNorm: per call shape its plan (cached),
    the compile meeting on its first call, and the launch on the current stream. Each call is
    given the communicator (its agreed table, capacity, block cap), never kept here, so the path
    holds no reference back to it; the meetings are held in ``group``'s store under
    ``meeting_key``, which names this communicator alike on every rank."""

    def __init__(self, group: Any, meeting_key: str) -> None:
        self._group = group
        self._meeting_key = meeting_key
        self._plans: dict[tuple[Any, ...], dispatch.FusedPlan] = {}
        self._compiled: set[tuple[Any, ...]] = set()  # calls compiled on every rank
        self._meetings = 0  # meetings held: the same count on every rank
        self._views: dict[int, WorkspaceView] = {}
        #: Seconds this rank spent compiling the Triton kernels of each fused call shape (its first
        #: call), by the call's description: "<algo> [tokens, hidden] <dtype> (weight <dtype>)".
        self.compile_seconds: dict[str, float] = {}

    def call(self, comm: Any, workspace: Any, stream: int, x: torch.Tensor, residual: torch.Tensor,
             weight: torch.Tensor, eps: float, normed: torch.Tensor, new_residual: torch.Tensor, algo: str,
             wire_algo: str | None) -> None:
        """Run one validated call with at least one token on ``stream`` (the current stream, served
        by ``workspace``): its plan, on the shape's first call the compile meeting, then the
        launch: the plain all-reduce into ``normed`` and the add + RMSNorm kernel, or one fused
        kernel."""
        key = (*x.shape, x.dtype, weight.dtype, algo, wire_algo)
        plan = self._plans.get(key) or self.plan(comm, key)
        view = None
        if plan.algo != UNFUSED:
            if workspace.failed():
                raise workspaces.error_of(workspace)
            if not workspace.captured:  # a graph capture: close() must keep this memory (all_reduce notes it in C++)
                workspace.note_capture(stream)
            view = self.view_of(workspace)
        if plan.call not in self._compiled:
            self._compile_everywhere(comm, plan.call, lambda: _run(
                view, plan, x, residual, weight, eps, normed, new_residual, compile_only=True,
                dependent=comm.dependent_launch))
        if plan.algo == UNFUSED and workspace.all_reduce(plan.plain_id, x.data_ptr(), normed.data_ptr(), x.nbytes,
                                                          dispatch.DTYPE_IDS[x.dtype], plan.blocks, stream):
            raise workspaces.error_of(workspace)
        _run(view, plan, x, residual, weight, eps, normed, new_residual, dependent=comm.dependent_launch)

    def warm_up(self, comm: Any, workspace: Any,
                calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]]) -> int:
        """Compile the kernels of validated calls ``calls`` (x, residual, weight, algo: tensors of
        the calls' shapes and dtypes) ahead of their first calls, the work shared out among the
        ranks; returns how many call shapes were new. Every rank compiles every W-th new shape
        into Triton's on-disk cache, then each shape's compile meeting (as at a first call) has
        every rank load it, from that cache where the ranks share one (ranks of one host do by
        default) and compiling it again where not. A shape whose share failed to compile fails
        again at its meeting, which every rank then raises."""
        pending: dict[tuple[Any, ...], tuple[dispatch.FusedPlan, tuple[torch.Tensor, ...]]] = {}
        for x, residual, weight, algo in calls:
            plan = self.plan(comm, (*x.shape, x.dtype, weight.dtype, algo, None))
            if plan.call not in self._compiled:
                outputs = (torch.empty_like(x), torch.empty_like(residual))
                pending.setdefault(plan.call, (plan, (x, residual, weight, *outputs)))
        view = None
        if any(plan.algo != UNFUSED for plan, _ in pending.values()):
            view = self.view_of(workspace)

        def compile_call(plan: dispatch.FusedPlan, tensors: tuple[torch.Tensor, ...]) -> Callable[[], None]:
            x, residual, weight, normed, new_residual = tensors
            return lambda: _run(view, plan, x, residual, weight, 1e-6, normed, new_residual, compile_only=True,
                                dependent=comm.dependent_launch)

        for i, (plan, tensors) in enumerate(pending.values()):
            if i % comm.world_size == comm.rank:
                try:
                    compile_call(plan, tensors)()
                except Exception:  # noqa: BLE001 - compiled again at its meeting, which tells every rank
                    pass
        for call, (plan, tensors) in pending.items():
            self._compile_everywhere(comm, call, compile_call(plan, tensors))
        return len(pending)

    def view_of(self, workspace: Any) -> WorkspaceView:
        """The fused kernels' view of ``workspace``, made at its first fused call (no copy: the
        bases table is the workspace's own, so inside a graph capture too)."""
        view = self._views.get(id(workspace))
        if view is None:
            view = self._views[id(workspace)] = WorkspaceView.of(workspace)
        return view

    def plan(self, comm: Any, key: tuple[Any, ...]) -> dispatch.FusedPlan:
        """:func:`~pcie_allreduce.plan.dispatch.fused_plan` for ``key`` (tokens, hidden, dtype,
        weight dtype, algo, the wire's kernel) on ``comm``'s agreed values, cached (:meth:`call`
        looks the cache up itself first: the hot path saves a method call)."""
        cached = self._plans.get(key)
        if cached is not None:
            return cached
        tokens, hidden, dtype, weight_dtype, algo, wire_algo = key
        plan = dispatch.fused_plan(tokens, hidden, dtype, comm.world_size, comm.table, ll_capacity=comm.ll_capacity,
                                   block_cap=comm.block_cap, interpret=_triton().protocol.interpreting(), algo=algo,
                                   weight_dtype=weight_dtype, wire_algo=wire_algo, transport=comm.transport,
                                   island_ranks=comm.island_ranks, slot_bytes=Layout.make(comm.max_bytes, 1).slot_bytes)
        if len(self._plans) < _MAX_PLANS:
            self._plans[key] = plan
        return plan

    def _compile_everywhere(self, comm: Any, call: tuple[Any, ...], compile_call: Callable[[], None]) -> None:
        """Compile a fused call's Triton kernels on this rank, then meet every rank before any of
        them launches it.

        A kernel's waits count from its own start: a peer still compiling (a second or more, far
        more with a cold cache or a loaded CPU) would make the ranks already spinning time out. So
        the first call of each (algorithm, shape, dtypes) compiles, then meets the others; the
        kernels' compile keys do not depend on the tensors' alignment (FUSED_TENSOR_ARGS), so every
        rank meets at the same call. The meeting also checks that every rank makes that same call,
        and it is bounded: a rank that never comes (its calls differ from ours) raises here.

        The meeting is held in the group's key-value store (:func:`pcie_allreduce.outcomes.meet`),
        never as a collective on the group: a collective that timed out would stay posted on the
        caller's group (SGLang's CPU group) and pair with that group's next collective. A rank
        that gives up marks its key abandoned, so a rank that arrives later raises too instead of
        launching a kernel nobody else runs."""
        described = "{} [{}] {} (weight {})".format(call[0], ", ".join(map(str, call[1])), *call[2:])
        what = f"the first fused all-reduce + RMSNorm of {described}"
        digest = zlib.crc32(described.encode())
        started = time.perf_counter()
        try:
            compile_call()
        except Exception:
            # Every rank hears of it before this one raises its own exception. Raised from inside
            # the handler, never kept in a local: a frame holding its own exception is a reference
            # cycle that keeps the communicator (and its group) alive until a cyclic collection,
            # perhaps at interpreter exit, after the group was destroyed.
            self.compile_seconds[described] = time.perf_counter() - started
            self._meet(what, f"{digest}:1")
            raise
        self.compile_seconds[described] = time.perf_counter() - started
        everyone = self._meet(what, f"{digest}:0")
        digests = [int(v.split(":")[0]) for v in everyone]
        failed = [r for r, v in enumerate(everyone) if v.split(":")[1] != "0"]
        differing = [r for r, d in enumerate(digests) if d != digests[comm.rank]]
        if differing:
            raise CollectiveMismatch(f"rank {comm.rank} calls the fused all-reduce + RMSNorm as {described}; ranks "
                                     f"{differing} make a different call at the same point (algorithm, shape or dtypes "
                                     "differ): every rank must make the same call")
        if failed:
            raise RuntimeError(f"rank {comm.rank}: compiling the fused kernel for {described} failed on rank(s) "
                               f"{failed} (their exception says why)")
        self._compiled.add(call)

    def _meet(self, what: str, mine: str) -> list[str]:
        """Every rank's ``mine`` for this path's next meeting (the count is the same on every rank),
        within FIRST_FUSED_CALL_WAIT_S, under the communicator's meeting key."""
        self._meetings += 1
        return outcomes.meet(self._group, self._meeting_key, self._meetings - 1, what, mine,
                             wait_s=FIRST_FUSED_CALL_WAIT_S, stage=MEETING_STAGE)


# ---- the launches ------------------------------------------------------------------------


class _TritonSide:
    """The Triton modules: the kernels and the protocol (which says whether they run interpreted)."""

    def __init__(self) -> None:
        from pcie_allreduce.fused import add_rmsnorm, oneshot_ll, oneshot_quads, protocol, rmsnorm

        self.add_rmsnorm: ModuleType = add_rmsnorm
        self.oneshot_ll: ModuleType = oneshot_ll
        self.oneshot_quads: ModuleType = oneshot_quads
        self.protocol: ModuleType = protocol
        self.rmsnorm: ModuleType = rmsnorm


@functools.cache
def _triton() -> _TritonSide:
    """The Triton modules, imported on the first fused call (choosing needs no Triton) and then
    kept, so a call's launch looks its kernels up instead of importing them again."""
    return _TritonSide()


def compile_and_load(kernel: Any, *args: Any, grid: tuple[int, ...], **kwargs: Any) -> None:
    """Make ``kernel``'s launch with these arguments ready without launching it: compile it (or
    take it from Triton's cache), build its launcher and load its module into this process.

    ``warmup`` alone only compiles. The launcher (a small C module Triton builds with the host's
    C compiler, cached on disk per signature) and the module load then wait for the first launch.
    A fused call's first launch comes right after every rank met (the first-call meeting), with
    the peers already spinning in the kernel, so that work must not be left for it: with a cold
    cache on a loaded CPU it can take one rank past the kernel's timeout."""
    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    init_handles = getattr(compiled, "_init_handles", None)
    if callable(init_handles):  # every Triton of the supported range (3.4-3.9)
        init_handles()
    else:  # reading .run initialises the handles where _init_handles is gone
        getattr(compiled, "run")


def is_aligned(hidden: int, *tensors: torch.Tensor) -> bool:
    """Whether every tensor starts on a 16-byte boundary and every row does too: a kernel's
    vector variant applies (same results as the other, faster)."""
    return (hidden * tensors[0].element_size()) % VECTOR_BYTES == 0 and all(
        t.data_ptr() % VECTOR_BYTES == 0 for t in tensors)


def _pdl(dependent: bool, interpret: bool) -> dict[str, Any]:
    return {"PDL": True, "launch_pdl": True} if dependent and not interpret else {}


def _run(view: WorkspaceView | None, plan: dispatch.FusedPlan, x: torch.Tensor, residual: torch.Tensor,
         weight: torch.Tensor, eps: float, normed: torch.Tensor, new_residual: torch.Tensor, *,
         compile_only: bool = False, dependent: bool = False) -> None:
    """Launch what ``plan`` names: the add + RMSNorm kernel of the unfused pair on ``normed``
    (which the plain all-reduce filled; ``dependent``: as its programmatic dependent), or the
    fused kernel on ``view``. ``compile_only``: ready every variant, launch nothing."""
    if plan.algo == UNFUSED:
        _norm(normed, residual, weight, eps, normed, new_residual, plan.shape, compile_only=compile_only,
              after_all_reduce=dependent)
    else:
        assert view is not None
        _fused(view, plan.algo, plan.shape, plan.signature, x, residual, weight, eps, normed, new_residual,
               interpret=_triton().protocol.interpreting(), compile_only=compile_only, dependent=dependent)


def _norm(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, normed: torch.Tensor,
          new_residual: torch.Tensor, shape: tuple[int, ...], *, compile_only: bool = False,
          after_all_reduce: bool = False) -> None:
    """The add + RMSNorm kernel with its launch shape (:func:`fused_shapes.add_rmsnorm`); see :func:`add_rmsnorm`."""
    triton_side = _triton()
    norm = triton_side.add_rmsnorm
    tokens, hidden = y.shape
    interpret = triton_side.protocol.interpreting()
    if compile_only and interpret:
        return
    block, num_warps = shape
    tensors = (y, residual, weight, normed, new_residual)
    args = (*(t.data_ptr() for t in tensors), float(eps))
    constexprs = dict(H=hidden, BLOCK=block, DT=norm.TRITON_DTYPES[y.dtype], WT=norm.TRITON_DTYPES[weight.dtype],
                      INTERPRET=interpret, num_warps=num_warps, **_pdl(after_all_reduce, interpret))
    if compile_only:
        for aligned in (True, False):
            compile_and_load(norm._add_rmsnorm_kernel, *args, grid=(max(tokens, 1),), ALIGNED=aligned, **constexprs)
    elif tokens:
        norm._add_rmsnorm_kernel[(tokens,)](*args, ALIGNED=is_aligned(hidden, *tensors), **constexprs)


def _fused(view: WorkspaceView, algo: str, shape: tuple[int, ...], signature: int, x: torch.Tensor,
           residual: torch.Tensor, weight: torch.Tensor, eps: float, normed: torch.Tensor, residual_out: torch.Tensor,
           *, interpret: bool, compile_only: bool = False, dependent: bool = False, backoff_ns: int = 0,
           quads: bool | None = None) -> None:
    """The fused kernel ``algo`` with its launch shape and signature (what the plan computed:
    fused_shapes.data_as_flag or fused_shapes.flag_based) on the current stream.

    ``compile_only``: compile (or load from Triton's cache) every variant this call's shape and
    dtypes can launch (both word pairings, or both alignments), launch nothing (nothing to compile
    under the interpreter). ``dependent``: launch as the previous kernel's programmatic dependent
    ($PCIE_AR_PDL). ``backoff_ns`` > 0 (data-as-flag only) sleeps that long between polls (an
    experiment for ranks sharing a GPU, bench/PERF_NOTES.md; 0 compiles the same code as without).
    ``quads`` (full payload only): True / False runs the 16-byte quads kernel / the word kernel
    whatever :func:`fused_shapes.takes_quads` says (tests and the harness: every rank of a call
    must pass the same); None follows it."""
    triton_side = _triton()
    dtypes = triton_side.add_rmsnorm.TRITON_DTYPES
    if compile_only and interpret:
        return
    tokens, hidden = x.shape
    layout = view.layout
    if algo in DATA_AS_FLAG_ONESHOTS:
        kernel = triton_side.oneshot_ll._fused_oneshot_ll_kernel
        programs, chunks, width, block_w, num_warps = shape
        full = algo != DATA_AS_FLAG_ONESHOTS[0]
        slots = ((layout.ll_capacity, layout.full_offset + FULL_HEADER_BYTES, layout.full_offset) if full
                 else (layout.ll_slot_bytes, layout.ll_offset, layout.ll_offset))
        args = (x, residual, weight, normed, residual_out, view.bases_ptr, view.bases[view.rank], view.error_ptr,
                view.rank, tokens, hidden, float(eps), signature, view.timeout_ns, *slots,
                view.local_offset(layout.control_offset), view.local_offset(layout.stats_offset), layout.flags_offset)
        common = dict(C=chunks, CW=width, W=view.world, WP=fused_shapes.next_power_of_2(view.world),
                      INTERPRET=interpret, **({"BACKOFF": backoff_ns} if backoff_ns else {}), **_pdl(dependent, interpret))
        quad_warps = fused_shapes.quad_warps(shape, hidden) if full else None
        if quads is None:
            quads = full and fused_shapes.takes_quads(shape, hidden, view.world)
        elif quads and quad_warps is None:
            raise ValueError(f"fused {algo}: [{tokens}, {hidden}] in chunks of {width} columns is not whole 16-byte "
                             "quads of 8 elements (the full payload's, rows and chunks a multiple of 8 elements)"
                             if full else f"fused {algo}: 16-byte quads are the full payload's (oneshot_full)")
        if quads:  # 16-byte quads; VECTOR follows the tensors' alignment (any rank's, any call's)
            kernel = triton_side.oneshot_quads._fused_oneshot_full_quads_kernel
            constexprs = dict(BLOCK_Q=block_w // 4, num_warps=quad_warps, **common)
            variant = "VECTOR"
            chosen = all(t.data_ptr() % VECTOR_BYTES == 0 for t in (x, residual, normed, residual_out))
        else:  # 4-byte words; PAIRED follows the tensors' alignment
            constexprs = dict(BLOCK_W=block_w, PUSH=min(fused_shapes.PUSH_WORDS, block_w), FULL=full,
                              num_warps=num_warps, **common)
            variant = "PAIRED"
            chosen = all(t.data_ptr() % 4 == 0 for t in (x, residual, normed, residual_out))
        if compile_only:
            for value in (True, False):
                compile_and_load(kernel, *args, grid=(programs,), **{variant: value}, **constexprs)
        else:
            kernel[(programs,)](*args, **{variant: chosen}, **constexprs)
        return
    programs, rows, block_h, num_warps = shape
    tensors = (x, residual, weight, normed, residual_out)
    args = (*(t.data_ptr() for t in tensors), view.bases_ptr, view.bases[view.rank], view.error_ptr,
            view.rank, tokens, rows, float(eps), signature, view.timeout_ns,
            layout.slot_bytes, layout.parity_bytes, layout.flags_offset, view.local_offset(layout.control_offset))
    # The compile key holds the hidden size, dtypes, W and ALIGNED, never the token count: one
    # compilation per model shape serves every batch.
    constexprs = dict(H=hidden, DT=dtypes[x.dtype], WT=dtypes[weight.dtype], W=view.world,
                      BLOCK_H=block_h, INTERPRET=interpret, num_warps=num_warps, **_pdl(dependent, interpret))
    flag_based = triton_side.rmsnorm
    kernel = flag_based._fused_oneshot_kernel if algo == "oneshot" else flag_based._fused_twoshot_kernel
    if compile_only:
        for aligned in (True, False):
            compile_and_load(kernel, *args, grid=(programs,), ALIGNED=aligned, **constexprs)
    else:
        kernel[(programs,)](*args, ALIGNED=is_aligned(hidden, *tensors), **constexprs)


# ---- the same launches, shape computed here (tests, tools, the hierarchy) ------------------


def add_rmsnorm(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                normed: torch.Tensor, new_residual: torch.Tensor, *, compile_only: bool = False,
                after_all_reduce: bool = False) -> None:
    """Enqueue ``new_residual = residual + y``, ``normed = rmsnorm(new_residual) * weight`` on the
    current stream (arguments already validated: contiguous ``[tokens, hidden]`` bf16/fp16,
    weight ``[hidden]`` of the same dtype or fp32). ``normed`` may be ``y`` and ``new_residual``
    may be ``residual`` (in place).

    ``after_all_reduce``: the kernel just before this one on the stream is the library's
    all-reduce that wrote ``y`` (and nothing of ``residual`` or ``weight``): the kernel is then
    launched as its programmatic dependent (Hopper and later), starting while that kernel ends and
    waiting for it only before it reads ``y``. ``compile_only``: compile both variants (16-byte
    aligned or not) for this shape and dtypes, launch nothing; nothing to compile under the
    interpreter."""
    _norm(y, residual, weight, eps, normed, new_residual, fused_shapes.add_rmsnorm(y.shape[1]),
          compile_only=compile_only, after_all_reduce=after_all_reduce)


def launch(view: WorkspaceView, algo: str, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
           eps: float, normed: torch.Tensor, residual_out: torch.Tensor, *, interpret: bool | None = None,
           max_programs: int = fused_shapes.FLAG_MAX_PROGRAMS, chunks: int | None = None, compile_only: bool = False,
           dependent: bool = False, backoff_ns: int = 0, quads: bool | None = None) -> None:
    """Enqueue one fused call of kernel ``algo`` on the current stream (arguments validated),
    computing its launch shape (``max_programs``: the block cap) and signature first.

    ``chunks`` forces that many column chunks per row on a data-as-flag kernel instead of its
    shape's choice (tests: under the interpreter the choice is 1, which never exercises the row
    statistics exchange between programs); ``quads`` forces the full payload's quads kernel (True)
    or word kernel (False) as :func:`_fused` says. Raises ValueError where the kernel cannot take
    the call (a data-as-flag one with an odd hidden size, too many programs or too large a message,
    forced quads on rows that are not whole quads)."""
    interpret = _triton().protocol.interpreting() if interpret is None else interpret
    tokens, hidden = x.shape
    launch = (fused_shapes.of_kernel(algo, x.dtype, tokens, hidden, view.world, max_programs, interpret, chunks)
              if fits_capacity(algo, x.nbytes, view.layout.ll_capacity) else None)
    if launch is None:
        raise ValueError(fused_shapes.no_shape(algo, tokens, hidden, x.dtype, view.world, view.layout.ll_capacity,
                                               max_programs))
    _fused(view, algo, *launch, x, residual, weight, eps, normed, residual_out, interpret=interpret,
           compile_only=compile_only, dependent=dependent, backoff_ns=backoff_ns, quads=quads)
