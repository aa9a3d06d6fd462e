"""Rank side of the ``flashinfer`` backend: FlashInfer's PCIe IPC all-reduce
(``flashinfer.comm.PcieIpcAllReduceWorkspace``, FlashInfer >= 0.7), out of place.

The workspace resolves a launch configuration per shape with a small collective the first time
it sees that shape, which cannot happen inside a graph capture: the rank loop's eager
correctness call comes first for every case, so every shape is resolved before it is captured.
It runs the seed (untuned) configurations unless its own tune cache exists; the bench does not
tune it (``workspace.tune`` is FlashInfer's, per machine), and says so in the setup facts.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from pcie_allreduce.sizes import DTYPE_SIZES
from pcie_allreduce.tools.ranks import RankContext

from bench.backends import Backend, Buffers
from bench.plan import Case, RankJob

SYNC_COUNT = 64  # elements of the device-sync all-reduce (whole 16-byte packs in bf16/fp16/fp32)


def _open_workspace(group: Any, max_numel: int, dtype: torch.dtype) -> Any:
    import flashinfer.comm as fi_comm

    workspace_cls = getattr(fi_comm, "PcieIpcAllReduceWorkspace", None)
    if workspace_cls is None:
        import flashinfer

        raise RuntimeError(f"FlashInfer {getattr(flashinfer, '__version__', '?')} has no "
                           "comm.PcieIpcAllReduceWorkspace (added in 0.7)")
    return workspace_cls(group=group, max_numel=max_numel, dtype=dtype)


class FlashInferPcieIpcBackend(Backend):
    """One ``PcieIpcAllReduceWorkspace`` sized for the run's largest message."""

    algorithms = ("pcie_ipc",)
    packages = ("flashinfer",)
    install_hint = "pip install flashinfer-python; its PCIe IPC all-reduce needs >= 0.7"

    def __init__(self, ctx: RankContext, job: RankJob,
                 open_workspace: Callable[[Any, int, torch.dtype], Any] = _open_workspace) -> None:
        self._device = ctx.device
        self._dtype = getattr(torch, job.dtype)
        pack = 16 // DTYPE_SIZES[job.dtype]
        max_numel = max(job.max_bytes // DTYPE_SIZES[job.dtype], SYNC_COUNT)
        max_numel = (max_numel + pack - 1) // pack * pack  # the workspace takes whole 16-byte packs
        self._problem: str | None = None
        self._ws: Any = None
        try:
            self._ws = open_workspace(ctx.group, max_numel, self._dtype)
        except Exception as exc:  # noqa: BLE001 - reported per case as the skip reason (raised on every rank)
            self._problem = f"FlashInfer PCIe IPC workspace unavailable: {type(exc).__name__}: {exc}"
        self._sync = torch.zeros(SYNC_COUNT, dtype=self._dtype, device=ctx.device)
        self._sync_out = torch.empty_like(self._sync)

    def facts(self) -> dict[str, Any]:
        if self._ws is None:
            return {}
        return {"flashinfer_profile": str(getattr(self._ws, "profile", "")),
                "flashinfer_profile_reason": str(getattr(self._ws, "profile_reason", ""))}

    def skip_reason(self, case: Case) -> str | None:
        if self._problem is not None:
            return self._problem
        probe = torch.empty(case.count, dtype=self._dtype, device=self._device)
        if not self._ws.supports(probe):
            return f"PcieIpcAllReduceWorkspace.supports() is False for {case.count} x {self._dtype}"
        return None

    def buffers(self, count: int, dtype: torch.dtype, algo: str) -> Buffers:
        inp = torch.empty(count, dtype=dtype, device=self._device)
        return Buffers(inp, torch.empty_like(inp))

    def call(self, bufs: Buffers, algo: str) -> torch.Tensor:
        return self._ws.all_reduce(bufs.inp, out=bufs.out)

    def mutates_input(self, algo: str) -> bool:
        return False

    def resolved_algo(self, size_bytes: int, dtype: torch.dtype, algo: str) -> str:
        return algo

    def prepare_capture(self, stream: torch.cuda.Stream) -> None:
        pass  # the workspace binds to the eager stream; capture is exempt from that check

    def device_sync(self) -> None:
        if self._problem is None:
            self._ws.all_reduce(self._sync, out=self._sync_out)

    def check(self) -> None:
        pass

    def close(self) -> None:
        if self._ws is not None:
            self._ws.destroy()
