"""The one INFO line each rank logs when its tp group is set up: which backend serves which
sizes, and why. Grep the server log for ``pcie_allreduce[sglang]`` to see whether it took effect."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from sglang_plugin.eligibility import Decision
from sglang_plugin.settings import Settings, format_bytes

TAG = "pcie_allreduce[sglang]"


def _where(group: Any, device: Any, name: str) -> str:
    return f"{TAG} rank {dist.get_rank(group)}/{dist.get_world_size(group)} group {name or '?'} {device}"


def algorithm_ranges(comm: Any, max_bytes: int, dtype: torch.dtype = torch.bfloat16) -> str:
    """``oneshot<=256KiB, twoshot<=8MiB``: what ``algo="auto"`` picks, probed at powers of two."""
    sizes = []
    size = 1024
    while size < max_bytes:
        sizes.append(size)
        size *= 2
    sizes.append(max_bytes)
    ranges: list[tuple[str, int]] = []
    for nbytes in sizes:
        algo = comm.select_algo(nbytes, dtype)
        if ranges and ranges[-1][0] == algo:
            ranges[-1] = (algo, nbytes)
        else:
            ranges.append((algo, nbytes))
    return ", ".join(f"{algo}<={format_bytes(limit)}" for algo, limit in ranges)


def serving(adapter: Any, name: str, decision: Decision, settings: Settings) -> str:
    """The line for a rank whose group the plugin serves."""
    algos = (f"{settings.algo} forced" if settings.algo != "auto"
             else f"auto: {algorithm_ranges(adapter.comm, adapter.max_size)} for bf16")
    fused = ("fused all-reduce+residual+RMSNorm -> pcie_allreduce where SGLang's FlashInfer fusion is off "
             "(it runs only on SM90/SM100)" if settings.fused else "fused path off (PCIE_AR_SGLANG_FUSED=0)")
    wire = getattr(adapter, "wire", None)
    if wire is not None:
        algos += f"; {wire} wire from {format_bytes(adapter.wire_min_bytes)} (lossy, bitwise equal on every rank)"
    transport = getattr(adapter.comm, "transport", None)
    over = f" over {transport} ({adapter.comm.transport_reason})" if transport else ""
    return (f"{_where(adapter.group, adapter.device, name)}: all-reduce of contiguous bf16/fp16/fp32 tensors "
            f"of 1B..{format_bytes(adapter.max_size)} -> pcie_allreduce{over} ({algos}); larger or other -> "
            f"SGLang's other backends; {fused}; {workspace_memory(adapter.max_size, adapter.world_size, transport)}; "
            f"why: {decision.reason}")


# Streams a serving rank typically gives a workspace: the default stream, the graph-capture
# stream, and the forward stream of eager steps.
TYPICAL_STREAMS = 3


def workspace_memory(max_bytes: int, world: int, transport: str | None = "p2p") -> str:
    """What the communicator allocates outside SGLang's memory accounting, per stream and in all
    (GPU memory on p2p; pinned host memory in /dev/shm on the host transport)."""
    from pcie_allreduce.layout import Layout

    per_stream = Layout.make(max_bytes, world, transport or "p2p").total_bytes
    where = "pinned host memory" if transport == "host" else "GPU memory"
    return (f"workspaces {per_stream / 2**20:.0f} MiB of {where} per stream, about "
            f"{TYPICAL_STREAMS * per_stream / 2**20:.0f} MiB for the {TYPICAL_STREAMS} streams a server uses "
            f"(outside SGLang's accounting; PCIE_AR_SGLANG_MAX_BYTES scales it)")


def declined(group: Any, device: Any, name: str, decision: Decision) -> str:
    """The line for a rank whose group the plugin leaves to SGLang."""
    return (f"{_where(group, device, name)}: not serving, SGLang's own backends serve every size; "
            f"why: {decision.reason}")
