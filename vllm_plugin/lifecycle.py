"""The two vLLM methods the plugin wraps besides ``CustomAllreduce``: the step and the teardown.

- :data:`STEP`, ``WorkerWrapperBase.execute_model`` (vllm/v1/worker/worker_base.py): what every
  executor (multiprocessing, in-process, external launcher, Ray) calls by name on each worker
  process, once per scheduler step, whatever the worker class. Before the step runs, what our
  collectives recorded raises (:func:`pcie_allreduce.plugin_adapter.check_serving`): a collective
  in a replayed CUDA graph that timed out leaves NaN and an error record, and vLLM runs decode in
  full graphs, so no eager collective may ever come to raise it. The step then fails with
  CollectiveTimeout / CollectiveMismatch naming rank, peer and stage instead of sampling from NaN.
  A host read per workspace, no CUDA call.
- :data:`DESTROY`, ``CudaCommunicator.destroy``: vLLM drops its ``ca_comm`` there without closing
  it (its own class frees its buffers when collected); ours frees collectively, so it is closed
  first, while the group's CPU group still exists (``GroupCoordinator.destroy`` destroys it next).

Both are attached when the plugin first serves a group (in a worker, where both modules are
loaded already), once per process, and put back by :func:`detach`.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any, Callable, Iterable

from pcie_allreduce.plugin_adapter import CaCommAdapter, check_serving, close_before_teardown

logger = logging.getLogger("vllm_plugin")

STEP = "vllm.v1.worker.worker_base.WorkerWrapperBase.execute_model"
DESTROY = "vllm.distributed.device_communicators.cuda_communicator.CudaCommunicator.destroy"

# target -> (class, attribute name, the original function): what detach() puts back.
_ATTACHED: dict[str, tuple[type, str, Callable[..., Any]]] = {}


def attach(adapters: Iterable[CaCommAdapter]) -> None:
    """Wrap :data:`STEP` and :data:`DESTROY` (once per process); ``adapters``: the live collection
    of adapters serving in this process, which the step checks. A target this vLLM lacks is
    logged with what is lost; serving goes on."""
    for target, make in ((STEP, _step_wrapper), (DESTROY, _destroy_wrapper)):
        if target in _ATTACHED:
            continue
        module, owner_name, attr = target.rsplit(".", 2)
        try:
            owner = getattr(importlib.import_module(module), owner_name)
            original = owner.__dict__[attr]
        except (ImportError, AttributeError, KeyError) as exc:
            lost = ("a failed collective inside a CUDA graph surfaces at the next eager collective, not at the "
                    "next step" if target == STEP else "teardown leaves the workspaces allocated")
            logger.warning("pcie_allreduce[vllm]: %s is not wrapped (%s: %s): %s", target, type(exc).__name__, exc,
                           lost)
            continue
        setattr(owner, attr, make(original, adapters))
        _ATTACHED[target] = (owner, attr, original)


def detach() -> None:
    """Put back what :func:`attach` wrapped."""
    while _ATTACHED:
        _, (owner, attr, original) = _ATTACHED.popitem()
        setattr(owner, attr, original)


def attached() -> tuple[str, ...]:
    """The targets wrapped now."""
    return tuple(_ATTACHED)


def _step_wrapper(original: Callable[..., Any], adapters: Iterable[CaCommAdapter]) -> Callable[..., Any]:
    @functools.wraps(original)
    def execute_model(self: Any, scheduler_output: Any) -> Any:
        check_serving(adapters)
        return original(self, scheduler_output)

    return execute_model


def _destroy_wrapper(original: Callable[..., Any], adapters: Iterable[CaCommAdapter]) -> Callable[..., Any]:
    @functools.wraps(original)
    def destroy(self: Any) -> None:
        close_before_teardown(getattr(self, "ca_comm", None), logger, "pcie_allreduce[vllm]")
        return original(self)

    return destroy
