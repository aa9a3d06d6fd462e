"""Conformance of the SGLang plugin with SGLang's newer ("V2") custom all-reduce interface.

The V2 interface (sglang_plugin/surface.py, INTERFACES) as SGLang's newer sources spell it:

- python/sglang/srt/distributed/device_communicators/custom_all_reduce_v2.py,
  ``CustomAllReduceV2.custom_all_reduce(self, input, override_algo=None)``: "pins the algorithm
  for THIS call only ... callers whose numeric contract depends on a fixed floating-point
  summation order use it"; ``max_push_size`` / ``max_pull_size``: the per-direction message
  ceilings (``_WorkspaceSizes``: "either may be 0"; ``max_size`` is the larger, "Largest message
  any algorithm on this workspace can take"); ``should_custom_ar`` under an override: the size
  against ``max_size``; ``uses_one_shot_push(nbytes)``: no when ``nbytes > max_push_size``, else
  ``override_algo == ONE_SHOT_PUSH`` when one is set.
- python/sglang/kernels/ops/communication/all_reduce_fusion.py, ``fits_push_slot(max_push_size,
  num_tokens, hidden_dim)``: ``0 < num_tokens * hidden_dim * 2 <= max_push_size``.
- python/sglang/srt/layers/flashinfer_comm_fusion.py, ``flashinfer_allreduce_residual_rmsnorm``:
  a registered custom op whose ``fp32_acc`` defaults to False, called by
  ``layernorm._forward_with_allreduce_fusion`` with keywords, ``use_attn_tp_group=`` among them.

The stand-in call sites below repeat those functions' logic on our adapter; where SGLang 0.5.23
is installed, the names are checked against its sources (its own V2 class and AllReduceAlgo).
The communicator under the adapter is a one-rank CPU stand-in (ours; its kernels need a GPU).
"""

from __future__ import annotations

import ast
import enum
import importlib.machinery
import inspect
import logging
import sys
import types

import pytest
import torch

from pcie_allreduce import plugin_surface

from sglang_plugin import hooks, surface
from sglang_plugin.adapter import PULL_ALGORITHMS, PcieAllReduceAdapter
from sglang_plugin.settings import Settings
from tests._sglang import sglang_skip_reason

SGLANG_SKIP = sglang_skip_reason()
needs_sglang = pytest.mark.skipif(SGLANG_SKIP is not None, reason=SGLANG_SKIP or "")

MAX_BYTES = 1 << 20
#: SGLang's AllReduceAlgo as the V2 sources define it (the real one is used where importable).
StandInAlgo = enum.Enum("AllReduceAlgo", surface.V2_OVERRIDE_ALGOS)


class OneRank:
    """A one-rank stand-in for ``pcie_allreduce.Communicator``: the sum is the input; it records
    the algorithm each call asked for (``transport`` and capacities as the real one has them)."""

    device, rank, world_size, max_bytes, island_ranks, ll_capacity = torch.device("cpu"), 0, 1, MAX_BYTES, 0, 1 << 19

    def __init__(self, *args, transport: str = "p2p", **kwargs) -> None:
        self.transport = transport
        self.algos: list[str] = []
        self.fused = 0

    def capacity_of(self, algo: str) -> int | None:
        from pcie_allreduce.plan import algorithms

        return None if algo == "auto" else algorithms.capacity_of(algo, self.ll_capacity)

    def check(self) -> None:
        pass

    def all_reduce(self, x, out=None, algo="auto"):
        self.algos.append(algo)
        return x.clone()

    def all_reduce_rmsnorm(self, x, residual, weight, eps):
        self.fused += 1
        new_residual = residual + x
        f = new_residual.float()
        return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype), new_residual


def _adapter(algo: str = "auto", transport: str = "p2p") -> PcieAllReduceAdapter:
    return PcieAllReduceAdapter(None, "cpu", Settings(enabled=True, algo=algo, max_bytes=MAX_BYTES),
                                communicator_factory=lambda *a, **k: OneRank(transport=transport))


def _algo_enum():
    """SGLang's real AllReduceAlgo where it imports on this machine, else the stand-in."""
    try:
        from sglang.kernels.ops.communication.all_reduce import AllReduceAlgo
    except Exception:  # SGLang absent, or a dependency of the module missing on a CPU machine
        return StandInAlgo
    return AllReduceAlgo


# ---------------------------------------------------------------------------- the names are SGLang's


def _class_body(path: str, cls: str) -> list[ast.stmt]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body


def _self_assignments(path: str, cls: str) -> set[str]:
    """Names ``cls``'s methods assign as ``self.<name> = ...`` (or annotate so)."""
    found = set()
    for node in ast.walk(ast.Module(body=_class_body(path, cls), type_ignores=[])):
        for t in getattr(node, "targets", None) or [getattr(node, "target", None)]:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                found.add(t.attr)
    return found


def _enum_members(path: str, cls: str) -> set[str]:
    return {t.id for a in _class_body(path, cls) if isinstance(a, ast.Assign) for t in a.targets
            if isinstance(t, ast.Name)}


@needs_sglang
def test_the_v2_names_are_the_ones_sglang_defines() -> None:
    """SGLang 0.5.23 already ships a CustomAllReduceV2 (its per-call override came later): the
    attributes call sites read off a ca_comm, and AllReduceAlgo's members, are its own."""
    root = plugin_surface.package_root("sglang")
    assigned = _self_assignments(root + "/srt/distributed/device_communicators/custom_all_reduce_v2.py",
                                 "CustomAllReduceV2")
    assert set(surface.V2_ATTRIBUTES) <= assigned, set(surface.V2_ATTRIBUTES) - assigned
    members = _enum_members(root + "/kernels/ops/communication/all_reduce.py", "AllReduceAlgo")
    assert set(surface.V2_OVERRIDE_ALGOS) <= members, members
    fused = plugin_surface.source_parameters(hooks.FUSED_OP)
    assert "use_attn_tp_group" in fused
    assert fused == surface.hook_parameters(hooks.flashinfer_allreduce_residual_rmsnorm_v2)


def test_the_adapter_has_every_v2_attribute_and_0523_custom_all_reduce_binds_the_same() -> None:
    adapter = _adapter()
    for name in surface.V2_ATTRIBUTES:
        assert hasattr(adapter, name), name
    assert surface.parameters(PcieAllReduceAdapter.custom_all_reduce) == surface.V2_CUSTOM_ALL_REDUCE
    assert inspect.signature(PcieAllReduceAdapter.custom_all_reduce).parameters["override_algo"].default is None
    assert adapter.override_algo is None


# ---------------------------------------------------------------------------- override_algo


@pytest.mark.parametrize("algo", ["auto", "oneshot", "twoshot_pull"])
def test_override_algo_is_accepted_and_the_adapters_own_choice_runs(algo: str) -> None:
    """Stand-in call site: ``ca_comm.custom_all_reduce(x, override_algo=AllReduceAlgo.X)`` (the
    per-call pin of CustomAllReduceV2.custom_all_reduce). Every value, SGLang's names or not, is
    served exactly as without it: same result, the table's or the forced algorithm."""
    adapter = _adapter(algo)
    x = torch.arange(4 * 64, dtype=torch.bfloat16).view(4, 64)
    plain = adapter.custom_all_reduce(x)
    for override in [*_algo_enum(), *StandInAlgo, "TWO_SHOT_PULL", 3, object(), None]:
        out = adapter.custom_all_reduce(x, override_algo=override)
        assert torch.equal(out, plain), override
        assert adapter.custom_all_reduce(x, override) is not None  # positionally, as V2 declares it
    assert set(adapter.comm.algos) == {algo}


def test_a_persistent_override_is_read_and_ignored_too() -> None:
    """Older V2 call sites set ``ca_comm.override_algo`` and read ``override_algo is None``."""
    adapter = _adapter()
    x = torch.ones(8, 16, dtype=torch.float16)
    adapter.override_algo = _algo_enum().ONE_SHOT_PUSH
    assert adapter.should_custom_ar(x) and torch.equal(adapter.custom_all_reduce(x), x)
    assert adapter.comm.algos == ["auto"]


def test_override_algo_never_makes_a_declined_call_served() -> None:
    adapter = _adapter()
    too_big = torch.zeros(MAX_BYTES // 2 + 8, dtype=torch.bfloat16)
    for override in [*_algo_enum(), None]:
        assert adapter.custom_all_reduce(too_big, override_algo=override) is None
    pinned = _algo_enum().ONE_SHOT_PUSH
    assert adapter.custom_all_reduce(torch.zeros(16, dtype=torch.int32), override_algo=pinned) is None
    assert adapter.comm.algos == []


# ---------------------------------------------------------------------------- max_push_size / max_pull_size


def _v2_takes(comm, nbytes: int) -> bool:
    """CustomAllReduceV2.should_custom_ar under an override: the size against
    max_size = max(max_pull_size, max_push_size), for 16-byte multiples."""
    return nbytes % 16 == 0 and nbytes <= max(comm.max_pull_size, comm.max_push_size)


def _uses_one_shot_push(comm, nbytes: int, override=None) -> bool:
    """CustomAllReduceV2.uses_one_shot_push's capacity test, as a call site asks it of ca_comm."""
    if comm.disabled or nbytes <= 0 or nbytes % 16 or nbytes > comm.max_push_size:
        return False
    return override is None or override.name == "ONE_SHOT_PUSH"


def _fits_push_slot(max_push_size: int, num_tokens: int, hidden_dim: int) -> bool:
    """all_reduce_fusion.fits_push_slot."""
    return 0 < num_tokens * hidden_dim * 2 <= max_push_size


CEILINGS = [  # (forced algorithm, transport) -> (push, pull): every served size, or 0
    ("auto", "p2p", MAX_BYTES, MAX_BYTES),
    ("auto", "host", MAX_BYTES, MAX_BYTES),
    ("twoshot", "p2p", MAX_BYTES, 0),
    ("oneshot_full", "p2p", 1 << 19, 0),  # capped at the low-latency capacity
    ("oneshot_pull", "p2p", 0, MAX_BYTES),
    ("twoshot_pull", "host", 0, MAX_BYTES),
    ("host_oneshot", "host", MAX_BYTES, 0),
    ("host_oneshot", "p2p", 0, 0),  # cannot run here: nothing is served
]


@pytest.mark.parametrize(("algo", "transport", "push", "pull"), CEILINGS)
def test_the_ceilings_are_what_should_custom_ar_takes(algo: str, transport: str, push: int, pull: int) -> None:
    """The larger ceiling is the largest message served, each direction's is the reach of its
    algorithms (the forced one, or all of them under auto), so V2's own rules agree with ours."""
    adapter = _adapter(algo, transport)
    assert (adapter.max_push_size, adapter.max_pull_size) == (push, pull)
    assert max(push, pull) == adapter.largest_served == adapter.max_size
    for nbytes in sorted({16, 4096, 1 << 19, (1 << 19) + 16, MAX_BYTES - 16, MAX_BYTES, MAX_BYTES + 16}):
        x = torch.zeros(nbytes // 2, dtype=torch.bfloat16)
        assert adapter.should_custom_ar(x) is _v2_takes(adapter, nbytes), nbytes
        if _uses_one_shot_push(adapter, nbytes, _algo_enum().ONE_SHOT_PUSH):
            assert adapter.custom_all_reduce(x, override_algo=_algo_enum().ONE_SHOT_PUSH) is not None
    assert _fits_push_slot(adapter.max_push_size, 4, 7168) is (push >= 4 * 7168 * 2)
    assert all(a in ("oneshot_pull", "twoshot_pull", "twoshot_symm", "twoshot_fp8") for a in PULL_ALGORITHMS)


def test_a_closed_adapter_has_no_ceilings() -> None:
    adapter = _adapter()
    adapter.comm.close = lambda release_captured=False: None
    adapter.close()
    assert (adapter.max_push_size, adapter.max_pull_size) == (0, 0)
    assert not _uses_one_shot_push(adapter, 4096)


# ---------------------------------------------------------------------------- the fused entry


def test_one_fused_hook_per_interface_with_that_interfaces_defaults() -> None:
    """surface.FUSED_ENTRY_DEFAULTS is where the interfaces' fused entries differ; each hook of
    the fused target repeats its interface's defaults, with the same parameters."""
    target = next(t for t in hooks.TARGETS if t.target == hooks.FUSED_OP)
    assert len(target.hooks) == len(surface.INTERFACES)
    base = surface._defaults(target.hook, skip_first=True)
    for interface, hook in zip(surface.INTERFACES, target.hooks):
        assert surface.hook_parameters(hook) == surface.hook_parameters(target.hook)
        assert surface._defaults(hook, skip_first=True) == {**base, **surface.FUSED_ENTRY_DEFAULTS[interface]}


def _fake_fusion_module(name: str, fp32_acc: bool) -> types.ModuleType:
    """A module holding a fused entry with the V2 (or 0.5.23) signature, as ``name``."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)

    def flashinfer_allreduce_residual_rmsnorm(input_tensor, residual, weight, eps=1e-6, max_token_num=2048,
                                              use_oneshot=None, trigger_completion_at_end=False,
                                              fp32_acc=fp32_acc, use_attn_tp_group=True):
        return None, None

    module.flashinfer_allreduce_residual_rmsnorm = flashinfer_allreduce_residual_rmsnorm
    return module


@pytest.mark.parametrize(("fp32_acc", "index"), [(True, 0), (False, 1)])
def test_registration_takes_the_hook_that_fits_the_installed_signature(monkeypatch, fp32_acc: bool, index: int) -> None:
    name = "v2_interface_standin_fusion"
    monkeypatch.setitem(sys.modules, name, _fake_fusion_module(name, fp32_acc))
    target = next(t for t in hooks.TARGETS if t.target == hooks.FUSED_OP)
    hook, problem = surface.fitting_hook(name + ".flashinfer_allreduce_residual_rmsnorm", target.hooks)
    assert problem is None and hook is target.hooks[index]


@needs_sglang
def test_the_installed_sglang_takes_the_0523_fused_hook() -> None:
    target = next(t for t in hooks.TARGETS if t.target == hooks.FUSED_OP)
    assert surface.fitting_hook(target.target, target.hooks) == (target.hook, None)


def _fused_call(hook, use_attn_tp_group: bool):
    """The call layernorm._forward_with_allreduce_fusion makes, all by keyword."""
    x = torch.randn(4, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    residual = torch.randn(4, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
    weight = torch.rand(64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    declined = lambda *a, **k: (None, None)  # noqa: E731 - SGLang's kernel, off here
    return hook(declined, input_tensor=x, residual=residual, weight=weight, eps=1e-6, max_token_num=2048,
                use_attn_tp_group=use_attn_tp_group), residual + x


@needs_sglang
@pytest.mark.parametrize("hook", [hooks.flashinfer_allreduce_residual_rmsnorm,
                                  hooks.flashinfer_allreduce_residual_rmsnorm_v2], ids=["0.5.23", "V2"])
def test_use_attn_tp_group_is_served_only_on_our_group(monkeypatch, hook) -> None:
    """True names the attention-TP group, False the post-experts reduction group SGLang's
    resolve_fusion_group returns: served where that group's ca_comm is our adapter, else
    ``(None, None)`` (SGLang's unfused path); a group that cannot be found declines, never raises."""
    from sglang.srt.layers import flashinfer_comm_fusion
    from sglang.srt.runtime_context import get_parallel

    ours = types.SimpleNamespace(ca_comm=_adapter())
    other = types.SimpleNamespace(ca_comm=None)  # e.g. the attention-TP subgroup under DP attention
    for attn_group, moe_group, served in [(ours, ours, (True, True)), (other, other, (False, False)),
                                          (ours, other, (True, False)), (other, ours, (False, True))]:
        monkeypatch.setattr(flashinfer_comm_fusion, "resolve_fusion_group",
                            lambda *, use_attn_tp_group, g=moe_group: (1, 0, g))
        with get_parallel().override(attn_tp_group=attn_group, attn_tp_size=1, attn_tp_rank=0):
            for flag, want in zip((True, False), served):
                (normed, new_residual), expected = _fused_call(hook, flag)
                assert (normed is not None) is want, (flag, want)
                if want:
                    assert torch.equal(new_residual, expected)
    assert ours.ca_comm.comm.fused == 4

    monkeypatch.delattr(flashinfer_comm_fusion, "resolve_fusion_group")
    with get_parallel().override(attn_tp_group=ours, attn_tp_size=1, attn_tp_rank=0):
        assert _fused_call(hook, False)[0] == (None, None)
        assert _fused_call(hook, True)[0][0] is not None


def test_an_unresolvable_group_is_logged_once(monkeypatch, caplog: pytest.LogCaptureFixture) -> None:
    """An SGLang whose fusion module lacks resolve_fusion_group: declined, one warning."""
    monkeypatch.setattr(hooks, "_UNRESOLVED_LOGGED", set())
    name = "sglang.srt.layers.flashinfer_comm_fusion"
    monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    with caplog.at_level(logging.WARNING, logger="sglang_plugin"):
        for _ in range(3):
            assert hooks._adapter_of_fusion_group(False) is None
    assert sum("use_attn_tp_group=False" in r.getMessage() for r in caplog.records) == 1
