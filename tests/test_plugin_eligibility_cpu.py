"""Whatever a plugin's adapter accepts, the communicator's call serves: no setting or shape raises
inside a forward pass.

Both engines' adapters ask :class:`pcie_allreduce.plugin_adapter.CaCommAdapter`
(``should_custom_ar``, ``can_fuse``) before they call the communicator. Here the adapter sits on a
stand-in whose ``all_reduce`` and ``all_reduce_rmsnorm`` run every check the real
``Communicator``'s run before a launch (the same functions of :mod:`pcie_allreduce.validation` and
:mod:`pcie_allreduce.plan.dispatch`, in the same order), and stop short of the kernels. Random shapes,
dtypes, strides, devices, eps and settings (largest message, forced algorithm, wire, transport,
world size) are drawn with a fixed seed; every accepted call must then pass those checks.
"""

from __future__ import annotations

import random
import types
from typing import Any

import pytest
import torch

from pcie_allreduce import validation
from pcie_allreduce.plan import algorithms, dispatch, tables
from pcie_allreduce.layout import Layout
from pcie_allreduce.plugin_adapter import CaCommAdapter
from pcie_allreduce.plugin_settings import ALGOS

CPU = torch.device("cpu")
OTHER = torch.device("meta")  # a tensor on another device than the communicator's


class CheckingCommunicator:
    """The communicator's pre-launch checks without its kernels (see the module docstring)."""

    def __init__(self, world: int, transport: str, max_bytes: int) -> None:
        self.device, self.rank, self.world_size = CPU, 0, world
        self.max_bytes, self.transport, self.transport_reason, self.island_ranks = max_bytes, transport, "", 0
        self.ll_capacity = Layout.make(max_bytes, world, transport).ll_capacity
        self.table = tables.default_table(transport)
        self.block_cap = 64
        self.wires = tuple(w for w, kernel in algorithms.WIRE_ALGORITHMS.items()
                           if algorithms.runs_on(kernel, transport))

    def capacity_of(self, algo: str) -> int | None:
        return None if algo == "auto" else algorithms.capacity_of(algo, self.ll_capacity)

    def check(self) -> None:
        pass

    def all_reduce(self, x: Any, out: Any = None, algo: str = "auto", *, wire: str | None = None) -> torch.Tensor:
        if wire is not None:
            algo = validation.wire_algo(wire, algo)
        nbytes = validation.plain_call(x, out, algo, device=self.device, max_bytes=self.max_bytes)
        if nbytes == 0:
            return x
        problem = algorithms.call_problem(algo, nbytes, x.dtype.itemsize, self.transport, self.island_ranks,
                                          Layout.make(self.max_bytes, 1).slot_bytes, self.ll_capacity)
        if problem is not None:
            raise ValueError(problem)
        dispatch.plain_launch(nbytes, self.world_size, x.dtype, self.table, ll_capacity=self.ll_capacity,
                              block_cap=self.block_cap, algo=algo)
        return x

    def all_reduce_rmsnorm(self, x: Any, residual: Any, weight: Any, eps: float, *, algo: str = "auto",
                           wire: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, hidden, algo, wire_algo = validation.fused_call(x, residual, weight, eps, None, None, algo, wire,
                                                                device=self.device, max_bytes=self.max_bytes,
                                                                world=self.world_size)
        dispatch.fused_plan(tokens, hidden, x.dtype, self.world_size, self.table, ll_capacity=self.ll_capacity,
                            block_cap=self.block_cap, algo=algo, weight_dtype=weight.dtype, wire_algo=wire_algo,
                            transport=self.transport, island_ranks=self.island_ranks,
                            slot_bytes=Layout.make(self.max_bytes, 1).slot_bytes)
        return x, residual


def _adapter(rng: random.Random) -> CaCommAdapter:
    transport = rng.choice(("p2p", "host"))
    max_bytes = rng.choice((1, 100, 4096, 16 << 10, 100_000, 1 << 20, 8 << 20))
    wire = rng.choice(("exact", "exact", "fp8"))
    settings = types.SimpleNamespace(
        max_bytes=max_bytes, timeout_s=1.0, fused=rng.random() < 0.9, wire=wire,
        algo="auto" if wire != "exact" else rng.choice(ALGOS),
        wire_min_bytes=rng.choice((1, 2, 1000, max_bytes)))
    world = rng.choice((2, 3, 4, 8, 16))
    adapter = CaCommAdapter.__new__(CaCommAdapter)
    CaCommAdapter.__init__(adapter, None, CPU, settings,  # type: ignore[arg-type]
                           communicator_factory=lambda g, d, max_bytes, timeout_s: CheckingCommunicator(
                               world, transport, max_bytes))
    return adapter


def _tensor(rng: random.Random, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    kind = rng.random()
    if kind < 0.05:
        return torch.empty(shape, dtype=dtype, device=OTHER)
    if kind < 0.12 and len(shape) == 2 and shape[0] > 1:  # strided: every other row of a taller one
        return torch.zeros((shape[0] * 2, *shape[1:]), dtype=dtype)[::2]
    return torch.zeros(shape, dtype=dtype)


DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.float64)


def _draw_fused(rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    tokens = rng.choice((0, 1, 2, 3, 7, 64, 300))
    hidden = rng.choice((1, 3, 64, 4096, 8192, 16384, 16385))
    dtype = rng.choice(DTYPES[:3] + DTYPES[:2])
    x = _tensor(rng, (tokens, hidden), dtype)
    residual = _tensor(rng, (tokens, hidden) if rng.random() < 0.9 else (tokens, hidden + 1),
                       dtype if rng.random() < 0.9 else rng.choice(DTYPES))
    weight = _tensor(rng, (hidden,) if rng.random() < 0.9 else (hidden, 1),
                     rng.choice((dtype, torch.float32, torch.float32, torch.float64)))
    eps = rng.choice((1e-6, 1e-5, 1, 0.0, -1e-6, float("nan"), float("inf")))
    if rng.random() < 0.05:
        x = x.unsqueeze(0)
    return x, residual, weight, eps


@pytest.mark.parametrize("seed", range(4))
def test_whatever_can_fuse_accepts_the_fused_call_serves(seed: int) -> None:
    rng = random.Random(seed)
    accepted = 0
    for _ in range(1500):
        adapter = _adapter(rng)
        x, residual, weight, eps = _draw_fused(rng)
        if adapter.can_fuse(x, residual, weight, eps):
            accepted += 1
            adapter._all_reduce_rmsnorm(x, residual, weight, eps)  # must not raise
    assert accepted > 50  # the draw reaches the accepted side, not only refusals


def test_a_weight_larger_than_max_bytes_is_served() -> None:
    """hidden 8192 with an fp32 weight is 32 KiB: a 16 KiB MAX_BYTES still takes one token's bf16
    message (16 KiB); the weight is read in place, never staged, so its size is no limit."""
    settings = types.SimpleNamespace(max_bytes=16 << 10, timeout_s=1.0, fused=True, wire="exact", algo="auto",
                                     wire_min_bytes=1 << 20)
    adapter = CaCommAdapter.__new__(CaCommAdapter)
    CaCommAdapter.__init__(adapter, None, CPU, settings,  # type: ignore[arg-type]
                           communicator_factory=lambda g, d, max_bytes, timeout_s: CheckingCommunicator(
                               2, "p2p", max_bytes))
    x, residual = torch.zeros(1, 8192, dtype=torch.bfloat16), torch.zeros(1, 8192, dtype=torch.bfloat16)
    weight = torch.ones(8192, dtype=torch.float32)
    assert adapter.can_fuse(x, residual, weight, 1e-6)
    adapter._all_reduce_rmsnorm(x, residual, weight, 1e-6)
    assert not adapter.can_fuse(x, residual, weight, 0.0)  # a bad eps is declined, not raised


@pytest.mark.parametrize("seed", range(4))
def test_whatever_should_custom_ar_accepts_the_all_reduce_serves(seed: int) -> None:
    rng = random.Random(100 + seed)
    accepted = 0
    for _ in range(1500):
        adapter = _adapter(rng)
        shape = rng.choice(((0,), (1,), (5,), (7, 3), (4096,), (1000, 8), (1 << 20,), (3, 1 << 20)))
        x = _tensor(rng, shape, rng.choice(DTYPES))
        if adapter.should_custom_ar(x):
            accepted += 1
            adapter._all_reduce(x)  # must not raise
    assert accepted > 50
