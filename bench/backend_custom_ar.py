"""Rank side of the ``vllm`` and ``sgl_kernel`` backends: the custom all-reduce that vLLM and
SGLang ship (one lineage: vLLM's kernels, copied into sgl-kernel), driven through each project's
own ``CustomAllreduce`` wrapper, exactly as their model runners drive it:

- eager calls copy the input into the wrapper's registered IPC buffer (``registered=False``);
- graph capture runs inside ``CustomAllreduce.capture()``, which registers the captured
  buffers with every peer when the capture ends (a collective);
- ``custom_all_reduce`` returns None when the wrapper declines a message (too large, not a
  multiple of 16 bytes): such cases are "skipped", with the reason, before they are timed.

Both wrappers disable themselves for more than two GPUs without full NVLink: the situation this
library exists for. That shows up as every case "skipped" with that reason, which is the point of
having the row.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, ContextManager

import torch

from pcie_allreduce.tools.ranks import RankContext

from bench.backends import Backend, Buffers
from bench.plan import Case, RankJob

SYNC_COUNT = 16  # elements of the device-sync all-reduce (a multiple of 16 bytes in fp32)

def _open_wrapper(module_name: str, group: Any, device: torch.device, max_size: int) -> Any:
    module = importlib.import_module(module_name)
    return module.CustomAllreduce(group=group, device=device, max_size=max_size)


class CustomAllreduceBackend(Backend):
    """vLLM's or SGLang's ``CustomAllreduce`` over the rank's gloo group; ``wrapper_module`` holds it."""

    algorithms = ("custom_ar",)
    wrapper_module = ""

    def __init__(self, ctx: RankContext, job: RankJob,
                 open_wrapper: Callable[[str, Any, torch.device, int], Any] = _open_wrapper) -> None:
        self._device = ctx.device
        self._name = job.backend
        self._max_size = max(job.max_bytes, 16)
        self._problem: str | None = None
        self._ca: Any = None
        try:
            self._ca = open_wrapper(self.wrapper_module, ctx.group, ctx.device, self._max_size)
        except Exception as exc:  # noqa: BLE001 - reported per case as the skip reason
            self._problem = f"{self._name} CustomAllreduce could not be created: {type(exc).__name__}: {exc}"
        else:
            if getattr(self._ca, "disabled", True):
                self._problem = (f"{self._name} CustomAllreduce disabled itself for this group (W={ctx.world_size}; "
                                 "it refuses more than 2 GPUs without full NVLink, and GPUs without P2P; "
                                 "its log above says which)")
        self._sync = torch.zeros(SYNC_COUNT, dtype=torch.float32, device=ctx.device)

    def skip_reason(self, case: Case) -> str | None:
        if self._problem is not None:
            return self._problem
        if case.size_bytes > self._max_size:
            return f"{case.size_bytes} bytes > the buffer it registered ({self._max_size})"
        if case.size_bytes % 16:
            return f"{case.size_bytes} bytes is not a multiple of 16 (the custom all-reduce declines it)"
        return None

    def buffers(self, count: int, dtype: torch.dtype, algo: str) -> Buffers:
        inp = torch.empty(count, dtype=dtype, device=self._device)
        return Buffers(inp, inp)  # out of place: the wrapper returns a new tensor

    def call(self, bufs: Buffers, algo: str) -> torch.Tensor:
        out = self._ca.custom_all_reduce(bufs.inp)
        if out is None:
            raise RuntimeError(f"{self._name} CustomAllreduce declined a {bufs.inp.numel()}-element "
                               f"{bufs.inp.dtype} tensor")
        return out

    def capture_context(self) -> ContextManager[Any]:
        """Wraps every CUDA-graph capture: registers the captured buffers when the capture ends."""
        return self._ca.capture()

    def mutates_input(self, algo: str) -> bool:
        return False

    def resolved_algo(self, size_bytes: int, dtype: torch.dtype, algo: str) -> str:
        return algo

    def prepare_capture(self, stream: torch.cuda.Stream) -> None:
        pass

    def device_sync(self) -> None:
        if self._problem is None:
            self.call(Buffers(self._sync, self._sync), self.algorithms[0])

    def check(self) -> None:
        pass  # the kernels have no error channel; a hang is caught by the bench watchdog

    def close(self) -> None:
        if self._ca is not None and hasattr(self._ca, "close"):
            self._ca.close()


class VllmCustomAllreduceBackend(CustomAllreduceBackend):
    packages = ("vllm",)
    install_hint = "pip install vllm"
    wrapper_module = "vllm.distributed.device_communicators.custom_all_reduce"


class SglKernelCustomAllreduceBackend(CustomAllreduceBackend):
    packages = ("sgl_kernel", "sglang")
    install_hint = "pip install sglang sgl-kernel"
    wrapper_module = "sglang.srt.distributed.device_communicators.custom_all_reduce"
