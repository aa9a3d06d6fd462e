"""A workspace view over CPU buffers, for tests of launches that only compile (nothing reads or
writes the buffers; their addresses stand in for the ranks' workspaces)."""

from __future__ import annotations

import torch

from pcie_allreduce import layout as lay


def compile_only_view(world: int, max_bytes: int = 256 << 10) -> tuple[lay.WorkspaceView, list[torch.Tensor]]:
    """Rank 0's view of a ``world``-rank workspace sized for ``max_bytes``, and the tensors behind
    it (keep them alive while the view is used)."""
    layout = lay.Layout.make(max_bytes, world)
    buffers = [torch.zeros(layout.total_bytes, dtype=torch.uint8) for _ in range(world)]
    error = torch.zeros(lay.ERROR_WORDS, dtype=torch.int32)
    view = lay.WorkspaceView(0, world, tuple(b.data_ptr() for b in buffers), layout, error.data_ptr(), 10**9)
    return view, [*buffers, error]
