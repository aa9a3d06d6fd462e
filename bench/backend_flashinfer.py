"""Rank side of the ``flashinfer`` backend: FlashInfer's PCIe IPC all-reduce
(``flashinfer.comm.PcieIpcAllReduceWorkspace``, FlashInfer >= 0.7), out of place.

The workspace resolves a launch configuration per shape with a small collective the first time
it sees that shape, which cannot happen inside a graph capture: the rank loop's eager
correctness call comes first for every case, so every shape is resolved before it is captured.
Untuned it runs seed launch configurations, which FlashInfer warns are "workable, not fast", and
tells its users to run ``workspace.tune`` once per machine: the rank loop calls :meth:`tune`
before the first case (unless ``--untuned-baselines``), so its rows are the best a user would
run. The tuning goes to a cache file of this run's own, never FlashInfer's per-user cache: a run
neither reads another process's tuning nor leaves its own behind.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any, Callable

import torch

from pcie_allreduce.sizes import DTYPE_SIZES
from pcie_allreduce.tools.ranks import RankContext

from bench.backends import Backend, Buffers
from bench.plan import Case, RankJob

SYNC_COUNT = 64  # elements of the device-sync all-reduce (whole 16-byte packs in bf16/fp16/fp32)


TUNE_CACHE = "flashinfer_pcie_ipc_tune.json"  # in the run's own directory


def _open_workspace(group: Any, max_numel: int, dtype: torch.dtype, tune_cache: str) -> Any:
    import flashinfer.comm as fi_comm

    workspace_cls = getattr(fi_comm, "PcieIpcAllReduceWorkspace", None)
    if workspace_cls is None:
        import flashinfer

        raise RuntimeError(f"FlashInfer {getattr(flashinfer, '__version__', '?')} has no "
                           "comm.PcieIpcAllReduceWorkspace (added in 0.7)")
    # The bench's messages are flat: FlashInfer reads a 1-D tensor as one row of ``count``
    # elements, so its tuning buckets are batch 1 of each message's count.
    return workspace_cls(group=group, max_numel=max_numel, dtype=dtype, tune_batches=(1,), tune_cache=tune_cache)


class FlashInferPcieIpcBackend(Backend):
    """One ``PcieIpcAllReduceWorkspace`` sized for the run's largest message."""

    algorithms = ("pcie_ipc",)
    packages = ("flashinfer",)
    install_hint = "pip install flashinfer-python; its PCIe IPC all-reduce needs >= 0.7"

    def __init__(self, ctx: RankContext, job: RankJob,
                 open_workspace: Callable[[Any, int, torch.dtype, str], Any] = _open_workspace) -> None:
        self._device = ctx.device
        self._counts = sorted({case.count for case in job.cases})
        self._tuning = "untuned: seed launch configurations"
        self._dtype = getattr(torch, job.dtype)
        pack = 16 // DTYPE_SIZES[job.dtype]
        max_numel = max(job.max_bytes // DTYPE_SIZES[job.dtype], SYNC_COUNT)
        max_numel = (max_numel + pack - 1) // pack * pack  # the workspace takes whole 16-byte packs
        self._problem: str | None = None
        self._ws: Any = None
        try:
            self._ws = open_workspace(ctx.group, max_numel, self._dtype, os.path.join(job.progress_dir, TUNE_CACHE))
        except Exception as exc:  # noqa: BLE001 - reported per case as the skip reason (raised on every rank)
            self._problem = f"FlashInfer PCIe IPC workspace unavailable: {type(exc).__name__}: {exc}"
        self._sync = torch.zeros(SYNC_COUNT, dtype=self._dtype, device=ctx.device)
        self._sync_out = torch.empty_like(self._sync)

    def tune(self) -> None:
        """FlashInfer's per-machine tuning (``workspace.tune``, collective) of every message size
        of this run the workspace takes; a failure leaves the seed configurations, and says so."""
        if self._ws is None:
            return
        counts = [n for n in self._counts if self._takes(n)]
        if not counts:
            return
        started = time.perf_counter()
        try:
            with warnings.catch_warnings():
                # FlashInfer warns, per size, that batches above the largest tuned run that one's
                # configuration: the bench's messages are each one flat row, so none does.
                warnings.filterwarnings("ignore", message="tuning stops at", category=RuntimeWarning)
                tuned = self._ws.tune(counts, dtype=self._dtype)
        except Exception as exc:  # noqa: BLE001 - the run goes on with the seed configurations, reported
            self._tuning = f"untuned: workspace.tune raised {type(exc).__name__}: {exc}"
            return
        self._tuning = (f"workspace.tune: {len(tuned)} shapes of {len(counts)} sizes in "
                        f"{time.perf_counter() - started:.1f} s")

    def facts(self) -> dict[str, Any]:
        if self._ws is None:
            return {}
        return {"flashinfer_profile": str(getattr(self._ws, "profile", "")),
                "flashinfer_profile_reason": str(getattr(self._ws, "profile_reason", "")),
                "baseline_tuning": self._tuning}

    def skip_reason(self, case: Case) -> str | None:
        if self._problem is not None:
            return self._problem
        if not self._takes(case.count):
            return f"PcieIpcAllReduceWorkspace.supports() is False for {case.count} x {self._dtype}"
        return None

    def _takes(self, count: int) -> bool:
        """Whether the workspace takes a message of ``count`` elements (``supports``)."""
        return bool(self._ws.supports(torch.empty(count, dtype=self._dtype, device=self._device)))

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
