"""What both engine plugins' tests stand in for: our communicator, and the plugin's installation.

``GlooCommunicator`` stands in for ``pcie_allreduce.Communicator`` on gloo in the CPU conformance
tests (the real one's kernels need a GPU; the engines' classes are never stood in for): it has the
members of :class:`pcie_allreduce.interface.AllReducer` with its signatures, sums through ``dist.all_reduce`` on the CPU group, and records
what it was asked, so a test can see what the engine routed to it. ``ensure_entry_point`` makes an
engine's plugin loader find the plugin in a checkout that was not pip-installed."""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from importlib.metadata import entry_points
from typing import Any

import torch
import torch.distributed as dist

from pcie_allreduce.plan import algorithms
from pcie_allreduce.layout import Layout


def rmsnorm(v: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``v`` times ``weight`` in fp32, rounded to ``v``'s dtype."""
    f = v.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(v.dtype)


class GlooCommunicator:
    """The communicator as the adapters see it, on gloo."""

    wires = ("fp8",)

    def __init__(self, group: Any, device: Any, max_bytes: int, timeout_s: float) -> None:
        self.group, self.device = group, torch.device(device)
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.max_bytes, self.timeout_s = max_bytes, timeout_s
        self.ll_capacity = Layout.make(max_bytes, self.world_size).ll_capacity
        self.transport, self.transport_reason, self.island_ranks = "p2p", "asked for", 0
        self.handle = 0  # never registered: the CPU tests make no torch.ops call
        self.calls: list[tuple] = []
        self.streams = {0}
        self.closed = False

    def all_reduce(self, x, out=None, algo="auto", *, wire=None):
        assert x.numel() * x.element_size() <= self.max_bytes
        y = x.clone()
        dist.all_reduce(y, group=self.group)
        self.calls.append(("all_reduce", tuple(x.shape), x.dtype, algo))
        return y

    def all_reduce_rmsnorm(self, x, residual, weight, eps, *, out=None, residual_out=None, algo="auto", wire=None):
        reduced = x.clone()
        dist.all_reduce(reduced, group=self.group)
        new_residual = residual + reduced
        self.calls.append(("all_reduce_rmsnorm", tuple(x.shape), x.dtype))
        return rmsnorm(new_residual, weight, eps), new_residual

    def select_algo(self, nbytes, dtype):
        return "oneshot" if nbytes <= 256 << 10 else "twoshot"

    def capacity_of(self, algo):
        return None if algo == "auto" else algorithms.capacity_of(algo, self.ll_capacity)

    def serves_stream(self, stream=None):
        return stream in self.streams

    def prepare_stream(self, stream=None):
        self.calls.append(("prepare_stream", stream))
        self.streams.add(stream)

    def check(self):
        self.calls.append(("check",))

    def close(self, *, release_captured=False):
        self.closed = True
        dist.barrier(group=self.group)


class CappedCommunicator:
    """A communicator as an engine's adapter sees it, on ``transport``, raising as the real one does
    for a forced algorithm the message does not fit (or the transport does not run); records the
    algorithm of every call it served."""

    device, rank, world_size, max_bytes, island_ranks = torch.device("cpu"), 0, 2, 8 << 20, 0

    def __init__(self, *args: Any, transport: str = "p2p", **kwargs: Any) -> None:
        self.transport = transport
        self.ll_capacity = Layout.make(self.max_bytes, self.world_size).ll_capacity
        self.launched: list[str] = []

    def check(self) -> None:
        pass

    def capacity_of(self, algo: str) -> int | None:
        return algorithms.capacity_of(algo, self.ll_capacity)

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None = None, algo: str = "auto") -> torch.Tensor:
        from pcie_allreduce.plan import dispatch, tables

        nbytes = x.numel() * x.element_size()
        problem = algorithms.call_problem(algo, nbytes, x.element_size(), self.transport, 0, 1 << 30,
                                          self.ll_capacity)
        if problem is not None:  # raises as the communicator would
            raise ValueError(problem)
        dispatch.plain_choice(nbytes, self.world_size, x.dtype, tables.default_table(),
                              ll_capacity=self.ll_capacity, algo=algo)  # raises as the communicator would
        if not algorithms.runs_on(algo, self.transport):
            raise ValueError(f"algo={algo!r} runs on the host transport only")
        self.launched.append(algo)
        return x.clone()


def ensure_entry_point(group: str, name: str, value: str, prefix: str) -> str | None:
    """Make an engine's plugin loader find entry point ``name = value`` of ``group`` in this
    process, installed or not. When the package is installed its metadata already declares it and
    nothing is done (returns None); otherwise a minimal ``*.dist-info`` declaring it is written to a
    temporary directory put first on ``sys.path`` (returns it), so the engine discovers the plugin
    exactly as it would an installed one. ``prefix`` names the directory and distribution."""
    if any(ep.name == name and ep.value == value for ep in entry_points(group=group)):
        return None
    root = tempfile.mkdtemp(prefix=f"{prefix}_ep_")
    info = os.path.join(root, f"{prefix}_entrypoint-0.0.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w", encoding="utf-8") as f:
        f.write(f"Metadata-Version: 2.1\nName: {prefix.replace('_', '-')}-entrypoint\nVersion: 0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w", encoding="utf-8") as f:
        f.write(f"[{group}]\n{name} = {value}\n")
    sys.path.insert(0, root)
    importlib.invalidate_caches()
    return root
