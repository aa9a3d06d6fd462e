"""The object users hold: rendezvous, per-stream workspaces, caches of choices, errors.

What a call launches is decided by :mod:`pcie_allreduce.plan.dispatch` (pure functions); the
communicator holds the state those choices read (agreed table, capacity, block cap) and caches
their results per call shape."""

from __future__ import annotations

import logging
import os
import secrets
import warnings
import weakref
from types import ModuleType
from typing import Any, Callable

import torch
import torch.distributed as dist

from pcie_allreduce import _ext, ops, outcomes, settings, transport as transport_mod, validation
from pcie_allreduce.fabric import topology
from pcie_allreduce.constants import ERROR_MISMATCH, MAX_RANKS, MIN_RANKS, STAGE_NAMES, TRANSPORT_IDS
from pcie_allreduce.errors import CollectiveError, CollectiveMismatch, CollectiveTimeout, UnavailableError
from pcie_allreduce.plan import algorithms, cache, dispatch, tables
from pcie_allreduce.plan.dispatch import DTYPE_IDS
from pcie_allreduce.fused.path import FusedPath
from pcie_allreduce.layout import Layout

DEFAULT_MAX_BYTES = 8 << 20
TIMEOUT_ENV = "PCIE_AR_TIMEOUT_S"
# "1": programmatic dependent launch where the GPU has it (Hopper and later): every all-reduce is
# launched as the previous kernel's dependent (it waits for that kernel before it reads anything:
# csrc/protocol.cuh's begin_call), and the unfused pair's norm kernel as the all-reduce's (it waits
# before it reads the sum), and the fused kernels as dependents too (waiting first thing); anything else: off. Each rank's own launch choice (results, protocol
# and peers are the same either way), so ranks need not agree.
PDL_ENV = "PCIE_AR_PDL"
logger = logging.getLogger("pcie_allreduce")


DEFAULT_TIMEOUT_S = 10.0
# Seed of the creation-time transfer test; the workspace index is added, so a test pattern left
# by one stream's creation never passes for another's.
PROBE_SEED = 0x5EED0000
# How long close() waits for every rank to reach it before it gives up on freeing: an engine's
# ranks tear a group down together, so only a rank that is gone (or stuck) is missed.
CLOSE_WAIT_S = 60.0
CLOSE_STAGE = "close"
# What ranks agree on for the islands (named so a disagreement says which setting differs).
ISLANDS_KEY = f"islands (${topology.ISLANDS_ENV})"

# Communicators alive in this process, for the fork handler; and workspaces that must never be
# freed here (a forked child's copies, or those of a communicator dropped without close()).
_LIVE: "weakref.WeakSet[Communicator]" = weakref.WeakSet()
_NEVER_FREED: list[Any] = []


def _dependent_launch(device: torch.device) -> bool:
    """Whether this rank launches the unfused pair's norm kernel as the all-reduce's dependent."""
    return settings.env_bool(PDL_ENV, False) and torch.cuda.get_device_capability(device)[0] >= 9


def _default_timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    return DEFAULT_TIMEOUT_S if raw is None else settings.parse_seconds(TIMEOUT_ENV, raw)


def _disown_after_fork() -> None:
    """In a child forked after a communicator was created: its CUDA state does not survive the
    fork, so every communicator becomes unusable with an error that says why, and its workspaces
    are never freed from here (the parent and the peers still use that memory)."""
    for comm in list(_LIVE):
        _NEVER_FREED.extend(comm._workspaces.values())
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
        if not MIN_RANKS <= self.world_size <= MAX_RANKS:
            raise ValueError(f"pcie_allreduce supports {MIN_RANKS} to {MAX_RANKS} ranks, "
                             f"the group has {self.world_size}")
        self._choices: dict[tuple[int, torch.dtype, str, bool], tuple[int, int]] = {}
        # stream -> the address of its workspace's symmetric input area, once symmetric_input
        # handed it out (all_reduce compares the input's address with it)
        self._input_areas: dict[int, int] = {}
        self._fused = FusedPath()  # the fused call's plans, compile meetings and launches

        # Creation is all or nothing: each step that can fail on one rank runs on every rank and
        # ends in a gather of every rank's outcome (see _collective_step), so a failure anywhere
        # makes every rank raise at once instead of leaving peers in a later rendezvous.
        explicit_table = algo_table is not None or bool(os.environ.get(tables.TABLE_ENV))
        agreed = self._collective_step("argument checks and GPU set-up",
                                       lambda: self._set_up_locally(device, max_bytes, timeout_s, algo_table,
                                                                    transport, ranks_per_gpu))
        for key in ("max_bytes", "timeout_s", "table", "transport", "ranks_per_gpu", ISLANDS_KEY):
            self._check_agreement(agreed, key)
        self._meeting_id: str = agreed[0]["meeting_id"]  # names this communicator's keys in the group's store
        self.table_source: str = ("algo_table argument" if algo_table is not None
                                  else f"${tables.TABLE_ENV}" if explicit_table else "built-in default")
        self.placements: list[topology.RankPlacement] = [a["placement"] for a in agreed]
        fabrics = [p.fabric for p in self.placements]  # each read by its own rank
        override = agreed[0][ISLANDS_KEY]
        self.islands = override if override is not None else topology.islands(fabrics)
        self.islands_source = f"${topology.ISLANDS_ENV}" if override is not None else topology.islands_basis(fabrics)
        self.island_ranks = topology.island_ranks(self.islands)
        requested = agreed[0]["transport"]
        hosts = sorted({p.host for p in self.placements})
        if len(hosts) > 1:  # neither transport reaches another host
            raise UnavailableError(f"pcie_allreduce needs every rank on one host; this group spans {hosts}")
        problems = [p for p in self._collective_step(
            "the peer-access check",
            lambda: topology.peer_access_problem(self._ext, self.placements[self.rank], self.device.index,
                                                 self.placements)) if p]
        no_peer_access = problems[0] if len(problems) == 1 else "; ".join(dict.fromkeys(problems))
        if problems and requested == "p2p":
            raise UnavailableError(no_peer_access)
        self.transport = "host" if requested == "host" or problems else "p2p"
        if not explicit_table:
            self._adopt_tuned_table()
        self.transport_reason = ("asked for" if requested == self.transport
                                      else f"no peer-to-peer: {no_peer_access}")
        self.shares_gpu: bool = topology.shares_gpu(self.placements)
        sharing = max(topology.ranks_per_gpu(self.placements), agreed[0]["ranks_per_gpu"] or 1)
        # The fewest SMs any rank sees, and whether every rank runs capped to an MPS share of its GPU.
        self.block_cap: int = dispatch.block_cap(sharing, min(a["sms"] for a in agreed),
                                                 all(a["mps_share"] for a in agreed))
        self._closed = False
        self.handle: int = ops.HANDLES.register(self)  # for torch.ops.pcie_allreduce.* (torch.compile)
        _LIVE.add(self)
        with torch.cuda.device(self.device):
            stream = current_stream_handle(self.device)
            try:
                self._workspace_for(stream)
            except Exception as exc:  # noqa: BLE001 - every rank raised here together (collective steps)
                if requested != "auto" or self.transport != "p2p":
                    raise
                # The driver reports peer access, but mapping or the transfer test failed on some
                # pair: the platform does not deliver P2P. Every rank saw the same failure.
                self.transport = "host"
                self.transport_reason = f"peer-to-peer failed at creation: {' '.join(str(exc).split())}"
                if not explicit_table:
                    self._adopt_tuned_table()
                self._workspace_for(stream)
        if requested == "auto" and self.transport == "p2p":
            self.transport_reason = "every pair has peer access and the creation transfer test passed"
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
        workspace = self._workspaces.get(stream)
        if workspace is None:
            workspace = self._workspace_for(stream)
        symmetric = x.data_ptr() == self._input_areas.get(stream)
        hit = self._choices.get((nbytes, dtype, algo, symmetric))  # _choice's cache, without the call
        algo_id, blocks = hit if hit is not None else self._choice(nbytes, dtype, algo, symmetric)
        if workspace.all_reduce(algo_id, x.data_ptr(), out.data_ptr(), nbytes, DTYPE_IDS[dtype], blocks, stream):
            raise self._error_of(workspace)
        return out

    def symmetric_input(self, shape: int | tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.bfloat16, *,
                        stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` in this rank's symmetric input area: memory of the
        workspace that serves ``stream`` (default: the current stream) which every peer has
        mapped, like a buffer of torch symmetric memory.

        Write a message there (``torch.matmul(a, b, out=buf)``, ``buf.copy_(x)``) and call
        ``all_reduce(buf)`` on that stream on every rank: large messages then run ``twoshot_symm``
        (when the table has it, as the built-in p2p table does from the size its two-shot takes
        over), whose reduce-scatter reads every rank's input where it lies instead of copying it
        into the workspace first. ``out=buf`` works in place. Every call returns the same memory
        (the area's start): one message at a time per stream, and it may be rewritten as soon as
        the all-reduce that read it has completed on that stream. Valid until :meth:`close`;
        ``numel * itemsize`` at most ``max_bytes``. p2p transport only (the host transport's
        workspace lives in host memory). Collective the first time a stream is used, like a call.
        """
        if self._closed:
            raise RuntimeError(self._closed_reason)
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        numel = validation.symmetric_input_numel(dims, dtype, max_bytes=self.max_bytes, transport=self.transport)
        handle = current_stream_handle(self.device) if stream is None else stream.cuda_stream
        workspace = self._workspaces.get(handle) or self._workspace_for(handle)
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
            workspace = self._workspaces.get(stream) or self._workspace_for(stream)
            self._fused.call(self, workspace, stream, x, residual, weight, eps, normed, new_residual, algo, wire_algo)
        return normed, new_residual

    def select_fused_algo(self, tokens: int, hidden: int, dtype: torch.dtype) -> str:
        """What ``all_reduce_rmsnorm(algo="auto")`` runs for ``[tokens, hidden]`` of ``dtype``: a
        fused kernel where the table's fused rules say one wins at this token count and W (it then
        follows the plain table for the same message size), else ``"unfused"``
        (:func:`pcie_allreduce.plan.dispatch.fused_plan`)."""
        return self._fused.plan(self, (tokens, hidden, dtype, dtype, "auto", None)).algo

    @property
    def fused_compile_seconds(self) -> dict[str, float]:
        """Seconds this rank spent compiling the Triton kernels of each fused call shape (its first
        call), by the call's description: "<algo> [tokens, hidden] <dtype> (weight <dtype>)"."""
        return self._fused.compile_seconds

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
                raise self._error_of(workspace)

    def close(self, *, release_captured: bool = False) -> None:
        """Free the workspaces. Collective: waits for this rank's streams, then for every rank,
        at most :data:`CLOSE_WAIT_S`; never hangs on a rank that is gone.

        A workspace that served a CUDA graph capture is not freed unless ``release_captured``
        (the caller's promise that no graph captured with this communicator is replayed after
        this: an engine's teardown, which frees its own all-reduce's graph buffers too): the
        graph may be replayed after this. Its abort word is raised instead (a replayed call then
        touches no peer memory and fills its output with NaN), the peers are unmapped, and its
        own memory stays allocated until the process exits (:attr:`retained_bytes` says how
        much). Where a rank does not reach close() in time, every workspace is kept that way:
        a peer that is still running may write into this memory. Calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        if not self._workspaces:
            return
        torch.cuda.synchronize(self.device)
        everyone = self._every_rank_closing()
        for workspace in self._workspaces.values():
            if everyone and (release_captured or not workspace.captured):
                workspace.close()
            else:
                workspace.retire()
                _NEVER_FREED.append(workspace)
                self.retained_bytes += workspace.total_bytes
        self._workspaces.clear()
        self._input_areas.clear()

    def _every_rank_closing(self) -> bool:
        """Whether every rank has reached close() (so none writes into this rank's memory any
        more), met in the group's store within :data:`CLOSE_WAIT_S`: never a collective on the
        group, which a gone peer would hold for the group's timeout (30 minutes by default). Where
        no process group is left to ask, nobody can be waited for: True, as before any group."""
        if not dist.is_initialized():
            return True
        try:
            outcomes.meet(self._group, f"pcie_allreduce/{self._meeting_id}/close", 0, "close()", CLOSE_STAGE,
                          wait_s=CLOSE_WAIT_S, stage=CLOSE_STAGE)
        except Exception as exc:  # noqa: BLE001 - a missing rank, or the store gone with rank 0's process
            warnings.warn(f"pcie_allreduce: rank {self.rank}: close() keeps this communicator's workspaces "
                          f"allocated ({' '.join(str(exc).split())}): a peer that did not close may still write "
                          "into them", ResourceWarning, stacklevel=3)
            return False
        return True

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- for the fused Triton kernels and tests ------------------------------------------

    def workspace(self, stream: int | None = None) -> Any:
        """The `_C.Workspace` serving ``stream`` (default: the current stream), created if needed."""
        if stream is None:
            stream = current_stream_handle(self.device)
        return self._workspaces.get(stream) or self._workspace_for(stream)

    def has_workspace(self, stream: int | None = None) -> bool:
        """Whether ``stream`` (default: the current stream) already has its workspace (no collective)."""
        if stream is None:
            stream = current_stream_handle(self.device)
        return stream in self._workspaces

    def raise_if_failed(self, workspace: Any) -> None:
        """Raise the recorded error of ``workspace`` if one of its kernels failed."""
        if workspace.failed():
            raise self._error_of(workspace)

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

    def _adopt_tuned_table(self) -> None:
        """Use the table `pcie-allreduce tune` cached for this GPU model, W, topology and transport,
        if any, else the transport's built-in one (:func:`pcie_allreduce.plan.cache.resolve_table`).

        Rank 0 reads it and every rank adopts rank 0's copy, so the table is agreed once, here.
        """
        found = None
        if self.rank == 0:
            found = cache.find_tuned(self._ext, [p.pci_bus_id for p in self.placements], self.islands,
                                     torch.cuda.get_device_name(self.device), self.world_size, self.transport)
        found = self._gather({"tuned": found})[0]["tuned"]
        self.table, self.table_source = cache.resolve_table(found, self.transport, self.islands, self.island_ranks)

    def _set_up_locally(self, device: torch.device | int | str, max_bytes: object, timeout_s: object,
                        algo_table: tables.AlgoTable | str | os.PathLike[str] | None,
                        transport: str | None, ranks_per_gpu: object) -> dict[str, Any]:
        """This rank's part of creation before any memory is allocated: arguments, extension, GPU.
        Returns what every rank must agree on (and its placement)."""
        if ranks_per_gpu is not None and (isinstance(ranks_per_gpu, bool) or not isinstance(ranks_per_gpu, int)
                                          or ranks_per_gpu < 1):
            raise ValueError(f"ranks_per_gpu must be a positive int or None, got {ranks_per_gpu!r}")
        self._ext: ModuleType = _ext.require()
        self.device: torch.device = _cuda_device(device)
        self.max_bytes: int = validation.validate_max_bytes(max_bytes)
        #: Largest message ``oneshot_ll`` takes (its line slots cost twice the payload).
        self.ll_capacity: int = Layout.make(self.max_bytes, self.world_size).ll_capacity
        self.timeout_s: float = _default_timeout() if timeout_s is None else validation.validate_timeout(timeout_s)
        self.table: tables.AlgoTable = tables.load_table(algo_table)
        requested = transport_mod.requested(transport)
        status = self._ext.runtime_status()
        if status:
            raise UnavailableError(f"rank {self.rank}: no usable CUDA GPU ({status})")
        self._sms: int = torch.cuda.get_device_properties(self.device).multi_processor_count
        #: The unfused pair's norm kernel starts as the all-reduce's programmatic dependent ($PCIE_AR_PDL).
        self.dependent_launch: bool = _dependent_launch(self.device)
        return {"max_bytes": self.max_bytes, "timeout_s": self.timeout_s,
                "table": self.table.to_json(), "transport": requested, "meeting_id": secrets.token_hex(8),
                "ranks_per_gpu": ranks_per_gpu, "sms": self._sms,
                "mps_share": dispatch.runs_in_mps_share(),
                ISLANDS_KEY: topology.islands_override(self.world_size),
                "placement": topology.local_placement(self._ext, self.rank, self.device.index)}

    def _workspace_for(self, stream: int) -> Any:
        """Create (collectively) the workspace for a stream this rank has not used before.

        Three collective steps, each ending in a gather of every rank's outcome: allocate and
        export (with the layout, checked to be the same everywhere); map the peers' memory and
        write a probe into each; read the probes the peers wrote here. A pair whose probe did not
        arrive means the driver reports peer access the platform does not deliver: a clean
        UnavailableError now instead of timeouts on the first calls."""
        if self._closed:
            raise RuntimeError(self._closed_reason)
        index = len(self._workspaces)
        created: list[Any] = []
        if self.transport == "host":
            transport_mod.remove_stale_segments()

        def allocate() -> dict[str, Any]:
            # The host transport's segment is named here: its name records who created it, which
            # the stale-segment sweep reads (transport.py).
            name = transport_mod.new_segment_name() if self.transport == "host" else ""
            workspace = self._ext.Workspace(self.device.index, self.rank, self.world_size, self.max_bytes,
                                            self.timeout_s, TRANSPORT_IDS[self.transport], name)
            created.append(workspace)
            workspace.island_ranks = self.island_ranks
            workspace.dependent_launch = self.dependent_launch
            return {"index": index, "handle": workspace.ipc_handle(),
                    "layout": (workspace.total_bytes, workspace.max_bytes, workspace.world, workspace.rank)}

        try:
            exchanged = self._collective_step("workspace allocation", allocate)
            workspace = created[0]
            indices = [e["index"] for e in exchanged]
            if len(set(indices)) != 1:
                raise CollectiveMismatch(
                    f"ranks disagree on which stream this is (workspace indices {indices}): every rank must use "
                    "its streams in the same order", rank=self.rank)
            layouts = [e["layout"] for e in exchanged]
            if any(lay[:3] != layouts[0][:3] or lay[3] != r for r, lay in enumerate(layouts)):
                raise UnavailableError(f"the ranks' workspaces differ (total bytes, max_bytes, world, rank per rank: "
                                       f"{layouts}): every rank must run the same pcie_allreduce build")
            seed = PROBE_SEED + index

            def map_and_probe() -> None:
                workspace.open_peers([e["handle"] for e in exchanged])
                workspace.write_probes(seed)

            self._collective_step("mapping the peers' workspaces", map_and_probe)
            workspace.release_name()  # every rank has mapped it: a later crash leaves nothing in /dev/shm
            missing = [(sender, receiver) for receiver, senders in
                       enumerate(self._collective_step("the transfer test", lambda: workspace.probe_failures(seed)))
                       for sender in senders]
            if missing:
                pairs = ", ".join(f"{s} -> {r}" for s, r in missing)
                if self.transport == "host":
                    raise UnavailableError(
                        f"writes into the shared pinned host memory do not arrive (rank -> rank: {pairs}): the GPUs "
                        "cannot reach each other's registered /dev/shm segments. Use NCCL for this group.")
                raise UnavailableError(
                    f"P2P writes between the ranks' GPUs do not arrive (rank -> rank: {pairs}) although the driver "
                    "reports peer access: the platform drops or misroutes peer-to-peer writes (IOMMU / ACS settings, "
                    "a cross-socket path). Use transport='host' (what 'auto' falls back to), NCCL, or fix the "
                    "platform's P2P.")
        except BaseException:
            for made in created:
                made.close()
            raise
        self._workspaces[stream] = workspace
        return workspace

    def _collective_step(self, step: str, local: Callable[[], Any]) -> list[Any]:
        """Run ``local`` on this rank and gather every rank's result.

        A rank whose ``local`` raises still joins the gather, with its error; then every rank
        raises: that rank its own exception, the others UnavailableError naming it and why. So no
        rank is left waiting in a later rendezvous for one that gave up (gloo would hold it for the
        process group's timeout, 30 minutes by default)."""
        try:
            result = local()
        except Exception as exc:
            # Raised from inside the handler, never kept in a local (see _compile_everywhere).
            self._gather({"error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"})
            raise
        gathered = self._gather({"ok": result})
        failed = {r: g["error"] for r, g in enumerate(gathered) if "error" in g}
        if failed:
            reasons = "; ".join(f"rank {r}: {why}" for r, why in failed.items())
            raise UnavailableError(f"rank {self.rank}: creating the communicator failed on another rank in {step} "
                                   f"({reasons})")
        return [g["ok"] for g in gathered]

    def _gather(self, obj: dict[str, Any]) -> list[dict[str, Any]]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self._group)
        return gathered

    def _check_agreement(self, agreed: list[dict[str, Any]], key: str) -> None:
        values = [a[key] for a in agreed]
        if any(v != values[0] for v in values):
            differing = [r for r, v in enumerate(values) if v != values[0]]
            raise ValueError(f"ranks disagree on {key}: rank 0 has {values[0]!r}, ranks {differing} differ "
                             f"({[values[r] for r in differing]!r})")

    def _error_of(self, workspace: Any) -> CollectiveError:
        err = workspace.error()
        stage = STAGE_NAMES.get(err.stage, f"stage {err.stage}")
        where = dict(rank=err.rank, peer=err.peer, stage=stage, epoch=err.epoch, block=err.block)
        if err.kind == ERROR_MISMATCH:
            return CollectiveMismatch(
                f"rank {err.rank} got a different collective from rank {err.peer} as call #{err.epoch} "
                f"({stage}, block {err.block}; signature {err.observed_signature:#010x} vs ours "
                f"{err.expected_signature:#010x}): every rank must issue the same sequence of calls with the same "
                "size, dtype and algorithm. This communicator is now unusable.", **where)
        return CollectiveTimeout(
            f"rank {err.rank} waited more than {workspace.timeout:g} s for rank {err.peer} in {stage} of call "
            f"#{err.epoch} (block {err.block}): that rank is stuck, dead, or skipped a collective. "
            "This communicator is now unusable.", **where)

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
                f"max_bytes={self.max_bytes}, transport={getattr(self, 'transport', None)!r}, "
                f"streams={len(self._workspaces)})")

    def __del__(self) -> None:
        # Never free here: peers may still write into this memory, and a CUDA graph captured with
        # it may still be replayed. Only close() (collective) frees; without it the memory stays
        # allocated until the process exits.
        workspaces = getattr(self, "_workspaces", None)
        if workspaces and not getattr(self, "_closed", True):
            _NEVER_FREED.extend(workspaces.values())
            mib = sum(getattr(w, "total_bytes", 0) for w in workspaces.values()) / 2**20
            warnings.warn(f"pcie_allreduce: a Communicator (rank {self.rank}) was dropped without close(); its "
                          f"{mib:.0f} MiB of workspaces stay allocated until the process exits, since peers may "
                          "still write into them. Call close() on every rank to free them.", ResourceWarning,
                          stacklevel=2)


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


def _cuda_device(device: torch.device | int | str) -> torch.device:
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {dev}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev
