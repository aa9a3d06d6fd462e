"""CPU tests of the SGLang plugin's decisions: which groups it serves, and what its adapter serves.

The eligibility decision, one for all ranks (NVLink, the group's size, groups across nodes served
hierarchically or declined with the reason); the adapter checking every workspace before an eager
call; a forced algorithm declining what it cannot take (on one node and across nodes) instead of
raising in the forward pass; the FP8 wire from its threshold up, and exact where the communicator
has no such wire; and the adapter's fused call as one opaque op under torch.compile. None of
these needs SGLang: the adapter runs on stand-in communicators.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from pcie_allreduce.tools import ranks
from pcie_allreduce.layout import Layout
from pcie_allreduce.plugin_eligibility import Decision, RankFacts
from sglang_plugin.settings import Settings, SettingsError
from tests._standins import CappedCommunicator, GlooCommunicator


# ---------------------------------------------------------------------------- eligibility (pure parts)


def _decide_rank(ctx, cases: list[tuple]) -> list[Decision]:
    from sglang_plugin.eligibility import decide

    decisions = []
    for facts_by_rank, nvlink_by_rank, mode in cases:
        facts = RankFacts(**facts_by_rank[ctx.rank])
        decisions.append(decide(ctx.group, ctx.device, Settings(enabled=True, mode=mode),
                                facts_fn=lambda device: facts, nvlink_fn=lambda ids: nvlink_by_rank[ctx.rank]))
    return decisions


FACT = dict(host="h", unavailable=None, physical_gpu=0, sm="SM120")
GPU1 = {**FACT, "physical_gpu": 1}
ELIGIBILITY_CASES = [  # (facts per rank, NVML answer per rank, mode) -> (serve, in the reason)
    (([FACT, GPU1], [False, False], "pcie"), (True, "2 GPUs without full NVLink (SM120, mode=pcie)")),
    (([FACT, GPU1], [True, True], "pcie"), (False, "fully NVLinked")),
    (([FACT, GPU1], [True, False], "pcie"), (True, "without full NVLink")),
    (([FACT, GPU1], [True, True], "always"), (True, "mode=always")),
    (([FACT, {**GPU1, "host": "other"}], [False, False], "always"), (False, "spans 2 nodes (0;1), one GPU each")),
    (([FACT, {**GPU1, "unavailable": "no driver"}], [False, False], "always"),
     (False, "rank 1 cannot run the kernels: no driver")),
]


def test_eligibility_is_one_decision_for_all_ranks() -> None:
    """Whatever each rank sees, both ranks take the same branch (one spawn for all cases)."""
    cases = [case for case, _ in ELIGIBILITY_CASES]
    per_rank = ranks.run_ranks(_decide_rank, 2, cases, gpu=False, timeout_s=120)
    for (case, (serve, needle)), mine, theirs in zip(ELIGIBILITY_CASES, *per_rank):
        assert mine == theirs, f"ranks decided differently for {case}"
        assert mine.serve is serve and needle in mine.reason, (case, mine)


@pytest.mark.parametrize("world, serve", [(8, True), (12, True), (16, True), (17, False), (32, False)])
def test_eligibility_takes_tensor_parallel_groups_up_to_16_ranks(world: int, serve: bool, monkeypatch) -> None:
    """TP up to MAX_RANKS (16) in one host is served; a larger group is declined by its size, before
    any collective (every rank knows W). The group's collectives are stood in for: each rank's
    facts as if gathered from ``world`` ranks on distinct GPUs of one host."""
    from sglang_plugin import eligibility

    def gather(out: list, obj, group=None) -> None:
        for i in range(len(out)):
            out[i] = {**obj, "physical_gpu": i} if isinstance(obj, dict) else obj

    monkeypatch.setattr(eligibility.dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(eligibility.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(eligibility.dist, "all_gather_object", gather)
    decision = eligibility.decide(None, torch.device("cpu"), Settings(enabled=True, mode="pcie"),
                                  facts_fn=lambda device: RankFacts(**FACT), nvlink_fn=lambda ids: False)
    assert decision.serve is serve, decision
    assert (f"{world} GPUs without full NVLink" if serve else f"the group has {world} ranks; pcie_allreduce serves "
            "2 to 16") in decision.reason


def _decide_multinode(ctx, cases: list[tuple]) -> list[Decision]:
    from sglang_plugin.eligibility import decide

    decisions = []
    for hosts, emulated, multinode, mode in cases:
        facts = RankFacts(**{**FACT, "host": hosts[ctx.rank], "physical_gpu": ctx.rank % 2,
                             "emulated_nodes": emulated})
        decisions.append(decide(ctx.group, ctx.device, Settings(enabled=True, mode=mode, multinode=multinode),
                                facts_fn=lambda device: facts, nvlink_fn=lambda ids: False))
    return decisions


MULTINODE_CASES = [  # (host per rank, $PCIE_AR_NODES, multinode setting, mode) -> (serve, in the reason, nodes)
    ((["a", "a", "b", "b"], None, True, "pcie"),
     (True, "4 GPUs without full NVLink (SM120, mode=pcie); hierarchical across 2 nodes of 2 GPUs (0-1;2-3): the "
            "kernels inside each node, NCCL between nodes", ((0, 1), (2, 3)))),
    ((["a", "a", "b", "b"], None, True, "always"), (True, "mode=always (SM120); hierarchical across 2 nodes", ((0, 1), (2, 3)))),
    ((["a", "a", "b", "b"], None, False, "pcie"),
     (False, "the group spans 2 nodes (0-1;2-3); PCIE_AR_SGLANG_MULTINODE=0 leaves such groups to SGLang", None)),
    ((["a", "b", "a", "b"], None, True, "pcie"), (False, "node 0 holds ranks [0, 2], not a run of consecutive", None)),
    ((["a", "a", "a", "b"], None, True, "pcie"), (False, "its nodes hold different numbers of ranks (0-2;3)", None)),
    ((["a"] * 4, 2, True, "pcie"), (True, "hierarchical across 2 nodes of 2 GPUs (0-1;2-3)", ((0, 1), (2, 3)))),
    ((["a"] * 4, 4, True, "pcie"), (False, "spans 4 nodes (0;1;2;3), one GPU each", None)),
    ((["a"] * 4, -1, True, "pcie"), (False, "$PCIE_AR_NODES is not a positive number of nodes", None)),
    ((["a"] * 4, None, True, "pcie"), (True, "4 GPUs without full NVLink (SM120, mode=pcie)", None)),
]


def test_eligibility_of_groups_across_nodes_is_one_decision() -> None:
    """A tp group over nodes of equal runs of consecutive ranks is served hierarchically (the log
    line says so and the decision carries the layout); other spreads, one GPU per node and
    PCIE_AR_SGLANG_MULTINODE=0 are declined with the reason; nodes emulated with $PCIE_AR_NODES
    decide like real ones; one node decides as before."""
    cases = [case for case, _ in MULTINODE_CASES]
    per_rank = ranks.run_ranks(_decide_multinode, 4, cases, gpu=False, timeout_s=120)
    for (case, (serve, needle, layout)), *decisions in zip(MULTINODE_CASES, *per_rank):
        assert len(set(decisions)) == 1, f"ranks decided differently for {case}: {decisions}"
        mine = decisions[0]
        assert mine.serve is serve and needle in mine.reason, (case, mine)
        assert (mine.layout.nodes if mine.layout else None) == layout, (case, mine)


def test_eligibility_group_name() -> None:
    from sglang_plugin.eligibility import group_name

    @dataclasses.dataclass
    class G:
        group_desc: str

    assert group_name(G("tp:cpu")) == "tp" and group_name(G("attention_tp:cpu")) == "attention_tp"
    assert group_name(G("tp:device")) == "" and group_name(object()) == ""


def test_algorithm_ranges_compress_the_table() -> None:
    from pcie_allreduce.plugin_logline import algorithm_ranges

    class T:
        def select_algo(self, nbytes, dtype):
            return "oneshot" if nbytes <= 64 << 10 else "staged" if nbytes <= 1 << 20 else "twoshot"

    assert algorithm_ranges(T(), 8 << 20) == "oneshot<=64KiB, staged<=1MiB, twoshot<=8MiB"
    assert algorithm_ranges(T(), 1000) == "oneshot<=1000B"


def test_adapter_checks_every_workspace_before_each_eager_call() -> None:
    """A failure a graph replay recorded on another stream's workspace reaches the next eager call."""
    from pcie_allreduce.errors import CollectiveTimeout
    from sglang_plugin.adapter import PcieAllReduceAdapter

    class FailedElsewhere:
        device, rank, world_size, max_bytes, ll_capacity, transport = torch.device("cpu"), 0, 2, 1 << 20, 1 << 19, "p2p"

        def __init__(self, *args, **kwargs) -> None:
            self.launched = 0

        def check(self) -> None:
            raise CollectiveTimeout("rank 0 waited more than 10 s for rank 1 in one-shot gather of call #7")

        def all_reduce(self, x, out=None, algo="auto"):
            self.launched += 1
            return x

        def all_reduce_rmsnorm(self, x, residual, weight, eps):
            self.launched += 1
            return x, residual

    adapter = PcieAllReduceAdapter(None, "cpu", Settings(enabled=True), communicator_factory=FailedElsewhere)
    x = torch.ones(4, 64, dtype=torch.bfloat16)
    with pytest.raises(CollectiveTimeout, match="call #7"):
        adapter.custom_all_reduce(x)
    with pytest.raises(CollectiveTimeout, match="call #7"):
        adapter.fused_allreduce_rmsnorm(x, x.clone(), torch.ones(64, dtype=torch.bfloat16), 1e-6)
    assert adapter.comm.launched == 0


@pytest.mark.parametrize("algo", ["oneshot_ll", "oneshot_full", "twoshot_full", "host_oneshot", "host_twoshot",
                                  "oneshot", "twoshot", "auto"])
@pytest.mark.parametrize("transport", ["p2p", "host"])
def test_a_forced_algorithm_declines_what_it_cannot_take(algo: str, transport: str) -> None:
    """Declined calls take SGLang's own path; the served ones never raise in the forward pass."""
    from pcie_allreduce.plan import algorithms, tables
    from sglang_plugin.adapter import PcieAllReduceAdapter

    adapter = PcieAllReduceAdapter(None, "cpu", Settings(enabled=True, algo=algo),
                                   communicator_factory=lambda *a, **k: CappedCommunicator(transport=transport))
    ll_capacity = adapter.comm.ll_capacity
    runs = algo == "auto" or algorithms.runs_on(algo, transport)
    limit = min(algorithms.capacity_of(algo, ll_capacity) or adapter.max_bytes, adapter.max_bytes)
    for nbytes in sorted({16, limit - 16, limit, limit + 16, ll_capacity, ll_capacity + 16, adapter.max_bytes}):
        if not 0 < nbytes <= adapter.max_bytes:
            continue
        x = torch.ones(nbytes // 2, dtype=torch.bfloat16)
        served = runs and nbytes <= limit
        assert adapter.should_custom_ar(x) is served, (algo, transport, nbytes)
        out = adapter.custom_all_reduce(x)
        assert (out is not None) is served, (algo, transport, nbytes)
    assert adapter.comm.launched if runs else not adapter.comm.launched


class _NodeSum:
    """A node's ``Communicator`` as the hierarchy sees it: its capacity, and a forced algorithm that
    raises as the real one does for a message it cannot take."""

    def __init__(self, max_bytes: int, node_size: int) -> None:
        self.ll_capacity = Layout.make(max_bytes, node_size).ll_capacity
        self.node_size, self.ran = node_size, []

    def all_reduce(self, x, algo="auto"):
        from pcie_allreduce.plan import algorithms, tables
        from pcie_allreduce.plan import dispatch

        problem = algorithms.call_problem(algo, x.numel() * x.element_size(), x.element_size(), "p2p", 0, 1 << 30,
                                          self.ll_capacity)
        if problem is not None:
            raise ValueError(problem)
        dispatch.plain_choice(x.numel() * x.element_size(), self.node_size, x.dtype, tables.default_table(),
                              ll_capacity=self.ll_capacity, algo=algo)
        self.ran.append((x.numel() * x.element_size(), algo))
        return x.clone()


def _hierarchy_rank(rank: int, max_bytes: int):
    """The real HierarchicalCommunicator, ``rank`` of two nodes of two ranks, its sends stubbed out."""
    from pcie_allreduce.hierarchy import HierarchicalCommunicator
    from pcie_allreduce.fabric.nodes import equal_nodes
    from pcie_allreduce.inter_node import InterNodeLink

    comm = object.__new__(HierarchicalCommunicator)
    comm.layout, comm.rank, comm.world_size, comm.max_bytes = equal_nodes(4, 2), rank, 4, max_bytes
    comm.node, comm.local_rank, comm.node_size = comm.layout.node_of(rank), comm.layout.local_rank(rank), 2
    comm.device, comm._closed = torch.device("cpu"), False
    comm._link = InterNodeLink(None, [0, 1, 2, 3], rank, 60.0, "gloo")  # through host memory
    comm.intra = _NodeSum(2 * max_bytes, 2)
    comm._link.send = lambda tensor, peer, step: None
    comm._link.receive_all = lambda parts, step: [into.zero_() for into, _ in parts]
    return comm


@pytest.mark.parametrize("algo", ["oneshot_ll", "oneshot_full", "twoshot_full", "oneshot", "twoshot", "auto"])
@pytest.mark.parametrize("rank", [0, 2])
def test_a_forced_algorithm_across_nodes_never_raises_in_the_forward(algo: str, rank: int) -> None:
    """A group across nodes runs the forced algorithm on fp32 partials, twice a 16-bit message's
    bytes: the adapter serves what the hierarchy's capacity for it takes, and every call it
    serves runs; the rest is declined up front."""
    from sglang_plugin.adapter import PcieAllReduceAdapter

    max_bytes = 2 << 20
    adapter = PcieAllReduceAdapter(None, "cpu", Settings(enabled=True, algo=algo, max_bytes=max_bytes),
                                   communicator_factory=lambda *a, **k: _hierarchy_rank(rank, max_bytes))
    node_capacity = adapter.comm.ll_capacity  # the node's workspace: 512 KiB
    assert node_capacity == 512 << 10
    edge = adapter.largest_served & ~1
    for nbytes in sorted({edge, min(edge + 2, max_bytes), 256 << 10, (256 << 10) + 16, node_capacity, max_bytes}):
        x = torch.ones(nbytes // 2, dtype=torch.bfloat16)
        served = adapter.should_custom_ar(x)
        assert served is (nbytes <= adapter.largest_served), (algo, nbytes)
        if served:
            assert adapter.custom_all_reduce(x).shape == x.shape, (algo, nbytes)  # ran, no ValueError
        else:
            assert adapter.custom_all_reduce(x) is None
            with pytest.raises(ValueError, match=f"algo={algo!r} takes at most .* bytes across nodes"):
                adapter.comm.all_reduce(x, algo=algo)  # refused before anything is sent
    capped = algo in ("oneshot_ll", "oneshot_full", "twoshot_full")
    assert adapter.largest_served == (adapter.comm.capacity_of(algo) if capped else max_bytes)
    assert not capped or (node_capacity - 1024) // 2 <= adapter.largest_served <= node_capacity // 2
    assert adapter.comm.intra.ran  # the node all-reduces ran the forced algorithm, on fp32 partials


def test_a_group_across_nodes_refuses_more_than_it_takes_naming_the_variable() -> None:
    from pcie_allreduce import hierarchy
    from sglang_plugin.adapter import hierarchical_factory

    make = hierarchical_factory(layout=None)
    with pytest.raises(SettingsError, match="PCIE_AR_SGLANG_MAX_BYTES=256MiB: a tp group across nodes takes at "
                                            "most 128MiB"):
        make(None, torch.device("cpu"), max_bytes=256 << 20, timeout_s=300.0)
    assert hierarchy.MAX_BYTES == 128 << 20


class _Wired:
    """A communicator as the adapter sees it that records each call's wire and algorithm."""

    device, rank, world_size, max_bytes, island_ranks, transport = torch.device("cpu"), 0, 2, 8 << 20, 0, "host"
    ll_capacity = 1 << 19

    def __init__(self, *args, wires: tuple[str, ...] = ("fp8",), **kwargs) -> None:
        self.wires = wires
        self.calls: list[tuple] = []

    def check(self) -> None:
        pass

    def all_reduce(self, x, out=None, algo="auto", wire=None):
        self.calls.append(("all_reduce", x.numel() * x.element_size(), algo, wire))
        return x.clone()

    def all_reduce_rmsnorm(self, x, residual, weight, eps, algo="auto", wire=None):
        self.calls.append(("all_reduce_rmsnorm", x.numel() * x.element_size(), algo, wire))
        return x.clone(), residual.clone()


def test_the_fp8_wire_setting_compresses_from_its_threshold_up() -> None:
    """PCIE_AR_SGLANG_WIRE=fp8: plain and fused calls of WIRE_MIN_BYTES and more ask for the FP8
    wire, smaller ones stay exact; the threshold is a pure function of the size."""
    from sglang_plugin.adapter import PcieAllReduceAdapter

    settings = Settings(enabled=True, wire="fp8", wire_min_bytes=64 << 10)
    adapter = PcieAllReduceAdapter(None, "cpu", settings, communicator_factory=_Wired)
    weight = torch.ones(512, dtype=torch.bfloat16)
    for tokens in (1, 63, 64, 65, 2048):
        x = torch.randn(tokens, 512).to(torch.bfloat16)
        assert adapter.custom_all_reduce(x) is not None
        assert adapter.fused_allreduce_rmsnorm(x, x.clone(), weight, 1e-6) is not None
    want = []
    for tokens in (1, 63, 64, 65, 2048):
        nbytes = tokens * 512 * 2
        wire = "fp8" if nbytes >= 64 << 10 else None
        want += [("all_reduce", nbytes, "auto", wire), ("all_reduce_rmsnorm", nbytes, "auto", wire)]
    assert adapter.comm.calls == want


def test_the_fp8_wire_setting_leaves_a_communicator_without_it_exact(caplog: pytest.LogCaptureFixture) -> None:
    """A group served hierarchically (no compressed wire between nodes) stays exact, and says so."""
    from sglang_plugin.adapter import PcieAllReduceAdapter

    settings = Settings(enabled=True, wire="fp8", wire_min_bytes=1)
    with caplog.at_level(logging.WARNING):
        adapter = PcieAllReduceAdapter(None, "cpu", settings,
                                       communicator_factory=lambda *a, **k: _Wired(wires=()))
    assert adapter.wire is None and "PCIE_AR_SGLANG_WIRE=fp8" in caplog.text and "stay exact" in caplog.text
    adapter.custom_all_reduce(torch.randn(4096).to(torch.bfloat16))
    assert adapter.comm.calls == [("all_reduce", 8192, "auto", None)]


def test_the_library_communicator_and_the_hierarchy_declare_their_wires() -> None:
    from pcie_allreduce import Communicator
    from pcie_allreduce.plan import algorithms, tables
    from pcie_allreduce.hierarchy import HierarchicalCommunicator

    assert Communicator.wires == tuple(algorithms.WIRE_ALGORITHMS) == ("fp8",)
    assert HierarchicalCommunicator.wires == ()


# ---------------------------------------------------------------------------- torch.compile


def _compiled_fused_step(ctx) -> dict:
    """The adapter's fused call inside torch.compile(fullgraph=True): one opaque registered op in
    the graph (its fake implementation for tracing), the same result as eager."""
    from pcie_allreduce import ops
    from sglang_plugin.adapter import PcieAllReduceAdapter

    class Registered(GlooCommunicator):  # as the real communicator, reachable by its handle
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.handle = ops.HANDLES.register(self)

        def all_reduce_rmsnorm(self, x, residual, weight, eps, *, out=None, residual_out=None, algo="auto",
                               wire=None):
            assert wire is None, wire
            return super().all_reduce_rmsnorm(x, residual, weight, eps)

    adapter = PcieAllReduceAdapter(ctx.group, "cpu", Settings(enabled=True), communicator_factory=Registered)
    gen = torch.Generator().manual_seed(ctx.rank)
    x = torch.randint(-4, 5, (4, 64), generator=gen).to(torch.bfloat16)
    residual = torch.randint(-4, 5, (4, 64), generator=torch.Generator().manual_seed(99)).to(torch.bfloat16)
    weight = torch.ones(64, dtype=torch.bfloat16)

    def step(x, residual, weight):
        normed, new_residual = adapter.fused_allreduce_rmsnorm(x, residual, weight, 1e-6)
        return normed * 2, new_residual + 1

    want = step(x, residual, weight)
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(x, residual, weight)
    return {"equal": [bool(torch.equal(a, b)) for a, b in zip(got, want)],
            "fused_calls": sum(1 for c in adapter.comm.calls if c[0] == "all_reduce_rmsnorm")}


def test_the_fused_call_is_one_opaque_op_under_torch_compile() -> None:
    for rank, r in enumerate(ranks.run_ranks(_compiled_fused_step, 2, gpu=False, timeout_s=300)):
        assert r["equal"] == [True, True], f"rank {rank}: compiled and eager differ: {r}"
        assert r["fused_calls"] >= 2, f"rank {rank}: the compiled graph did not run the fused op: {r}"
