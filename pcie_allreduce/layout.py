"""The workspace memory layout, as the Triton kernels see it.

Mirrors ``Layout::make`` in csrc/protocol_constants.h (tests/test_constants.py checks the two agree,
through ``_C.layout``, when the extension is built). A :class:`WorkspaceView` is everything a fused
kernel needs to follow the CUDA kernels' protocol on the same memory: every rank's base address as
mapped here (also as an int64 array the kernels read), the offsets, and the host-mapped error record.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from pcie_allreduce.constants import (ALIGN, CONTROL_WORDS, FLAG_ROWS, LINE_BYTES, LINE_PAYLOAD_BYTES,
                                      LOW_LATENCY_MAX_BYTES, MAX_FLAG_BLOCKS, MAX_RANKS, ROW_STATS_SLOTS,
                                      FULL_HEADER_BYTES, SHARED_AREAS, SHARED_BUFFERS, SHARED_HEADER_BYTES)
# The word indices of the control and error records, next to the offsets they index from (the
# interpreter tests' fake workspace reads them here); defined in pcie_allreduce.constants.
from pcie_allreduce.constants import ABORT_WORD, CLAIM_WORD, EPOCH_COPIES, ERROR_WORDS  # noqa: F401

_U64, _U32 = 8, 4  # bytes of the flag / statistics words and of the control words


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True)
class Layout:
    """Byte offsets inside one rank's workspace allocation:
    [2 parities x W data slots][2 parities x W line slots][flags][control][row stats], then on the
    host transport the host one-shot's headers and buffers, then the full-payload slots, then on
    p2p the symmetric input area (one slot that twoshot_symm reads in place on every rank)."""

    slot_bytes: int
    parity_bytes: int
    ll_capacity: int
    ll_slot_bytes: int
    ll_offset: int
    flags_offset: int
    control_offset: int
    stats_offset: int
    shared_offset: int
    shared_bytes: int
    full_offset: int
    full_bytes: int
    input_offset: int
    input_bytes: int
    total_bytes: int

    @classmethod
    def make(cls, max_bytes: int, world: int, transport: str = "p2p") -> "Layout":
        slot = _round_up(max(max_bytes, 1), ALIGN)
        parity = slot * world
        ll_capacity = min(slot, LOW_LATENCY_MAX_BYTES)
        ll_slot = ll_capacity // LINE_PAYLOAD_BYTES * LINE_BYTES
        ll_offset = 2 * parity
        flags = ll_offset + 2 * ll_slot * world
        control = flags + _round_up(_U64 * FLAG_ROWS * MAX_RANKS * MAX_FLAG_BLOCKS, ALIGN)
        stats = control + _round_up(_U32 * CONTROL_WORDS, ALIGN)
        shared = stats + _round_up(_U64 * ROW_STATS_SLOTS, ALIGN)
        shared_bytes = SHARED_HEADER_BYTES + SHARED_BUFFERS * SHARED_AREAS * slot if transport == "host" else 0
        full = shared + shared_bytes
        full_bytes = FULL_HEADER_BYTES + 2 * world * ll_capacity
        input_offset = _round_up(full + full_bytes, ALIGN)
        input_bytes = slot if transport == "p2p" else 0
        return cls(slot, parity, ll_capacity, ll_slot, ll_offset, flags, control, stats, shared, shared_bytes,
                   full, full_bytes, input_offset, input_bytes, input_offset + input_bytes)

    @classmethod
    def of_workspace(cls, workspace: Any) -> "Layout":
        """The layout a ``pcie_allreduce._C.Workspace`` reports (computed in C++)."""
        return cls(*(getattr(workspace, f.name) for f in fields(cls)))


@dataclass(frozen=True)
class WorkspaceView:
    """Addresses of one stream's workspace on every rank, as mapped in this process.

    ``bases_ptr``: address of ``bases`` as int64 where the fused kernels read them (one argument
    whatever the world size). A workspace keeps that table in its own device memory, written when
    it opened its peers (``_C.Workspace.peers_table_ptr``), so a view costs no copy and may be made
    anywhere, inside a CUDA graph capture too; left out (0), it is made here in host memory, for
    Triton's CPU interpreter."""

    rank: int
    world: int
    bases: tuple[int, ...]  # len == world
    layout: Layout
    error_ptr: int          # device address of the int32[8] error record (host-mapped)
    timeout_ns: int
    # Address the control and statistics offsets apply to; None: this rank's base (p2p). The
    # host transport keeps those local-only words in device memory, away from its host segment.
    local_base: int | None = None
    bases_ptr: int = 0
    _host_bases: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.bases) != self.world or self.world > MAX_RANKS:
            raise ValueError(f"a workspace view needs one base per rank, at most {MAX_RANKS}: got {len(self.bases)} "
                             f"for world size {self.world}")
        if not self.bases_ptr:
            table = torch.tensor(self.bases, dtype=torch.int64)
            object.__setattr__(self, "_host_bases", table)
            object.__setattr__(self, "bases_ptr", table.data_ptr())

    @classmethod
    def of(cls, workspace: Any) -> "WorkspaceView":
        """View of a ``pcie_allreduce._C.Workspace`` whose peers are open. A closed one has no
        table (address 0), which a view would otherwise take for "make one in host memory"."""
        table = workspace.peers_table_ptr
        if not table:
            raise RuntimeError(f"pcie_allreduce: rank {workspace.rank}'s workspace is closed: the fused kernels "
                               "have no table of the peers' bases to read")
        return cls(workspace.rank, workspace.world, tuple(workspace.bases()), Layout.of_workspace(workspace),
                   workspace.error_record_ptr, int(workspace.timeout * 1e9), workspace.local_base, table)

    def local_offset(self, offset: int) -> int:
        """``offset`` of a local-only word (control, statistics) as an offset from this rank's base,
        the form the Triton kernels take (negative when the local words lie below it)."""
        base = self.bases[self.rank]
        return (base if self.local_base is None else self.local_base) + offset - base
