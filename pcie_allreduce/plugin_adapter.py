"""What an engine's ``ca_comm`` adapter does whatever the engine: the core both plugins build on.

SGLang's ``GroupCoordinator`` and vLLM's ``CudaCommunicator`` ask their custom all-reduce the same
questions (``disabled``, ``should_custom_ar``, an out-of-place all-reduce, ``capture()`` around
graph capture, ``close()``, and for the fused op whether it serves a shape). The answers are one
set of rules over a :class:`pcie_allreduce.Communicator` (or a hierarchical one): every decision is
a pure function of dtype, shape, contiguity and what all ranks share, so every rank captures the
same collectives, and nothing a call is given makes it raise inside a forward pass. Each plugin
subclasses :class:`CaCommAdapter` with its engine's names and the methods only its engine calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from pcie_allreduce import validation
from pcie_allreduce.interface import AllReducer
from pcie_allreduce.plan import algorithms

CommunicatorFactory = Callable[..., AllReducer]


def default_factory() -> CommunicatorFactory:
    """The single-node communicator class (imported late: it loads the CUDA extension)."""
    from pcie_allreduce.communicator import Communicator

    return Communicator


@dataclasses.dataclass(kw_only=True)
class PluginState:
    """What an engine plugin installed in this process (each plugin adds what undoing it needs).

    Attributes:
        settings: the parsed environment.
        adapters: adapters serving in this process (weakly held: an engine's teardown drops them).
        communicator_factory: builds the pcie_allreduce communicator; tests on a CPU substitute a
            stand-in for pcie_allreduce's (never for the engine's classes).
        facts_fn: per-rank facts for the eligibility decision; tests substitute GPU facts.
    """

    settings: Any
    adapters: "weakref.WeakSet[Any]" = dataclasses.field(default_factory=weakref.WeakSet)
    communicator_factory: CommunicatorFactory | None = None
    facts_fn: Callable[..., Any] | None = None


def check_serving(adapters: Iterable["CaCommAdapter"]) -> None:
    """Raise the CollectiveTimeout / CollectiveMismatch a collective of any of ``adapters`` (those
    serving in this process) recorded, a replayed CUDA graph's included: a host read per workspace,
    no CUDA call. Each engine's per-step hook runs it before the step: a graph's calls never pass
    through :meth:`CaCommAdapter._all_reduce`, so without it a server whose every collective runs
    in graphs would go on sampling from the NaN a failed call leaves."""
    for adapter in list(adapters):
        if not adapter.disabled:
            adapter.comm.check()


def close_before_teardown(ca_comm: object, log: logging.Logger, tag: str) -> None:
    """Close ``ca_comm`` where it is one of ours, on an engine's group teardown before the engine's
    own (collective over the group's CPU group, which the engine destroys next). A failure is
    logged, its workspaces staying allocated, never raised: the engine's teardown must still run."""
    if isinstance(ca_comm, CaCommAdapter):
        try:
            ca_comm.close()
        except Exception as exc:  # noqa: BLE001 - the engine's own teardown must still run
            log.warning("%s: closing the communicator failed (%s: %s); its workspaces stay allocated", tag,
                        type(exc).__name__, exc)


class CaCommAdapter:
    """A communicator behind an engine's custom-all-reduce interface.

    Construction is collective over ``group`` (the tp group's gloo group, which both engines
    pass): every rank of the group must construct it at the same point.

    Args:
        group: the CPU process group of the tp group.
        device: this rank's CUDA device.
        settings: the plugin's settings (max bytes, algorithm override, timeout, fused, wire).
        communicator_factory: builds the communicator (tests on CPU pass a stand-in for
            pcie_allreduce's, never for the engine's classes).
    """

    #: The engine's name in log lines ("sglang") and in prose ("SGLang"), and the plugin's
    #: variables for the algorithm override and the wire, which warnings name.
    ENGINE: str = ""
    ENGINE_NAME: str = ""
    ALGO_VARIABLE: str = ""
    WIRE_VARIABLE: str = ""

    def __init__(self, group: dist.ProcessGroup, device: torch.device | int | str, settings: Any, *,
                 communicator_factory: CommunicatorFactory | None = None) -> None:
        # Engine code reads these two on every ca_comm (getattr(ca_comm, "_IS_CAPTURING", False)).
        self._IS_CAPTURING = False
        self.disabled = True
        factory = communicator_factory or default_factory()
        self.comm: AllReducer = factory(group, device, max_bytes=settings.max_bytes, timeout_s=settings.timeout_s)
        self.group = group
        self.device: torch.device = self.comm.device
        self.rank: int = self.comm.rank
        self.world_size: int = self.comm.world_size
        #: The communicator's largest message (its workspaces' size; the fused op's limit).
        self.max_bytes: int = self.comm.max_bytes
        self.algo: str = settings.algo
        #: Largest message :meth:`should_custom_ar` takes: ``max_bytes``, less where the forced
        #: algorithm takes less (the capped one-shots and two-shot), 0 where it cannot run on this
        #: communicator's transport. The communicator would raise for the rest inside the forward
        #: pass; declined, they take the engine's own path.
        self.largest_served: int = self._largest_served()
        self.fused_enabled: bool = settings.fused
        #: The compressed wire for messages of :attr:`wire_min_bytes` and more (None: exact),
        #: where the communicator offers it (a hierarchical one does not; it then stays exact).
        self.wire: str | None = None
        self.wire_min_bytes: int = settings.wire_min_bytes
        if settings.wire != "exact":
            if settings.wire in self.comm.wires:
                self.wire = settings.wire
            else:
                self._logger().warning("pcie_allreduce[%s]: %s=%s: this group's communicator (%s) has no such wire; "
                                       "its all-reduces stay exact", self.ENGINE, self.WIRE_VARIABLE, settings.wire,
                                       type(self.comm).__name__)
        self.disabled = False

    @property
    def max_size(self) -> int:
        """The largest message :meth:`should_custom_ar` takes (0 once closed), which is what the
        engines' own custom all-reduces mean by it: vLLM's and SGLang 0.5.23's take messages up to
        their ``max_size``, and SGLang's V2 defines it as ``max(max_pull_size, max_push_size)``
        and checks sizes against it at call sites (``nbytes <= comm.max_size``)."""
        return 0 if self.disabled else self.largest_served

    # ---- the all-reduce ------------------------------------------------------------------

    def should_custom_ar(self, inp: torch.Tensor) -> bool:
        """Whether this call is ours: a pure function of dtype, size, contiguity and device (and of
        what every rank shares: W, and the forced algorithm's reach, :attr:`largest_served`).

        It asks the communicator's own argument check (:func:`pcie_allreduce.validation.tensor_problem`)
        with :attr:`largest_served` as the limit, so a call it accepts is never refused inside the
        forward pass. The engines' own kernels also want ``nbytes % 16 == 0``; ours take any size.
        """
        if self.disabled or validation.tensor_problem(inp, name="input", device=self.device,
                                                      max_bytes=self.largest_served) is not None:
            return False
        return inp.numel() > 0

    def _all_reduce(self, inp: torch.Tensor) -> torch.Tensor | None:
        """The out-of-place all-reduce of a call the engine hands us; None where it is declined."""
        if not self.should_custom_ar(inp):
            return None
        # A failure recorded by a graph replay on another stream's workspace (decode and verify
        # run in graphs) surfaces here, at the server's next eager collective, not never.
        self.comm.check()
        wire = self._wire_for(inp)
        if wire is not None:
            return self.comm.all_reduce(inp, wire=wire)
        return self.comm.all_reduce(inp, algo=self.algo)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """The engine's graph-capture context: make the capture stream's workspace now.

        Entered with the capture stream already current, before any capture starts. The
        communicator keeps one workspace per stream and creates a missing one collectively on
        first use, so creating it here, where every rank is at the same point, keeps that
        collective out of the captured region. First the ranks agree that the stream is new to
        all of them or to none: a stream handle that one rank reused and another did not would
        otherwise pair different workspaces and hang.
        """
        if self.disabled:
            yield
            return
        self._agree_on_stream_workspace()
        self._IS_CAPTURING = True
        try:
            yield
        finally:
            self._IS_CAPTURING = False
        self.comm.check()

    def close(self) -> None:
        """Free the workspaces, the graph-captured ones too: the engine calls this as it tears the
        group down (vLLM's ``CudaCommunicator.destroy``, SGLang's ``GroupCoordinator.destroy``),
        after which it replays none of the group's graphs (each frees its own all-reduce's graph
        buffers there too). Collective over the group, bounded where a peer is gone (the
        communicator then keeps its memory rather than wait), and idempotent."""
        if self.disabled:
            return
        self.disabled = True
        self.comm.close(release_captured=True)

    # ---- fused all-reduce + residual add + RMSNorm ----------------------------------------

    def can_fuse(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
        """Whether the fused op serves these arguments (pure, like :meth:`should_custom_ar`): the
        communicator's own check of a fused call (:func:`pcie_allreduce.validation.rmsnorm_problem`),
        so whatever this accepts the call serves, on every engine."""
        if self.disabled or not self.fused_enabled:
            return False
        return validation.rmsnorm_problem(x, residual, weight, eps, device=self.device,
                                          max_bytes=self.max_bytes) is None and x.numel() > 0

    def _all_reduce_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused op on arguments :meth:`can_fuse` accepted: ``(normed, new_residual)``, new tensors."""
        self.comm.check()
        wire = self._wire_for(x)
        if wire is not None:
            return self.comm.all_reduce_rmsnorm(x, residual, weight, float(eps), wire=wire)
        return self.comm.all_reduce_rmsnorm(x, residual, weight, float(eps))

    # ---- internals -----------------------------------------------------------------------

    def _wire_for(self, x: torch.Tensor) -> str | None:
        """The wire of a call on ``x``: the compressed one from :attr:`wire_min_bytes` up, else exact
        (None). A pure function of the size, so every rank picks the same."""
        if self.wire is None or x.numel() * x.element_size() < self.wire_min_bytes:
            return None
        return self.wire

    def _largest_served(self) -> int:
        if self.algo == "auto":
            return self.max_bytes
        problem = algorithms.availability_problem(self.algo, self.comm.transport, self.comm.island_ranks)
        if problem is not None:
            self._logger().warning("pcie_allreduce[%s]: %s=%s: %s: every all-reduce stays on %s's own path",
                                   self.ENGINE, self.ALGO_VARIABLE, self.algo, problem, self.ENGINE_NAME)
            return 0
        limit = self.comm.capacity_of(self.algo)  # a hierarchy's: on its fp32 partials
        return self.max_bytes if limit is None else max(0, min(self.max_bytes, limit))

    def _agree_on_stream_workspace(self) -> None:
        stream = 0 if self.device.type != "cuda" else torch.cuda.current_stream(self.device).cuda_stream
        known = bool(self.comm.serves_stream(stream))  # no collective, no creation
        views: list[Any] = [None] * self.world_size
        dist.all_gather_object(views, known, group=self.group)
        if len(set(views)) != 1:
            raise RuntimeError(
                f"pcie_allreduce {self.ENGINE} plugin: ranks disagree on whether the graph-capture stream is new "
                f"(per rank: {views}); a CUDA stream handle was reused on some ranks only. Capture on a fresh "
                "torch.cuda.Stream() created in the same order on every rank.")
        if not known:
            self.comm.prepare_stream(stream)  # collective on every rank, outside any capture

    def _logger(self) -> logging.Logger:
        return logging.getLogger(f"{self.ENGINE}_plugin")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
                f"max_bytes={self.max_bytes}, algo={self.algo!r}, disabled={self.disabled})")
