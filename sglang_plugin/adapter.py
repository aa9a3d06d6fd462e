"""``PcieAllReduceAdapter``: a ``pcie_allreduce.Communicator`` behind SGLang's ``ca_comm`` surface.

``GroupCoordinator`` (sglang/srt/distributed/parallel_state.py) uses its ``ca_comm`` through
``disabled``, ``should_custom_ar(t)``, ``custom_all_reduce(t)`` (out of place, a tensor whenever
``should_custom_ar`` said yes), ``capture()`` around CUDA-graph capture, ``close()`` and
``max_size``; ``fused_allreduce_rmsnorm(...)`` is probed with ``hasattr``. It also answers
SGLang's newer ("V2") interface (surface.INTERFACES): ``custom_all_reduce(input,
override_algo=None)``, the per-direction ceilings ``max_push_size`` / ``max_pull_size`` and the
``override_algo`` attribute. Nothing SGLang's call sites test with ``isinstance(..,
CustomAllReduceV2)`` (they use that class's own kernels and planes, which this is not).

CUDA-graph safety: every rank must capture the same sequence of collectives, so every decision
here (serve or decline, fuse or decline) is a pure function of the tensor's dtype, shape,
contiguity and the world size, which all ranks share; none looks at pointers or timing.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from pcie_allreduce import algo as algo_mod, validation
from sglang_plugin.settings import ALGO, MAX_BYTES, WIRE, Settings, SettingsError, format_bytes

logger = logging.getLogger("sglang_plugin")

# Our algorithms that read each rank's staged data out of its own memory (SGLang's "pull");
# every other one writes it into the peers' memory, or into shared host memory they poll ("push").
PULL_ALGORITHMS: tuple[str, ...] = (*algo_mod.PULL_ALGORITHMS, *algo_mod.SYMMETRIC_INPUT_ALGORITHMS,
                                    *algo_mod.LOSSY_ALGORITHMS)

# What the communicator accepts, so the adapter declines the rest up front.
DTYPES: tuple[torch.dtype, ...] = validation.SUPPORTED_DTYPES
FUSED_DTYPES: tuple[torch.dtype, ...] = validation.RMSNORM_DTYPES
MAX_FUSED_HIDDEN: int = validation.MAX_RMSNORM_HIDDEN

CommunicatorFactory = Callable[..., Any]


def _default_factory() -> CommunicatorFactory:
    from pcie_allreduce.communicator import Communicator

    return Communicator


def hierarchical_factory(layout: Any) -> CommunicatorFactory:
    """What builds the communicator of a tp group across ``layout``'s nodes
    (``pcie_allreduce.HierarchicalCommunicator``): the nodes' kernels on the gloo group SGLang
    passes, the sends between nodes on an NCCL group of the same ranks that the communicator
    makes, with the plugin's timeout as that group's (and shuts down on close). SGLang hands its
    custom all-reduce only the CPU group, not the tp group's NCCL one. A ``max_bytes`` above what
    a group across nodes takes is a SettingsError naming the variable, on every rank alike."""

    def make(group: dist.ProcessGroup, device: torch.device, *, max_bytes: int, timeout_s: float) -> Any:
        from pcie_allreduce import hierarchy

        if max_bytes > hierarchy.MAX_BYTES:
            raise SettingsError(f"{MAX_BYTES}={format_bytes(max_bytes)}: a tp group across nodes takes at most "
                                f"{format_bytes(hierarchy.MAX_BYTES)} (its nodes all-reduce fp32 partials, twice a "
                                "16-bit message)")
        return hierarchy.HierarchicalCommunicator(group, device, layout=layout, inter_node_backend="nccl",
                                                  max_bytes=max_bytes, timeout_s=timeout_s,
                                                  inter_node_timeout_s=timeout_s)

    return make


class PcieAllReduceAdapter:
    """SGLang's custom-all-reduce interface over :class:`pcie_allreduce.Communicator`.

    Construction is collective over ``group`` (a gloo group; SGLang passes its ``cpu_group``):
    every rank of the group must construct it at the same point.

    Args:
        group: the CPU process group of the tp group.
        device: this rank's CUDA device.
        settings: the plugin's settings (max bytes, algorithm override, timeout).
        communicator_factory: builds the communicator (tests on CPU pass a stand-in for
            pcie_allreduce's, never for SGLang's classes).
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device | int | str, settings: Settings, *,
                 communicator_factory: CommunicatorFactory | None = None) -> None:
        # SGLang code reads these two on every ca_comm (getattr(ca_comm, "_IS_CAPTURING", False)).
        self._IS_CAPTURING = False
        self.disabled = True
        factory = communicator_factory or _default_factory()
        self.comm = factory(group, device, max_bytes=settings.max_bytes, timeout_s=settings.timeout_s)
        self.group = group
        self.device: torch.device = self.comm.device
        self.rank: int = self.comm.rank
        self.world_size: int = self.comm.world_size
        self.max_size: int = self.comm.max_bytes
        self.algo: str = settings.algo
        #: Largest message :meth:`should_custom_ar` takes: ``max_size``, less where the forced
        #: algorithm takes less (the capped one-shots and two-shot), 0 where it cannot run on this
        #: communicator's transport. The communicator would raise for the rest inside the forward
        #: pass; declined, they take SGLang's own path.
        self.largest_served: int = self._largest_served()
        #: SGLang V2's persistent algorithm pin, which call sites read (``is None``) and may set;
        #: ignored like the per-call one (:meth:`custom_all_reduce`).
        self.override_algo: Any = None
        self.fused_enabled: bool = settings.fused
        #: The compressed wire for messages of :attr:`wire_min_bytes` and more (None: exact),
        #: where the communicator offers it (a hierarchical one does not; it then stays exact).
        self.wire: str | None = None
        self.wire_min_bytes: int = settings.wire_min_bytes
        if settings.wire != "exact":
            if settings.wire in getattr(self.comm, "wires", ()):
                self.wire = settings.wire
            else:
                logger.warning("pcie_allreduce[sglang]: %s=%s: this group's communicator (%s) has no such wire; "
                               "its all-reduces stay exact", WIRE, settings.wire, type(self.comm).__name__)
        self.disabled = False

    # ---- SGLang's ca_comm surface -------------------------------------------------------

    def should_custom_ar(self, inp: torch.Tensor) -> bool:
        """Whether this call is ours: a pure function of dtype, size and contiguity (and of what every
        rank shares: W, and the forced algorithm's reach, :attr:`largest_served`).

        SGLang's own kernel also wants ``nbytes % 16 == 0`` and weak contiguity; ours takes any
        size but needs a contiguous tensor, so that is what is checked.
        """
        if self.disabled or inp.dtype not in DTYPES or not inp.is_contiguous():
            return False
        nbytes = inp.numel() * inp.element_size()
        return 0 < nbytes <= self.largest_served and inp.device == self.device

    def custom_all_reduce(self, input: torch.Tensor,  # noqa: A002 - SGLang's name
                          override_algo: Any = None) -> torch.Tensor | None:
        """Sum over the group into a NEW tensor; None when :meth:`should_custom_ar` declines.

        Unlike SGLang's kernel, warm-up runs inside ``capture()`` (outside stream capture) do the
        real reduction: every rank runs the same warm-ups, and real values keep them honest.

        ``override_algo`` (the V2 interface; SGLang's ``AllReduceAlgo``: ``ONE_SHOT_PUSH``,
        ``TWO_SHOT_PUSH``, ``ONE_SHOT_PULL``, ``TWO_SHOT_PULL``, or anything else) is accepted and
        does not change what runs: SGLang's callers pin an algorithm so that a call's floating-point
        summation order does not depend on the size-based choice, and every algorithm here already
        sums in fp32 in rank order, bitwise equal to every other, so that holds whatever runs;
        the choice stays the table's (tuned for this fabric; SGLang's pins are for its NVLink
        kernels) or the forced ``PCIE_AR_SGLANG_ALGO``. Never raises for it.
        """
        if not self.should_custom_ar(input):
            return None
        # A failure recorded by a graph replay on another stream's workspace (decode and verify
        # run in graphs) surfaces here, at the server's next eager collective, not never.
        self.comm.check()
        wire = self._wire_for(input)
        if wire is not None:
            return self.comm.all_reduce(input, wire=wire)
        return self.comm.all_reduce(input, algo=self.algo)

    @property
    def max_push_size(self) -> int:
        """The V2 interface's ceiling of push messages: in SGLang the largest message its push
        algorithms can take (a capacity, not where its selection switches; 0: none). Here the
        largest message served by ours that push (each rank's data written into its peers' memory,
        or into shared host memory they poll): every size :meth:`should_custom_ar` takes, 0 when a
        pull algorithm is forced."""
        return 0 if self.disabled or self.algo in PULL_ALGORITHMS else self.largest_served

    @property
    def max_pull_size(self) -> int:
        """The V2 interface's ceiling of pull messages (peers read each rank's staged data): every
        size :meth:`should_custom_ar` takes where the table may pick ``oneshot_pull`` /
        ``twoshot_pull`` (``auto``) or one is forced, else 0. The larger of the two is the largest
        message :meth:`should_custom_ar` takes, as in SGLang (:attr:`max_size` keeps 0.5.23's
        meaning: the communicator's ``max_bytes``)."""
        served = self.algo == "auto" or self.algo in PULL_ALGORITHMS
        return self.largest_served if served and not self.disabled else 0

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """SGLang's ``graph_capture()`` context: make the capture stream's workspace now.

        ``GroupCoordinator.graph_capture`` enters this with the capture stream already current,
        before any capture starts. The communicator keeps one workspace per stream and creates a
        missing one collectively on first use, so creating it here, where every rank is at the
        same point, keeps that collective out of the captured region. First the ranks agree that
        the stream is new to all of them or to none: a stream handle that one rank reused and
        another did not would otherwise pair different workspaces and hang.
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
        """Free the workspaces (collective: every rank of the group must call it)."""
        if self.disabled:
            return
        self.disabled = True
        self.comm.close()

    # ---- fused all-reduce + residual add + RMSNorm ----------------------------------------

    def can_fuse(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether :meth:`fused_allreduce_rmsnorm` serves these shapes (pure, like should_custom_ar)."""
        if self.disabled or not self.fused_enabled:
            return False
        if x.dim() != 2 or x.dtype not in FUSED_DTYPES or not 1 <= x.shape[1] <= MAX_FUSED_HIDDEN:
            return False
        if residual.shape != x.shape or residual.dtype != x.dtype:
            return False
        if tuple(weight.shape) != (x.shape[1],) or weight.dtype not in (x.dtype, torch.float32):
            return False
        if not (x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous()):
            return False
        nbytes = x.numel() * x.element_size()
        return 0 < nbytes <= self.max_size and x.device == self.device

    def fused_allreduce_rmsnorm(self, input_: torch.Tensor, residual_inp_: torch.Tensor, weight_: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(rmsnorm(residual + all_reduce(input)) * weight, residual + all_reduce(input))``, both new
        tensors; None when :meth:`can_fuse` declines (the caller then runs the unfused path).

        The name and argument order are the ones ``GroupCoordinator.fused_allreduce_rmsnorm``
        probes for on its ``ca_comm``.
        """
        if not self.can_fuse(input_, residual_inp_, weight_):
            return None
        if torch.compiler.is_compiling():
            # Under torch.compile (--enable-torch-compile) the call is one opaque op of the graph:
            # Dynamo never traces the Triton launch. (The forward-step hook does the check there.)
            # A group across nodes has no such op: SGLang's unfused path serves it there.
            handle = getattr(self.comm, "handle", None)
            if handle is None:
                return None
            return torch.ops.pcie_allreduce.all_reduce_rmsnorm(input_, residual_inp_, weight_, float(eps),
                                                               handle, "auto", self._wire_for(input_))
        self.comm.check()
        wire = self._wire_for(input_)
        if wire is not None:
            return self.comm.all_reduce_rmsnorm(input_, residual_inp_, weight_, float(eps), wire=wire)
        return self.comm.all_reduce_rmsnorm(input_, residual_inp_, weight_, float(eps))

    # ---- internals -----------------------------------------------------------------------

    def _wire_for(self, x: torch.Tensor) -> str | None:
        """The wire of a call on ``x``: the compressed one from :attr:`wire_min_bytes` up, else exact
        (None). A pure function of the size, so every rank picks the same."""
        if self.wire is None or x.numel() * x.element_size() < self.wire_min_bytes:
            return None
        return self.wire

    def _largest_served(self) -> int:
        if self.algo == "auto":
            return self.max_size
        problem = algo_mod.availability_problem(self.algo, self.comm.transport, self.comm.island_ranks)
        if problem is not None:
            logger.warning("pcie_allreduce[sglang]: %s=%s: %s: every all-reduce stays on SGLang's own path", ALGO,
                           self.algo, problem)
            return 0
        limit = self.comm.capacity_of(self.algo)  # a hierarchy's: on its fp32 partials
        return self.max_size if limit is None else max(0, min(self.max_size, limit))

    def _agree_on_stream_workspace(self) -> None:
        stream = _current_stream_handle(self.device)
        known = _knows_stream(self.comm, stream)
        views: list[Any] = [None] * self.world_size
        dist.all_gather_object(views, known, group=self.group)
        if len(set(views)) != 1:
            raise RuntimeError(
                f"pcie_allreduce sglang plugin: ranks disagree on whether the graph-capture stream is new "
                f"(per rank: {views}); a CUDA stream handle was reused on some ranks only. Capture on a fresh "
                "torch.cuda.Stream() created in the same order on every rank.")
        if not known:
            self.comm.workspace(stream)  # collective on every rank, outside any capture

    def __repr__(self) -> str:
        return (f"PcieAllReduceAdapter(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
                f"max_size={self.max_size}, algo={self.algo!r}, disabled={self.disabled})")


def _current_stream_handle(device: torch.device) -> int:
    """The raw handle the communicator keys its workspaces by (0 off CUDA, for CPU stand-ins)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.current_stream(device).cuda_stream


def _knows_stream(comm: Any, stream: int) -> bool:
    """Whether ``comm`` already has a workspace for ``stream`` (no collective, no creation)."""
    return bool(comm.has_workspace(stream))
