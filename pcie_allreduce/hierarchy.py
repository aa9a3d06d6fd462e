"""The all-reduce of a group that spans nodes: our kernels inside each node, torch.distributed between.

Nodes are runs of L consecutive ranks (:mod:`pcie_allreduce.fabric.nodes`). The flat result of every
algorithm is the fp32 sum in rank order, rounded once (protocol invariant 6). That sum splits at
node boundaries into one chain of fp32 partials, which is what this module runs:

1. Node 0 all-reduces its ranks' inputs, widened to fp32, with the library's kernels: every rank of
   node 0 then holds P0 = x0 + x1 + ... + x(L-1), summed in that order in fp32.
2. Each rank of node 0 sends its 1/L shard of P0 to node 1's first rank, which adds its own input
   to the whole (P0 + xL, the very next addition of the flat sum); node 1 all-reduces in fp32 with
   that as its first rank's input: ((P0 + xL) + x(L+1)) + ... = P1, the flat sum's next prefix.
   And so on down the nodes.
3. The last node rounds its partial once, to the input's dtype: the flat result, bit for bit. Each of
   its ranks sends its 1/L shard of it to the rank of the same local index in every other node,
   and those nodes gather the shards with one more all-reduce of their own, in which every rank
   but a shard's owner adds -0.0 there (x + -0.0 is x for every x, -0.0 and NaN included).

So the result is bitwise the single-node result on every rank, for every algorithm the nodes'
tables pick. The exceptions are those of the full-payload algorithms (docs/guide.md,
"Algorithms"): they send -0.0 as +0.0 and the fp32 pattern 0x80008000 as -0.0. Here partials cross a
node's all-reduce as fp32 data, so a partial of exactly that negative subnormal is the one value
that may reach the sum altered. Off the node each rank sends 1/L of the message per call (4 bytes
an element of the partial, or its dtype's of the result to each other node:
:func:`pcie_allreduce.fabric.nodes.off_node_bytes`). A node that is not the first receives the
whole partial at its first rank. The cost is one all-reduce
per node on fp32, plus one more on the result in every node but the last.

Between nodes: point-to-point sends on the caller's group (or ``inter_node_group``, or a group
made here of ``inter_node_backend``), NCCL where that group is NCCL (GPU tensors, capturable in a
CUDA graph), any other backend through host memory (eager only). A send or receive that fails or
outlasts ``inter_node_timeout_s`` raises :class:`InterNodeError` naming the step, the rank and the
peer: through host memory at once; on NCCL (where the host never waits) at the next call or
:meth:`HierarchicalCommunicator.check` after it failed, or after that time passed with it pending.
The communicator is unusable afterwards, like one whose kernel timed out.

Inside a CUDA graph no host code runs at replay, so this module cannot time a replayed send or
receive, and torch's NCCL watchdog does not track works captured in a graph. A replayed receive
whose peer never sends waits until the NCCL communicator of the group between nodes is aborted:
where the group was made here (``inter_node_backend="nccl"``) its timeout is
``inter_node_timeout_s``, so torch's watchdog aborts it (and then acts as
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` says; torch's default ends the process) once an eager send or
receive on it has been pending that long; else at the process's end
(:meth:`HierarchicalCommunicator.close` keeps a group whose sends a graph captured). The node's
own kernels around it stay bounded by their ``timeout_s``: the other ranks of that node record
CollectiveTimeout and write NaN.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from pcie_allreduce import _ext, inter_node, ops, outcomes, validation
from pcie_allreduce.fabric import nodes as nodes_mod
from pcie_allreduce.communicator import DEFAULT_MAX_BYTES, Communicator
from pcie_allreduce.constants import MAX_MESSAGE_BYTES
from pcie_allreduce.errors import one_line
from pcie_allreduce.plan.algorithms import UNFUSED, capacity_of

#: Seconds a send or receive between nodes may take before the call fails.
DEFAULT_INTER_NODE_TIMEOUT_S = 60.0
#: The largest message: the nodes all-reduce a 16-bit message's fp32 partials, twice its bytes,
#: and a node's communicator takes at most MAX_MESSAGE_BYTES.
MAX_BYTES = MAX_MESSAGE_BYTES // 2
# NCCL groups between nodes that served a CUDA graph capture: never shut down (the graph may be
# replayed after close(), and its kernels use the group's NCCL communicator).
_NEVER_SHUT_DOWN: list[Any] = []


class IntraNode(Protocol):
    """What the hierarchy needs of a node's own all-reduce: the fp32 sum in rank order."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...


class HierarchicalCommunicator:
    """All-reduce (and the all-reduce + residual add + RMSNorm) over ``group``, whose ranks span
    nodes: ``pcie_allreduce.Communicator`` inside each node, point-to-point sends on ``group``
    between nodes. Collective to create, like the Communicator.

    Args:
        group: the whole group (every rank of every node).
        device: this rank's CUDA device.
        layout: the group's nodes; default :func:`pcie_allreduce.fabric.nodes.gather_layout`. Every rank
            must give the same (or None): the ranks compare them first, and raise ValueError
            together where they differ.
        inter_node_group: the same ranks as ``group``, whose point-to-point sends carry the step
            between nodes (an NCCL group where ``group`` is gloo, as SGLang's device group beside
            its CPU group); default ``group``.
        inter_node_backend: instead of ``inter_node_group``, make that group here, of this backend
            ("nccl"; an NCCL group gets ``inter_node_timeout_s`` as its timeout: the module
            docstring says what that bounds in a CUDA graph); :meth:`close` shuts it down.
        inter_node_timeout_s: how long one send or receive between nodes may take.
        intra_node: makes this node's all-reduce from the node's process group (default: a
            ``Communicator`` on ``device`` with ``communicator_kwargs``); None for one-rank nodes.
        max_bytes: the largest message, at most :data:`MAX_BYTES` (the nodes' communicators are
            made for twice it).
        communicator_kwargs: passed to each node's ``Communicator`` (timeout_s, transport, ...).
    """

    #: The compressed wires it takes: none (the chain between nodes carries fp32 partials).
    wires: tuple[str, ...] = ()

    def __init__(self, group: dist.ProcessGroup, device: torch.device | int | str, *,
                 layout: nodes_mod.NodeLayout | None = None,
                 inter_node_group: dist.ProcessGroup | None = None,
                 inter_node_backend: str | None = None,
                 inter_node_timeout_s: float = DEFAULT_INTER_NODE_TIMEOUT_S,
                 intra_node: Callable[[dist.ProcessGroup], IntraNode] | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES, **communicator_kwargs: Any) -> None:
        creation = outcomes.next_step(group, "hierarchy")  # first: every rank counts it, whatever fails after
        self._closed = False
        self._owned_groups: list[dist.ProcessGroup] = []  # shut down by close()
        self.intra: IntraNode | None = None
        self.inter_node_timeout_s = validation.validate_timeout(inter_node_timeout_s, source="inter_node_timeout_s")
        if inter_node_group is not None and inter_node_backend is not None:
            raise ValueError("pass inter_node_group or inter_node_backend, not both")
        validation.validate_max_bytes(max_bytes)
        if max_bytes > MAX_BYTES:
            raise ValueError(f"max_bytes={max_bytes} is above {MAX_BYTES >> 20} MiB, the most a group across nodes "
                             "takes: its nodes all-reduce fp32 partials, twice a 16-bit message's bytes")
        #: Largest message; the nodes' communicators take twice it (a 16-bit message's fp32 partials).
        self.max_bytes: int = max_bytes
        self._group = group
        self.device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        self.rank: int = dist.get_rank(group)
        self.world_size: int = dist.get_world_size(group)
        self.layout = nodes_mod.agree_on_layout(group, layout)
        if self.layout.world != self.world_size:
            raise ValueError(f"the node layout covers {self.layout.world} ranks, the group has {self.world_size}")
        problem = self.layout.hierarchy_problem()
        if problem is not None:
            raise ValueError(f"the hierarchical all-reduce cannot serve this group: {problem}")
        self.node = self.layout.node_of(self.rank)
        self.local_rank = self.layout.local_rank(self.rank)
        self.node_size = len(self.layout.nodes[0])
        self._global = [dist.get_global_rank(group, r) for r in range(self.world_size)]
        if inter_node_backend is not None:
            inter_node_group = inter_node.make_group(self._global, inter_node_backend, self.inter_node_timeout_s)
            self._owned_groups.append(inter_node_group)
        between = group if inter_node_group is None else inter_node_group
        if dist.get_world_size(between) != self.world_size:
            raise ValueError(f"inter_node_group has {dist.get_world_size(between)} ranks, the group "
                             f"{self.world_size}: it must hold the same ranks")
        self._link = inter_node.InterNodeLink(between, self._global, self.rank, self.inter_node_timeout_s,
                                              str(dist.get_backend(between)))
        # Only this node's ranks make its group (local synchronization): the group may be a part of
        # the world (one tensor-parallel group of several), whose other ranks never come here.
        self.node_group = dist.new_group([self._global[r] for r in self.layout.nodes[self.node]],
                                         backend=dist.get_backend(group), use_local_synchronization=True)
        self._owned_groups.append(self.node_group)
        # All or nothing: each rank posts how its part went and hears every other rank's before any
        # returns (outcomes.agree), within a bound: each of its waits between nodes takes at most
        # inter_node_timeout_s, and a node's can follow the previous node's.
        bound, what = (self.layout.count + 1) * self.inter_node_timeout_s, "creating the hierarchical communicator"
        try:
            try:
                self._set_up_node(group, intra_node, communicator_kwargs)
            except Exception as exc:
                outcomes.agree(group, creation, f"{type(exc).__name__}: {one_line(exc)}", bound_s=bound, what=what)
                raise
            outcomes.agree(group, creation, None, bound_s=bound, what=what)
        except BaseException:
            with contextlib.suppress(Exception):  # the failure that got us here is the one to see
                self.close()
            raise
        self.handle: int = ops.HANDLES.register(self)  # for torch.ops.pcie_allreduce.* (torch.compile)

    def _set_up_node(self, group: dist.ProcessGroup, intra_node: Callable[[dist.ProcessGroup], IntraNode] | None,
                     communicator_kwargs: dict[str, Any]) -> None:
        """This rank's part of creation: the node's all-reduce, then one call, awaited (bounded)."""
        if intra_node is not None and self.node_size > 1:
            self.intra = intra_node(self.node_group)
        elif self.node_size > 1:
            # Emulated nodes share GPUs: every node's blocks must fit beside every other node's.
            communicator_kwargs.setdefault("ranks_per_gpu", nodes_mod.ranks_per_gpu(group, self.device))
            self.intra = Communicator(self.node_group, self.device, 2 * self.max_bytes, **communicator_kwargs)
        # One call now: every pair of ranks the sends join meets here, outside any graph capture
        # (NCCL makes a pair's communicator at its first send), and a broken setup fails at once.
        self.all_reduce(torch.zeros(self.node_size, dtype=torch.float32, device=self.device))
        # On NCCL the host posted its sends and receives without waiting: wait for them, bounded,
        # so a receive that never completes fails creation instead of a later call.
        self._link.drain()  # InterNodeError past inter_node_timeout_s
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the node's kernels: bounded by their timeout
        self.check()

    # ---- the collective ----------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None = None, algo: str = "auto", *,
                   wire: str | None = None) -> torch.Tensor:
        """The sum of ``x`` over every rank of every node, bitwise the single-node result on
        every rank (module docstring). ``out``: where to write it (default a new tensor);
        ``algo``: what the nodes' all-reduces run ("auto": their tables); ``wire``: None only."""
        self._refuse_if_unusable()
        _refuse_wire(wire)
        validation.plain_call(x, out, algo, device=self.device, max_bytes=self.max_bytes)
        in_graph = inter_node.capturing()
        if self._link.through_host and in_graph:
            raise RuntimeError(f"the inter-node step runs on a {self.backend!r} group through host memory, which a "
                               "CUDA graph cannot capture; use an NCCL group between nodes for graphs")
        limit = self.capacity_of(algo)
        if limit is not None and x.numel() * x.element_size() > limit:
            raise ValueError(f"algo={algo!r} takes at most {limit} bytes across nodes (its capacity on the nodes' "
                             f"fp32 partials), got {x.numel() * x.element_size()}")
        if not in_graph:
            self._link.check_pending()  # an earlier call's failed send or receive raises before this one posts
        flat = x.reshape(-1)
        if flat.numel() == 0:
            return x.clone() if out is None else out
        last, shards = self.layout.count - 1, nodes_mod.shard_bounds(flat.numel(), self.node_size)
        mine = slice(*shards[self.local_rank])
        if self.node > 0 and self.local_rank == 0:
            # The previous node's partial, a shard from each of its ranks, then our input onto it.
            partial = torch.empty(flat.shape, dtype=torch.float32, device=flat.device)
            self._link.receive_all([(partial[slice(*b)], self._peer(self.node - 1, i)) for i, b in enumerate(shards)],
                              f"the fp32 partial from node {self.node - 1}")
            partial.add_(flat)  # previous + x: the flat sum's next addition (x widened exactly)
        else:
            partial = flat.to(torch.float32)  # exact; x itself when it is fp32 (never written)
        node_sum = self._node_all_reduce(partial, algo)
        if self.node < last:
            self._link.send(node_sum[mine], self._peer(self.node + 1, 0), f"the fp32 partial to node {self.node + 1}")
            # Our shard of the result from the last node; the node's shards gathered by an
            # all-reduce in which every other rank adds -0.0 (x + -0.0 is x, for every x).
            padded = torch.full(flat.shape, -0.0, dtype=flat.dtype, device=flat.device)
            self._link.receive_all([(padded[mine], self._peer(last, self.local_rank))], f"the result from node {last}")
            result = self._node_all_reduce(padded, algo)
        else:
            result = node_sum.to(flat.dtype)  # rounded once, as the kernels round (to nearest even)
            for node in range(last):
                self._link.send(result[mine], self._peer(node, self.local_rank), f"the result to node {node}")
        result = result.view(x.shape)
        if out is None:
            return result
        out.copy_(result)
        return out

    def all_reduce_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                           out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                           algo: str = "auto", wire: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``new_residual = residual + all_reduce(x)``, ``normed = rmsnorm(new_residual) * weight``:
        the hierarchical all-reduce, then the library's one add + RMSNorm kernel (the pair
        ``Communicator.all_reduce_rmsnorm`` runs unfused), so both outputs are bitwise those of a
        single node's unfused call on the same inputs. Arguments as there; ``algo`` "auto" or
        "unfused" (no fused kernel spans nodes), ``wire`` None."""
        from pcie_allreduce.fused import path as fused_path

        self._refuse_if_unusable()
        _refuse_wire(wire)
        if algo not in ("auto", UNFUSED):
            raise ValueError(f"algo={algo!r}: no fused kernel spans nodes; across nodes the call runs the all-reduce, "
                             f"then the add + RMSNorm kernel (algo='auto' or {UNFUSED!r})")
        validation.fused_call(x, residual, weight, eps, out, residual_out, UNFUSED, device=self.device,
                              max_bytes=self.max_bytes, world=self.world_size)
        normed = torch.empty_like(x) if out is None else out
        new_residual = torch.empty_like(residual) if residual_out is None else residual_out
        if x.numel() == 0:
            return normed, new_residual
        self.all_reduce(x, out=normed)
        fused_path.add_rmsnorm(normed, residual, weight, eps, normed, new_residual)
        return normed, new_residual

    def check(self) -> None:
        """Raise the error of an earlier failed call (between nodes, or of the node's kernels)."""
        self._refuse_if_failed()
        self._link.check_pending()
        check = getattr(self.intra, "check", None)
        if check is not None:
            check()

    @property
    def backend(self) -> str:
        """The backend of the group between nodes: "nccl", "gloo", or e.g. "cpu:gloo,cuda:nccl"."""
        return self._link.backend

    # What the SGLang adapter and log line read of a communicator: the node's.
    @property
    def transport(self) -> str:
        return getattr(self.intra, "transport", "p2p")

    @property
    def transport_reason(self) -> str:
        return getattr(self.intra, "transport_reason", "one rank per node")

    @property
    def island_ranks(self) -> int:
        return getattr(self.intra, "island_ranks", 0)

    @property
    def ll_capacity(self) -> int | None:
        return getattr(self.intra, "ll_capacity", None)

    def capacity_of(self, algo: str) -> int | None:
        """Largest message (bytes, any dtype) a forced ``algo`` takes here; None: unbounded. The
        nodes run it on fp32 partials, twice a 16-bit message's bytes, so half its capacity on the
        node's workspace (:func:`pcie_allreduce.plan.algorithms.capacity_of`)."""
        if algo == "auto" or self.intra is None:
            return None
        limit = capacity_of(algo, self.ll_capacity)
        return None if limit is None else max(0, limit) // 2

    def select_algo(self, nbytes: int, dtype: torch.dtype) -> str:
        """What the nodes' all-reduces run for an ``nbytes`` message of ``dtype`` (on its fp32 partials)."""
        if self.intra is None:
            return "between nodes only"
        return self.intra.select_algo(nbytes * 4 // dtype.itemsize, torch.float32)

    def serves_stream(self, stream: int | None = None) -> bool:
        """Whether the node communicator has the workspace of ``stream`` (default: the current one)."""
        return bool(self.intra.serves_stream(stream)) if self.intra is not None else True

    def prepare_stream(self, stream: int | None = None) -> None:
        """Make the node communicator's workspace of ``stream`` (default: the current one; collective over the node)."""
        if self.intra is not None:
            self.intra.prepare_stream(stream)

    def close(self, *, release_captured: bool = False) -> None:
        """Release the node's communicator, then shut down the process groups made here (their
        connections and NCCL communicators): the node's, and the one between nodes where
        ``inter_node_backend`` made it, unless a CUDA graph captured a send on it (the graph may
        be replayed; it then lives until the process ends). ``release_captured``: no such graph
        is replayed after this; the node's graph-captured workspaces are freed too
        (``Communicator.close``). Collective over the group. Calls after it raise at once,
        posting nothing.

        Shut down, not destroyed: torch names a group made with local synchronization by its
        ranks and the number of groups alive, so a destroyed group's name would be taken by the
        next group of the same ranks (a new communicator over this group), whose ranks would
        then meet the old group's keys in the store and wait forever."""
        if self._closed:
            return
        self._closed = True
        try:
            close = getattr(self.intra, "close", None)
            if close is not None:
                if release_captured:
                    close(release_captured=True)
                else:
                    close()
        finally:
            for group in self._owned_groups:
                if self._link.captured and group is self._link.group:
                    _NEVER_SHUT_DOWN.append(group)
                else:
                    group.shutdown()
            self._owned_groups = []

    def _refuse_if_unusable(self) -> None:
        if self._closed:
            raise RuntimeError("this hierarchical communicator is closed")
        self._refuse_if_failed()

    def _refuse_if_failed(self) -> None:
        if self._link.failed is not None:
            raise RuntimeError(f"this hierarchical communicator failed earlier ({self._link.failed}); create a new one")

    def _node_all_reduce(self, x: torch.Tensor, algo: str) -> torch.Tensor:
        if self.intra is None:
            return x
        return self.intra.all_reduce(x) if algo == "auto" else self.intra.all_reduce(x, algo=algo)

    # ---- between nodes -----------------------------------------------------------------

    def _peer(self, node: int, local_rank: int) -> int:
        return self.layout.nodes[node][local_rank]


def _refuse_wire(wire: str | None) -> None:
    if wire is not None:
        raise ValueError(f"wire={wire!r}: no compressed wire spans nodes (the chain between them carries fp32 "
                         "partials); a hierarchical communicator's wires are none")

