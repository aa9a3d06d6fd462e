"""The workspace memory layout, as the Triton kernels see it.

Mirrors ``Layout::make`` in csrc/protocol.cuh (a CPU test checks the two agree when the
extension is built). A :class:`WorkspaceView` is everything a fused kernel needs to follow the
CUDA kernels' protocol on the same memory: every rank's base address as mapped here, the
offsets, and the host-mapped error record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_RANKS = 8
MAX_FLAG_BLOCKS = 128
FLAG_KINDS = 2
ALIGN = 256
CONTROL_WORDS = 4  # epoch, blocks_done, abort, error_claim (uint32 each)
ERROR_WORDS = 8    # kind, rank, peer, stage, block, epoch, expected_signature, observed_signature


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True)
class Layout:
    """Byte offsets inside one rank's workspace allocation."""

    slot_bytes: int
    parity_bytes: int
    flags_offset: int
    control_offset: int
    total_bytes: int

    @classmethod
    def make(cls, max_bytes: int, world: int) -> "Layout":
        slot = _round_up(max(max_bytes, 1), ALIGN)
        parity = slot * world
        flags = 2 * parity
        control = flags + _round_up(8 * FLAG_KINDS * MAX_RANKS * MAX_FLAG_BLOCKS, ALIGN)
        return cls(slot, parity, flags, control, control + _round_up(4 * CONTROL_WORDS, ALIGN))


@dataclass(frozen=True)
class WorkspaceView:
    """Addresses of one stream's workspace on every rank, as mapped in this process."""

    rank: int
    world: int
    bases: tuple[int, ...]  # len == world
    layout: Layout
    error_ptr: int          # device address of the int32[8] error record (host-mapped)
    timeout_ns: int

    @classmethod
    def of(cls, workspace: Any) -> "WorkspaceView":
        """View of a ``pcie_allreduce._C.Workspace``."""
        layout = Layout(workspace.slot_bytes, workspace.parity_bytes, workspace.flags_offset,
                        workspace.control_offset, workspace.total_bytes)
        return cls(workspace.rank, workspace.world, tuple(workspace.bases()), layout,
                   workspace.error_record_ptr, int(workspace.timeout * 1e9))

    def padded_bases(self) -> tuple[int, ...]:
        """The bases padded to MAX_RANKS (unused entries 0), as the kernels take them."""
        return self.bases + (0,) * (MAX_RANKS - len(self.bases))
