"""What one call launches, as pure functions of the call's shape and of agreed values.

Every rank must launch the same kernel with the same launch shape for the same call (the
kernels' flags are per block), so each choice here depends only on the call's shape and on
values every rank agreed on when the communicator was created: the algorithm table
(:mod:`pcie_allreduce.plan.tables`), the low-latency capacity of the workspace and the block cap;
the algorithms' facts are their records (:mod:`pcie_allreduce.plan.algorithms`) and the fused
kernels' launch shapes are pure arithmetic (:mod:`pcie_allreduce.plan.fused_shapes`). The
communicator (plain calls) and the fused path (:mod:`pcie_allreduce.fused.path`) cache the
results per call shape; these functions hold the policy. Nothing here imports a kernel module
or Triton.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, NamedTuple

import torch

from pcie_allreduce import constants
from pcie_allreduce.constants import MAX_LAUNCH_BLOCKS
from pcie_allreduce.plan import fused_shapes
from pcie_allreduce.plan.algorithms import (ALGO_IDS, DATA_AS_FLAG_ONESHOTS, LOSSY_ALGORITHMS,
                                            SYMMETRIC_INPUT_ALGORITHMS, UNFUSED, call_problem)
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
    the launch shape of its own rule (whether it can take the call at all is
    :func:`~pcie_allreduce.plan.algorithms.call_problem`'s question); raises ValueError when it is
    an in-place one and the input is elsewhere. The blocks are capped at ``block_cap`` either way."""
    dtype_name = dtype if isinstance(dtype, str) else DTYPE_NAMES.get(dtype, str(dtype))
    if algo == "auto":
        choice = table.select(nbytes, world, dtype_name, ll_capacity, symmetric=symmetric)
    else:
        if algo in SYMMETRIC_INPUT_ALGORITHMS and not symmetric:
            raise ValueError(f"algo={algo!r} reads every rank's input in place: x must start at the tensor "
                             "Communicator.symmetric_input() returned for the current stream, on every rank; "
                             "use 'auto' for other inputs")
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


class FusedPlan(NamedTuple):
    """What one ``all_reduce_rmsnorm`` call shape runs, computed once (:func:`fused_plan`) and
    cached by the fused path: ``algo``, a fused kernel or UNFUSED, with its launch ``shape``
    (:mod:`pcie_allreduce.plan.fused_shapes`; for UNFUSED the add + RMSNorm kernel's) and call
    ``signature``; for UNFUSED also the plain all-reduce's ``plain_id`` and ``blocks``; and
    ``call``, what the ranks' first-call compile meeting compares."""

    algo: str
    shape: tuple[int, ...]
    signature: int
    plain_id: int
    blocks: int
    call: tuple[Any, ...]


def fused_plan(tokens: int, hidden: int, dtype: torch.dtype, world: int, table: AlgoTable, *,
               ll_capacity: int | None, block_cap: int = MAX_LAUNCH_BLOCKS, interpret: bool = False,
               algo: str = "auto", weight_dtype: torch.dtype | None = None, wire_algo: str | None = None,
               transport: str = "p2p", island_ranks: int = 0, slot_bytes: int | None = None) -> FusedPlan:
    """The plan of a validated ``all_reduce_rmsnorm`` call of ``[tokens, hidden]`` of ``dtype``.

    ``algo="auto"``: the table's fused rules (``AlgoTable.fused``) say whether a fused kernel
    beats the plain all-reduce followed by the one add + RMSNorm kernel (UNFUSED) at this token
    count and W; "kernel" is the fused kernel that follows the plain choice for the same message
    size (the token-split two-shot where that picks two-shot and there is a token per rank; the
    same data-as-flag one-shot where it picks one and that kernel has a launch shape within
    ``block_cap``, and where it has none the call passes to the table's next rule; else the
    flag-based one-shot); a named kernel that cannot take the shape runs unfused. A forced kernel
    that cannot take the shape raises ValueError. ``wire_algo`` (a compressed wire's kernel,
    checked against the ``transport``, ``island_ranks`` and the slot) runs the pair with that
    all-reduce.
    ``interpret``: under Triton's CPU interpreter (one chunk per row). Never raises for a valid
    "auto" call: every shape has the unfused pair."""
    nbytes = tokens * hidden * dtype.itemsize
    plain = plain_choice(nbytes, world, dtype, table, ll_capacity=ll_capacity, block_cap=block_cap,
                         algo=wire_algo or "auto")
    problem = None if wire_algo is None or slot_bytes is None else call_problem(
        wire_algo, nbytes, dtype.itemsize, transport, island_ranks, slot_bytes, ll_capacity)
    if problem is not None:
        raise ValueError(problem)

    def shape_of(kernel: str) -> fused_shapes.DataAsFlagShape | None:  # each data-as-flag kernel's own shape
        return fused_shapes.data_as_flag_for_call(kernel, tokens, hidden, dtype.itemsize, world, ll_capacity, block_cap,
                                                  interpret)

    following = _kernel_that_follows(plain.algo, tokens, world, shape_of)
    # A "kernel" rule whose data-as-flag kernel has no launch shape passes the call to the next rule.
    rule = (table.select_fused(tokens, world, lambda choice: choice != "kernel" or following is not None,
                               hidden=hidden) if algo == "auto" else algo)
    if wire_algo is not None:
        rule = UNFUSED
    elif rule == "kernel":
        rule = following or "oneshot"  # named: the flag-based one-shot takes what the other cannot
    unshaped = rule in DATA_AS_FLAG_ONESHOTS and shape_of(rule) is None
    if unshaped and algo == "auto":
        rule = UNFUSED
    call = (rule, (tokens, hidden), dtype, dtype if weight_dtype is None else weight_dtype)
    if rule == UNFUSED:
        return FusedPlan(rule, fused_shapes.add_rmsnorm(hidden), 0, ALGO_IDS[plain.algo], plain.blocks, call)
    launch = None if unshaped else fused_shapes.of_kernel(rule, dtype, tokens, hidden, world, block_cap, interpret)
    if launch is None:
        raise ValueError(fused_shapes.no_shape(rule, tokens, hidden, dtype, world, ll_capacity, block_cap))
    return FusedPlan(rule, launch[0], launch[1], 0, 0, call)


def fused_kernel_fits(algo: str, tokens: int, hidden: int, dtype: torch.dtype, world: int, *,
                      ll_capacity: int | None, block_cap: int = MAX_LAUNCH_BLOCKS, interpret: bool = False) -> bool:
    """Whether the fused kernel ``algo`` has a launch shape for the call (the data-as-flag ones:
    an even hidden size, a message within the workspace's low-latency capacity and few enough
    programs; the flag-based ones take every call)."""
    return algo not in DATA_AS_FLAG_ONESHOTS or fused_shapes.data_as_flag_for_call(
        algo, tokens, hidden, dtype.itemsize, world, ll_capacity, block_cap, interpret) is not None


def _kernel_that_follows(plain_algo: str, tokens: int, world: int,
                         shape_of: Callable[[str], fused_shapes.DataAsFlagShape | None]) -> str | None:
    """The fused kernel a "kernel" rule takes: the token-split two-shot where the plain choice is the
    two-shot and every rank has a token, the plain choice's own data-as-flag one-shot where that has
    a launch shape (``shape_of``; None where it has none), else the flag-based one-shot."""
    if plain_algo == "twoshot" and tokens >= world:
        return "twoshot"
    if plain_algo in DATA_AS_FLAG_ONESHOTS:
        return plain_algo if shape_of(plain_algo) is not None else None
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
