"""The one INFO line each rank of an engine plugin logs when its tp group is set up: which backend
serves which sizes, and why. Grep a server's log for ``pcie_allreduce[sglang]`` or
``pcie_allreduce[vllm]`` to see whether the plugin took effect. Both plugins write it here, so the
two lines say the same things the same way; each passes its engine's names and notes."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pcie_allreduce.settings import format_bytes

# Streams a serving rank typically gives a workspace: the default stream, the graph-capture
# stream, and the forward stream of eager steps.
TYPICAL_STREAMS = 3


def where(engine: str, group: Any, device: Any, name: str = "") -> str:
    """``pcie_allreduce[vllm] rank 3/8 group tp cuda:3``: the line's start."""
    place = f" group {name}" if name else ""
    return f"pcie_allreduce[{engine}] rank {dist.get_rank(group)}/{dist.get_world_size(group)}{place} {device}"


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


def workspace_memory(max_bytes: int, world: int, transport: str | None, engine_name: str,
                     max_bytes_variable: str) -> str:
    """What the communicator allocates outside the engine's memory accounting, per stream and in
    all (GPU memory on p2p; pinned host memory in /dev/shm on the host transport)."""
    from pcie_allreduce.layout import Layout

    per_stream = Layout.make(max_bytes, world, transport or "p2p").total_bytes
    memory = "pinned host memory" if transport == "host" else "GPU memory"
    return (f"workspaces {per_stream / 2**20:.0f} MiB of {memory} per stream, about "
            f"{TYPICAL_STREAMS * per_stream / 2**20:.0f} MiB for the {TYPICAL_STREAMS} streams a server uses "
            f"(outside {engine_name}'s accounting; {max_bytes_variable} scales it)")


def serving(start: str, adapter: Any, reason: str, *, engine_name: str, max_bytes_variable: str,
            fused: str, others: str = "") -> str:
    """The line of a rank whose group the plugin serves: the sizes it takes (the adapter's
    ``largest_served``, what ``should_custom_ar`` accepts), the algorithms, the wire, the
    transport, what stays the engine's, the fused path (``fused``), the memory, and why."""
    algos = (f"{adapter.algo} forced" if adapter.algo != "auto"
             else f"auto: {algorithm_ranges(adapter.comm, adapter.max_bytes)} for bf16")
    if adapter.wire is not None:
        algos += (f"; {adapter.wire} wire from {format_bytes(adapter.wire_min_bytes)} (lossy, bitwise equal on "
                  "every rank)")
    transport = adapter.comm.transport
    over = f" over {transport} ({adapter.comm.transport_reason})"
    return (f"{start}: all-reduce of contiguous bf16/fp16/fp32 tensors of 1B..{format_bytes(adapter.largest_served)} "
            f"-> pcie_allreduce{over} ({algos}); larger or other -> {engine_name}'s other backends{others}; {fused}; "
            f"{workspace_memory(adapter.max_bytes, adapter.world_size, transport, engine_name, max_bytes_variable)}; "
            f"why: {reason}")


def declined(start: str, engine_name: str, reason: str) -> str:
    """The line of a rank whose group the plugin leaves to the engine."""
    return f"{start}: not serving, {engine_name}'s own backends serve every size; why: {reason}"
