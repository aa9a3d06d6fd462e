"""The object users hold: its state, per-stream workspaces, caches of choices, errors, lifetime.

Creation's collective steps are :mod:`pcie_allreduce.rendezvous` (what every rank agrees on) and
:mod:`pcie_allreduce.workspaces` (one stream's workspace); what a call launches is decided by
:mod:`pcie_allreduce.plan.dispatch` (pure functions). The communicator holds the state those
choices read (agreed table, capacity, block cap) and caches their results per call shape."""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from pcie_allreduce import ops, rendezvous, validation, workspaces
from pcie_allreduce.fabric import topology
from pcie_allreduce.plan import algorithms, dispatch, tables
from pcie_allreduce.plan.dispatch import DTYPE_IDS
from pcie_allreduce.fused.path import FusedPath
from pcie_allreduce.layout import Layout

DEFAULT_MAX_BYTES = 8 << 20
logger = logging.getLogger("pcie_allreduce")


# Communicators alive in this process, for the fork handler.
_LIVE: "weakref.WeakSet[Communicator]" = weakref.WeakSet()


def _disown_after_fork() -> None:
    """In a child forked after a communicator was created: its CUDA state does not survive the
    fork, so every communicator becomes unusable with an error that says why, and its workspaces
    are never freed from here (the parent and the peers still use that memory)."""
    for comm in list(_LIVE):
        workspaces.NEVER_FREED.extend(comm._workspaces.values())
        comm._workspaces = {}
        comm._closed = True
        comm._closed_reason = (f"this Communicator was created in process {comm._pid}; this process is a child "
                               "forked after that and cannot use it: create a new Communicator in the child")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_disown_after_fork)


class Communicator:
    """All-reduce over CUDA P2P for the ranks of ``group`` (one process per rank, one host).

    Construction is collective: every rank of ``group`` must construct it, with the same
    ``max_bytes`` and algorithm table. Calls are collective too: every rank must issue the same
    sequence of ``all_reduce`` calls (same sizes and dtypes) on corresponding streams.

    Args:
        group: a CPU (gloo) process group used only for rendezvous (IPC handles) and teardown.
        device: this rank's CUDA device.
        max_bytes: largest message, in bytes; each rank allocates about
            ``(2 * world + 1) * max_bytes + 6 * world * min(max_bytes, 512 KiB)`` of device memory per stream it
            uses (:class:`~pcie_allreduce.layout.Layout` has the exact figure).
        timeout_s: how long a kernel waits for a peer before giving up and recording a
            :class:`CollectiveTimeout` (default 10 s, or ``$PCIE_AR_TIMEOUT_S``).
        algo_table: an :class:`~pcie_allreduce.plan.tables.AlgoTable`, a JSON path or inline JSON;
            default ``$PCIE_AR_ALGO_TABLE`` or the built-in table.
        transport: where the workspaces live: ``"p2p"`` (device memory over CUDA peer access),
            ``"host"`` (pinned host memory shared through /dev/shm, for boxes without usable
            peer-to-peer) or ``"auto"`` (p2p where every pair has peer access and a transfer
            test at creation passes, else host); default ``$PCIE_AR_TRANSPORT`` or ``"auto"``.
            Every rank must ask for the same; :attr:`transport` and :attr:`transport_reason` say
            what was chosen and why (also in ``repr`` and one INFO log line on rank 0).
        ranks_per_gpu: the most ranks, of this group and of other groups whose calls may run at
            the same time (a hierarchy's other nodes, emulated on the same GPUs), that run on one
            of its GPUs; the block cap shares each GPU's SMs among them. Default: this group's own
            count. Every rank must give the same.
    """

    #: What a call on a closed communicator raises (a forked child's copies say why instead).
    _closed_reason: str = "Communicator is closed"
    #: Device memory close() kept because a CUDA graph captured on it may still be replayed.
    retained_bytes: int = 0
    #: "p2p" or "host": where the workspaces live (decided collectively at creation).
    transport: str = "p2p"
    #: Why :attr:`transport` was chosen.
    transport_reason: str = ""
    #: Groups of ranks (sorted tuples partitioning them) that share a PCIe switch or a NUMA node,
    #: from every rank's sysfs, or as ``$PCIE_AR_ISLANDS`` sets them (the same on every rank).
    islands: tuple[tuple[int, ...], ...] = ()
    #: Where :attr:`islands` came from: "$PCIE_AR_ISLANDS", or what the detection grouped by.
    islands_source: str = ""
    #: Ranks per island where :attr:`islands` are two or more of one size, each a run of
    #: consecutive ranks (what ``algo="island_twoshot"`` needs), else 0.
    island_ranks: int = 0
    #: The compressed wires ``all_reduce(x, wire=...)`` takes.
    wires: tuple[str, ...] = tuple(algorithms.WIRE_ALGORITHMS)

    def __init__(self, group: dist.ProcessGroup, device: torch.device | int | str,
                 max_bytes: int = DEFAULT_MAX_BYTES, *, timeout_s: float | None = None,
                 algo_table: tables.AlgoTable | str | os.PathLike[str] | None = None,
                 transport: str | None = None, ranks_per_gpu: int | None = None) -> None:
        self._group = group
        self._workspaces: dict[int, Any] = {}
        self._closed = True  # until created: close() and __del__ have nothing to do
        self._pid = os.getpid()
        self.rank: int = dist.get_rank(group)
        self.world_size: int = dist.get_world_size(group)
        self._collective = rendezvous.Collective(group, self.rank, self.world_size)
        self._choices: dict[tuple[int, torch.dtype, str, bool], tuple[int, int]] = {}
        # stream -> the address of its workspace's symmetric input area, once symmetric_input
        # handed it out (all_reduce compares the input's address with it)
        self._input_areas: dict[int, int] = {}

        # Creation is all or nothing (pcie_allreduce.rendezvous): a failure on any rank makes
        # every rank raise here at once, and frees what it made.
        agreed, first = rendezvous.first_workspace(
            self._collective,
            rendezvous.agree(self._collective, device, max_bytes, timeout_s, algo_table, transport, ranks_per_gpu),
            lambda agreed: workspaces.create(self._collective, agreed, 0))
        #: What every rank agreed on at creation (its fields are also this communicator's attributes).
        self.agreed: rendezvous.Agreed = agreed
        self._ext: ModuleType = agreed.ext
        self.device, self.max_bytes = agreed.device, agreed.max_bytes
        #: Largest message ``oneshot_ll`` takes (its line slots cost twice the payload).
        self.ll_capacity: int = agreed.ll_capacity
        self.timeout_s: float = agreed.timeout_s
        #: The unfused pair's norm kernel starts as the all-reduce's programmatic dependent ($PCIE_AR_PDL).
        self.dependent_launch: bool = agreed.dependent_launch
        self.table, self.table_source = agreed.table, agreed.table_source  # the algorithm table, where it came from
        self.transport, self.transport_reason = agreed.transport, agreed.transport_reason
        self.placements: list[topology.RankPlacement] = agreed.placements
        self.islands, self.islands_source = agreed.islands, agreed.islands_source
        self.island_ranks = agreed.island_ranks
        self.shares_gpu, self.block_cap = agreed.shares_gpu, agreed.block_cap  # ranks on one GPU; blocks per call
        self._meeting_id: str = agreed.meeting_id  # names this communicator's keys in the group's store
        self._fused = FusedPath(group, f"pcie_allreduce/{self._meeting_id}/fused")  # the fused call
        #: Seconds this rank spent compiling each fused call shape's Triton kernels, by the call's
        #: description: "<algo> [tokens, hidden] <dtype> (weight <dtype>)".
        self.fused_compile_seconds: dict[str, float] = self._fused.compile_seconds
        self._closed = False
        self.handle: int = ops.HANDLES.register(self)  # for torch.ops.pcie_allreduce.* (torch.compile)
        _LIVE.add(self)
        self._workspaces[current_stream_handle(self.device)] = first
        problem = self.table.availability_problem(self.transport, self.island_ranks)
        if problem is not None:  # the same table and transport on every rank: all raise here
            self.close()
            raise ValueError(problem)
        if self.rank == 0:
            logger.info("pcie_allreduce: %d ranks, transport %s (%s)", self.world_size, self.transport,
                        self.transport_reason)

    # ---- public API ----------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None = None, algo: str = "auto", *,
                   wire: str | None = None) -> torch.Tensor:
        """Sum ``x`` over all ranks; returns ``out`` (new tensor if None; ``out=x`` is in place).

        Enqueued on the current CUDA stream of the communicator's device; never synchronizes the
        host. Results are bitwise identical on every rank and, with the default lossless wire,
        for every algorithm.

        ``wire="fp8"`` (opt-in, never chosen by ``auto``): the two-shot with the message coded as
        FP8 e4m3 in blocks of 128 elements with a power-of-two scale each, 132 bytes per 128
        values on the wire (0.52x of bf16). Each rank's contribution and each reduced shard are
        coded; sums are fp32 in rank order, so results are still bitwise identical on every rank
        and deterministic, but not the exact sum: :func:`pcie_allreduce.fp8_wire.error_bound`
        bounds each element's error and :func:`pcie_allreduce.fp8_wire.all_reduce` gives the bits.
        """
        if self._closed:
            raise RuntimeError(self._closed_reason)
        if wire is not None:
            algo = validation.wire_algo(wire, algo)
        nbytes = validation.plain_call(x, out, algo, device=self.device, max_bytes=self.max_bytes)
        if out is None:
            out = torch.empty_like(x)
        if nbytes == 0:
            return out
        dtype = x.dtype
        stream = current_stream_handle(self.device)
        workspace = self._workspaces.get(stream) or self._workspace_for(stream)
        symmetric = x.data_ptr() == self._input_areas.get(stream)
        hit = self._choices.get((nbytes, dtype, algo, symmetric))  # _choice's cache, without the call
        algo_id, blocks = hit if hit is not None else self._choice(nbytes, dtype, algo, symmetric)
        if workspace.all_reduce(algo_id, x.data_ptr(), out.data_ptr(), nbytes, DTYPE_IDS[dtype], blocks, stream):
            raise workspaces.error_of(workspace)
        return out

    def symmetric_input(self, shape: int | tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.bfloat16, *,
                        stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` in this rank's symmetric input area: memory of the workspace that serves
        ``stream`` (default: the current stream) which every peer has mapped, like a buffer of torch symmetric memory.
        Write a message there (``torch.matmul(a, b, out=buf)``, ``buf.copy_(x)``) and call ``all_reduce(buf)`` on that
        stream on every rank: large messages then run ``twoshot_symm`` (when the table has it, as the built-in p2p
        table does from the size its two-shot takes over), whose reduce-scatter reads every rank's input where it lies
        instead of copying it into the workspace first. ``out=buf`` works in place. Every call returns the same memory
        (the area's start): one message at a time per stream, and it may be rewritten as soon as the all-reduce that
        read it has completed on that stream. Valid until :meth:`close`; ``numel * itemsize`` at most ``max_bytes``.
        p2p transport only (the host transport's workspace lives in host memory). Collective the first time a stream is
        used, like a call.
        """
        if self._closed:
            raise RuntimeError(self._closed_reason)
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        numel = validation.symmetric_input_numel(dims, dtype, max_bytes=self.max_bytes, transport=self.transport)
        handle = current_stream_handle(self.device) if stream is None else stream.cuda_stream
        workspace = self._workspace(handle)
        area = self._input_areas.get(handle)
        if area is None:
            area = workspace.bases()[self.rank] + workspace.input_offset
            self._input_areas[handle] = area
        raw = torch.as_tensor(_DeviceBytes(area, workspace.input_bytes), device=self.device)
        return raw.view(dtype)[:numel].view(dims)

    def all_reduce_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                           out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                           algo: str = "auto", wire: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused ``new_residual = residual + all_reduce(x)``; ``normed = rmsnorm(new_residual) * weight``.

        ``x`` and ``residual`` are ``[tokens, hidden]`` bf16/fp16; ``weight`` is ``[hidden]`` (same
        dtype or fp32). Returns ``(normed, new_residual)``; ``out=x`` / ``residual_out=residual``
        work in place (no other sharing of memory between arguments is allowed). ``new_residual``
        is bitwise equal to ``residual + self.all_reduce(x)`` and identical on every rank;
        ``normed`` is identical on every rank too (its last bit may depend on which kernel ran).
        ``algo="auto"`` (:meth:`select_fused_algo`) runs a fused Triton kernel where one beats the
        plain all-reduce followed by the library's one add + RMSNorm kernel, and that pair
        (``"unfused"``) elsewhere; a fused kernel can also be forced by name. ``wire="fp8"``: the
        all-reduce as :meth:`all_reduce` codes it, then the add + RMSNorm kernel (``algo`` must be
        "auto" or "unfused"); ``new_residual`` is then ``residual + all_reduce(x, wire="fp8")``.
        """
        if self._closed:
            raise RuntimeError(self._closed_reason)
        tokens, _, algo, wire_algo = validation.fused_call(x, residual, weight, eps, out, residual_out, algo, wire,
                                                           device=self.device, max_bytes=self.max_bytes,
                                                           world=self.world_size)
        normed = torch.empty_like(x) if out is None else out
        new_residual = torch.empty_like(residual) if residual_out is None else residual_out
        if tokens:
            stream = current_stream_handle(self.device)
            self._fused.call(self, self._workspace(stream), stream, x, residual, weight, eps, normed, new_residual,
                             algo, wire_algo)
        return normed, new_residual

    def warm_up_fused(self, shapes: Iterable[tuple[int, int]], dtype: torch.dtype = torch.bfloat16, *,
                      weight_dtype: torch.dtype | None = None, algo: str = "auto") -> int:
        """Compile the Triton kernels :meth:`all_reduce_rmsnorm` runs for each ``[tokens, hidden]`` in ``shapes``
        before their first calls, the work shared out: each rank compiles every W-th new shape into Triton's on-disk
        cache, then loads the others' from it, so a server warming up the batch sizes it captures spends about 1/W of
        the time. Collective (same arguments on every rank), outside a graph capture; launches nothing; returns how
        many shapes were new."""
        calls = validation.warm_up_calls(shapes, dtype, dtype if weight_dtype is None else weight_dtype, algo,
                                         device=self.device, max_bytes=self.max_bytes, world=self.world_size)
        return self._fused.warm_up(self, self._workspace(), calls) if calls else 0  # _workspace: raises if closed

    def select_fused_algo(self, tokens: int, hidden: int, dtype: torch.dtype) -> str:
        """What ``all_reduce_rmsnorm(algo="auto")`` runs for ``[tokens, hidden]`` of ``dtype``: a fused kernel where
        the table's fused rules say one wins at this token count and W, else ``"unfused"``
        (:func:`pcie_allreduce.plan.dispatch.fused_plan`)."""
        return self._fused.plan(self, (tokens, hidden, dtype, dtype, "auto", None)).algo

    def capacity_of(self, algo: str) -> int | None:
        """Largest message (bytes) a forced ``algo`` takes here; None: up to ``max_bytes``."""
        return None if algo == "auto" else algorithms.capacity_of(algo, self.ll_capacity)

    def select_algo(self, nbytes: int, dtype: torch.dtype) -> str:
        """The algorithm ``algo="auto"`` uses for a message of ``nbytes`` bytes of ``dtype``."""
        return dispatch.plain_choice(nbytes, self.world_size, dtype, self.table, ll_capacity=self.ll_capacity,
                                     block_cap=self.block_cap).algo

    def check(self) -> None:
        """Raise the CollectiveTimeout / CollectiveMismatch a kernel recorded, if any (no GPU sync)."""
        for workspace in self._workspaces.values():
            if workspace.failed():
                raise workspaces.error_of(workspace)

    def close(self, *, release_captured: bool = False) -> None:
        """Free the workspaces. Collective: waits for this rank's streams, then for every rank, at most
        :data:`pcie_allreduce.workspaces.CLOSE_WAIT_S`; never hangs on a rank that is gone. A workspace that served a
        CUDA graph capture is not freed unless ``release_captured`` (the caller's promise that no graph captured with
        this communicator is replayed after this: an engine's teardown, which frees its own all-reduce's graph buffers
        too): the graph may be replayed after this. Its abort word is raised instead (a replayed call then touches no
        peer memory and fills its output with NaN), the peers are unmapped, and its own memory stays allocated until
        the process exits (:attr:`retained_bytes` says how much). Where a rank does not reach close() in time, every
        workspace is kept that way: a peer that is still running may write into this memory. Calling it again does
        nothing."""
        if self._closed:
            return
        self._closed = True
        if self._workspaces:
            torch.cuda.synchronize(self.device)
            self.retained_bytes += workspaces.release(self._workspaces.values(), self._group, self._meeting_id,
                                                      self.rank, release_captured=release_captured)
        self._workspaces.clear()
        self._input_areas.clear()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def serves_stream(self, stream: int | None = None) -> bool:
        """Whether ``stream`` (default: the current one) has its workspace already (no collective)."""
        return (current_stream_handle(self.device) if stream is None else stream) in self._workspaces

    def prepare_stream(self, stream: int | None = None) -> None:
        """Make the workspace of ``stream`` (default: the current one) now, collectively on every
        rank: before a CUDA graph is captured on a stream, whose first call cannot make it."""
        self._workspace(stream)

    # ---- internals -----------------------------------------------------------------------

    def _choice(self, nbytes: int, dtype: torch.dtype, algo: str, symmetric: bool = False) -> tuple[int, int]:
        key = (nbytes, dtype, algo, symmetric)
        hit = self._choices.get(key)
        if hit is None:
            problem = algorithms.call_problem(algo, nbytes, dtype.itemsize, self.transport, self.island_ranks,
                                              Layout.make(self.max_bytes, 1).slot_bytes, self.ll_capacity)
            if problem is not None:
                raise ValueError(problem)
            hit = dispatch.plain_launch(nbytes, self.world_size, dtype, self.table, ll_capacity=self.ll_capacity,
                                        block_cap=self.block_cap, algo=algo, symmetric=symmetric)
            if len(self._choices) < 4096:  # bounded: shapes in serving are few
                self._choices[key] = hit
        return hit

    def _workspace(self, stream: int | None = None) -> Any:
        """The `_C.Workspace` serving ``stream`` (default: the current stream), made if new."""
        if stream is None:
            stream = current_stream_handle(self.device)
        return self._workspaces.get(stream) or self._workspace_for(stream)

    def _workspace_for(self, stream: int) -> Any:
        """Create (collectively: :func:`pcie_allreduce.workspaces.create`) the workspace for a
        stream this rank has not used before, on the transport agreed at creation."""
        if self._closed:
            raise RuntimeError(self._closed_reason)
        workspace = workspaces.create(self._collective, self.agreed, len(self._workspaces))
        self._workspaces[stream] = workspace
        return workspace

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
                f"max_bytes={self.max_bytes}, transport={getattr(self, 'transport', None)!r}, "
                f"streams={len(self._workspaces)})")

    def __del__(self) -> None:
        # Never free here (peers may still write into this memory, a captured graph may be replayed).
        if getattr(self, "_workspaces", None) and not getattr(self, "_closed", True):
            workspaces.abandon(self._workspaces.values(), self.rank)


class _DeviceBytes:
    """``nbytes`` bytes of device memory at ``address`` as the CUDA array interface describes them,
    for ``torch.as_tensor`` (a view, no copy; the memory stays the workspace's)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "strides": None, "version": 3}


def current_stream_handle(device: torch.device) -> int:
    """The raw handle of ``device``'s current CUDA stream. torch's C entry point returns it
    directly; ``torch.cuda.current_stream(device).cuda_stream`` builds a Stream object under a
    device guard first, which costs microseconds on every call."""
    return torch._C._cuda_getCurrentRawStream(device.index)

