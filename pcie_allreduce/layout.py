"""The workspace memory layout, as the Triton kernels see it.

Mirrors ``Layout::make`` in csrc/protocol.cuh (a CPU test checks the two agree when the
extension is built). A :class:`WorkspaceView` is everything a fused kernel needs to follow the
CUDA kernels' protocol on the same memory: every rank's base address as mapped here, the
offsets, and the host-mapped error record.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

MAX_RANKS = 8
MAX_FLAG_BLOCKS = 128
FLAG_KINDS = 2
ALIGN = 256
LOW_LATENCY_MAX_BYTES = 512 * 1024  # kLowLatencyMaxBytes: payload cap of the line slots
ROW_STATS_SLOTS = 1024  # kRowStatsSlots: uint64 words for the fused one-shot's per-row statistics
# Control words (uint32): one epoch copy per flag block, then abort, then error_claim.
EPOCH_WORDS = MAX_FLAG_BLOCKS
ABORT_WORD = MAX_FLAG_BLOCKS
CLAIM_WORD = MAX_FLAG_BLOCKS + 1
CONTROL_WORDS = MAX_FLAG_BLOCKS + 2
ERROR_WORDS = 8    # kind, rank, peer, stage, block, epoch, expected_signature, observed_signature


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True)
class Layout:
    """Byte offsets inside one rank's workspace allocation:
    [2 parities x W data slots][2 parities x W line slots][flags][control][row stats]."""

    slot_bytes: int
    parity_bytes: int
    ll_capacity: int
    ll_slot_bytes: int
    ll_offset: int
    flags_offset: int
    control_offset: int
    stats_offset: int
    total_bytes: int

    @classmethod
    def make(cls, max_bytes: int, world: int) -> "Layout":
        slot = _round_up(max(max_bytes, 1), ALIGN)
        parity = slot * world
        ll_capacity = min(slot, LOW_LATENCY_MAX_BYTES)
        ll_offset = 2 * parity
        flags = ll_offset + 2 * 2 * ll_capacity * world
        control = flags + _round_up(8 * FLAG_KINDS * MAX_RANKS * MAX_FLAG_BLOCKS, ALIGN)
        stats = control + _round_up(4 * CONTROL_WORDS, ALIGN)
        return cls(slot, parity, ll_capacity, 2 * ll_capacity, ll_offset, flags, control, stats,
                   stats + _round_up(8 * ROW_STATS_SLOTS, ALIGN))

    @classmethod
    def of_workspace(cls, workspace: Any) -> "Layout":
        """The layout a ``pcie_allreduce._C.Workspace`` reports (computed in C++)."""
        return cls(*(getattr(workspace, f.name) for f in fields(cls)))


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
        return cls(workspace.rank, workspace.world, tuple(workspace.bases()), Layout.of_workspace(workspace),
                   workspace.error_record_ptr, int(workspace.timeout * 1e9))

    def padded_bases(self) -> tuple[int, ...]:
        """The bases padded to MAX_RANKS (unused entries 0), as the kernels take them."""
        return self.bases + (0,) * (MAX_RANKS - len(self.bases))
