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

from typing import Any

import torch
import torch.distributed as dist

from pcie_allreduce.plan import algorithms
from pcie_allreduce.plugin_adapter import CaCommAdapter, CommunicatorFactory
from pcie_allreduce.settings import SettingsError, format_bytes
from sglang_plugin.settings import ALGO, MAX_BYTES, WIRE

# Our algorithms that read each rank's staged data out of its own memory (SGLang's "pull");
# every other one writes it into the peers' memory, or into shared host memory they poll ("push").
PULL_ALGORITHMS: tuple[str, ...] = (*algorithms.PULL_ALGORITHMS, *algorithms.SYMMETRIC_INPUT_ALGORITHMS,
                                    *algorithms.LOSSY_ALGORITHMS)


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


class PcieAllReduceAdapter(CaCommAdapter):
    """SGLang's custom-all-reduce interface over :class:`pcie_allreduce.Communicator`
    (:class:`~pcie_allreduce.plugin_adapter.CaCommAdapter` holds what does not depend on SGLang).
    """

    ENGINE, ENGINE_NAME, ALGO_VARIABLE, WIRE_VARIABLE = "sglang", "SGLang", ALGO, WIRE
    #: SGLang V2's persistent algorithm pin, which call sites read (``is None``) and may set on an
    #: instance; ignored like the per-call one (:meth:`custom_all_reduce`).
    override_algo: Any = None

    # ---- SGLang's ca_comm surface -------------------------------------------------------

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
        return self._all_reduce(input)

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
        message :meth:`should_custom_ar` takes, :attr:`max_size`, as in SGLang."""
        served = self.algo == "auto" or self.algo in PULL_ALGORITHMS
        return self.largest_served if served and not self.disabled else 0

    # ---- fused all-reduce + residual add + RMSNorm ----------------------------------------

    def fused_allreduce_rmsnorm(self, input_: torch.Tensor, residual_inp_: torch.Tensor, weight_: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(rmsnorm(residual + all_reduce(input)) * weight, residual + all_reduce(input))``, both new
        tensors; None when :meth:`can_fuse` declines (the caller then runs the unfused path).

        The name and argument order are the ones ``GroupCoordinator.fused_allreduce_rmsnorm``
        probes for on its ``ca_comm``.
        """
        if not self.can_fuse(input_, residual_inp_, weight_, eps):
            return None
        if torch.compiler.is_compiling():
            # Under torch.compile (--enable-torch-compile) the call is one opaque op of the graph:
            # Dynamo never traces the Triton launch. (The forward-step hook does the check there.)
            return torch.ops.pcie_allreduce.all_reduce_rmsnorm(input_, residual_inp_, weight_, float(eps),
                                                               self.comm.handle, "auto", self._wire_for(input_))
        return self._all_reduce_rmsnorm(input_, residual_inp_, weight_, eps)
