"""What one call launches, as pure functions of the call's shape and of agreed values.

Every rank must launch the same kernel with the same launch shape for the same call (the
kernels' flags are per block), so each choice here depends only on the call's shape and on
values every rank agreed on when the communicator was created: the algorithm table
(:mod:`pcie_allreduce.plan.tables`), the low-latency capacity of the workspace and the block cap;
the algorithms' facts are their records (:mod:`pcie_allreduce.plan.algorithms`) and the fused
kernels' launch shapes are pure arithmetic (:mod:`pcie_allreduce.fused.shapes`). The
communicator caches the results per call shape; these functions hold the policy. Nothing here
imports a kernel module or Triton.
"""

from __future__ import annotations

import os
from typing import Mapping

import torch

from pcie_allreduce import constants
from pcie_allreduce.constants import MAX_LAUNCH_BLOCKS
from pcie_allreduce.fused import shapes
from pcie_allreduce.plan.algorithms import (ALGO_IDS, DATA_AS_FLAG_ONESHOTS, FUSED_MAX_WORLD, LOSSY_ALGORITHMS,
                                            SYMMETRIC_INPUT_ALGORITHMS, UNFUSED, capacity_of, fits_capacity)
from pcie_allreduce.plan.rules import Choice
from pcie_allreduce.plan.tables import AlgoTable

# The compressed wires' launch shape (no table names them): a block per 16 KiB of message, up to
# the cap, so that many warps have their reads in flight at once (fp8_twoshot.cuh).
LOSSY_BYTES_PER_BLOCK = 16 << 10
#: torch dtype -> the kernels' dtype id (``constants.DTYPE_IDS`` is keyed by name).
DTYPE_IDS: dict[torch.dtype, int] = {getattr(torch, name): i for name, i in constants.DTYPE_IDS.items()}
#: torch dtype -> the name algorithm tables use for it.
DTYPE_NAMES: dict[torch.dtype, str] = {getattr(torch, name): name for name in constants.DTYPE_IDS}


def plain_choice(nbytes: int, world: int, dtype: torch.dtype | str, table: AlgoTable, *, ll_capacity: int | None,
                 block_cap: int = MAX_LAUNCH_BLOCKS, algo: str = "auto", symmetric: bool = False) -> Choice:
    """The algorithm and block count of a plain all-reduce of ``nbytes`` bytes of ``dtype``.

    ``algo="auto"``: the table's first matching rule (``oneshot_ll`` rules only for messages
    within ``ll_capacity``; the in-place rules, ``SYMMETRIC_INPUT_ALGORITHMS``, only where
    ``symmetric``: the input is the symmetric input area on every rank). A forced ``algo`` takes
    the launch shape of its own rule; raises ValueError when it is ``oneshot_ll`` and the message
    exceeds ``ll_capacity``, or an in-place one and the input is elsewhere. The blocks are capped
    at ``block_cap`` either way."""
    dtype_name = dtype if isinstance(dtype, str) else DTYPE_NAMES.get(dtype, str(dtype))
    if algo == "auto":
        choice = table.select(nbytes, world, dtype_name, ll_capacity, symmetric=symmetric)
    else:
        if algo in SYMMETRIC_INPUT_ALGORITHMS and not symmetric:
            raise ValueError(f"algo={algo!r} reads every rank's input in place: x must start at the tensor "
                             "Communicator.symmetric_input() returned for the current stream, on every rank; "
                             "use 'auto' for other inputs")
        if not fits_capacity(algo, nbytes, ll_capacity):
            raise ValueError(f"algo={algo!r} takes messages up to {capacity_of(algo, ll_capacity)} bytes (the "
                             f"low-latency capacity of this communicator), got {nbytes}; use 'auto' or another "
                             "algorithm")
        blocks = (min(MAX_LAUNCH_BLOCKS, max(1, -(-nbytes // LOSSY_BYTES_PER_BLOCK))) if algo in LOSSY_ALGORITHMS
                  else table.blocks_for(algo, nbytes, world, dtype_name))
        choice = Choice(algo, blocks)
    return choice if choice.blocks <= block_cap else Choice(choice.algo, block_cap)


def plain_launch(nbytes: int, world: int, dtype: torch.dtype, table: AlgoTable, *, ll_capacity: int | None,
                 block_cap: int = MAX_LAUNCH_BLOCKS, algo: str = "auto", symmetric: bool = False) -> tuple[int, int]:
    """:func:`plain_choice` as the binding takes it: (algorithm id, blocks)."""
    choice = plain_choice(nbytes, world, dtype, table, ll_capacity=ll_capacity, block_cap=block_cap, algo=algo,
                          symmetric=symmetric)
    return ALGO_IDS[choice.algo], choice.blocks


def fused_algo(tokens: int, hidden: int, dtype: torch.dtype, world: int, table: AlgoTable, *,
               ll_capacity: int | None, block_cap: int = MAX_LAUNCH_BLOCKS, interpret: bool = False) -> str:
    """What ``all_reduce_rmsnorm(algo="auto")`` runs for ``[tokens, hidden]`` of ``dtype``: the
    table's fused rules (``AlgoTable.fused``) say whether a fused kernel beats the plain all-reduce
    followed by the one add + RMSNorm kernel (``"unfused"``) at this token count and W; "kernel"
    means :func:`fused_kernel`'s choice, and a named kernel that cannot take the shape runs
    unfused, as does every call above ``FUSED_MAX_WORLD`` ranks (the fused kernels' limit).
    Never raises for a valid call: every shape has the unfused pair."""
    if world > FUSED_MAX_WORLD:
        return UNFUSED
    choice = table.select_fused(tokens, world)
    if choice == UNFUSED:
        return UNFUSED
    if choice == "kernel":
        return fused_kernel(tokens, hidden, dtype, world, table, ll_capacity=ll_capacity, block_cap=block_cap,
                            interpret=interpret)
    return choice if fused_kernel_fits(choice, tokens, hidden, dtype, world, ll_capacity=ll_capacity,
                                       block_cap=block_cap, interpret=interpret) else UNFUSED


def fused_kernel_fits(algo: str, tokens: int, hidden: int, dtype: torch.dtype, world: int, *,
                      ll_capacity: int | None, block_cap: int = MAX_LAUNCH_BLOCKS, interpret: bool = False) -> bool:
    """Whether the fused kernel ``algo`` has a launch shape for the call (the data-as-flag ones:
    an even hidden size, a message within the workspace's low-latency capacity and few enough
    programs; the flag-based ones take every call)."""
    if algo not in DATA_AS_FLAG_ONESHOTS:
        return True
    if not fits_capacity(algo, tokens * hidden * dtype.itemsize, ll_capacity):
        return False
    return shapes.data_as_flag(tokens, hidden, world, block_cap, interpret) is not None


def fused_kernel(tokens: int, hidden: int, dtype: torch.dtype, world: int, table: AlgoTable, *,
                 ll_capacity: int | None, block_cap: int = MAX_LAUNCH_BLOCKS, interpret: bool = False) -> str:
    """The fused all-reduce + residual + RMSNorm kernel for ``[tokens, hidden]`` of ``dtype``,
    following the plain choice for the same message size: the token-split two-shot where that
    picks two-shot and there is at least one token per rank; the same data-as-flag one-shot
    (``oneshot_ll`` or ``oneshot_full``, one launch shape for both) where it picks one and that
    kernel has a launch shape for the call within ``block_cap`` (``interpret``: under Triton's
    CPU interpreter, which runs one chunk per row); else the flag-based one-shot. The launch
    shapes: :mod:`pcie_allreduce.fused.shapes`."""
    nbytes = tokens * hidden * dtype.itemsize
    plain = plain_choice(nbytes, world, dtype, table, ll_capacity=ll_capacity, block_cap=block_cap).algo
    if plain == "twoshot" and tokens >= world:
        return "twoshot"
    if plain in DATA_AS_FLAG_ONESHOTS and fused_kernel_fits(plain, tokens, hidden, dtype, world,
                                                            ll_capacity=ll_capacity, block_cap=block_cap,
                                                            interpret=interpret):
        return plain
    return "oneshot"


#: MPS's client variable that caps a process to a share of its GPU's SMs (the rank spawner sets it).
MPS_SHARE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def runs_in_mps_share(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs capped to an MPS share of its GPU (``$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
    set): the SM count its device reports is then that share (:func:`block_cap`)."""
    return bool((os.environ if environ is None else environ).get(MPS_SHARE_ENV, "").strip())


def block_cap(ranks_per_gpu: int, sms_per_gpu: int, mps_share: bool = False) -> int:
    """Most blocks (CUDA) or programs (Triton) one call may launch.

    Every block spins on the same-numbered block of every peer, so all ranks' blocks of a call
    must be able to run at once. On distinct GPUs (``ranks_per_gpu`` 1) that always holds. When
    ranks share a GPU (tests under MPS) their blocks compete for its SMs: each rank gets
    ``sms_per_gpu // ranks_per_gpu``, since one block per SM always fits; where every rank runs
    capped to its MPS share (``mps_share``: :func:`runs_in_mps_share` on every rank; the rank
    spawner sets the variable), ``sms_per_gpu`` is already the share the device reports (the fewest of any
    rank's) and is the cap as it is. Computed from agreed values, so the same on every rank."""
    if ranks_per_gpu <= 1:
        return MAX_LAUNCH_BLOCKS
    return max(1, min(MAX_LAUNCH_BLOCKS, sms_per_gpu if mps_share else sms_per_gpu // ranks_per_gpu))
