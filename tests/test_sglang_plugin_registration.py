"""CPU conformance tests of the SGLang plugin attached to SGLang's real code (pinned 0.5.23).

Registration through SGLang's ``HookRegistry`` (and unregistration that keeps other plugins'
hooks), SGLang's own ``load_plugins()`` finding the entry point in a fresh interpreter, and the
import-hook path for SGLang versions without plugins. Then, on CPU ranks, SGLang's real
``GroupCoordinator`` (gloo groups) using the adapter: dispatch, the outplace all-reduce,
``graph_capture()``, ``fused_allreduce_rmsnorm`` and the fused-op hook, all ranks declining
together; and every forward step raising a failure a communicator recorded. The one substitution
is ours, not SGLang's: a gloo-backed stand-in for ``pcie_allreduce.Communicator`` (whose kernels
need a GPU) and the per-rank GPU facts the eligibility decision gathers. SGLang's custom ops
(``outplace_all_reduce``) are registered for CUDA only, so these tests call the coordinator methods
those ops run; tests/test_sglang_gpu.py drives the ops themselves. Tests that need SGLang skip with
the reason when it is not importable.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from pcie_allreduce.tools import ranks
from pcie_allreduce.layout import Layout
from pcie_allreduce.plugin_eligibility import RankFacts
from sglang_plugin import hooks, import_watch
from sglang_plugin.settings import Settings
from tests._sglang import ensure_entry_point, fake_model_runner_module, sglang_skip_reason
from tests._standins import GlooCommunicator, rmsnorm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SGLANG_SKIP = sglang_skip_reason()
needs_sglang = pytest.mark.skipif(SGLANG_SKIP is not None, reason=SGLANG_SKIP or "")


# ---------------------------------------------------------------------------- registration


@needs_sglang
def test_register_and_unregister_cleanly_with_hook_registry() -> None:
    """Through SGLang's HookRegistry: targets wrapped, then restored, other plugins' hooks kept."""
    from sglang.srt.distributed.device_communicators import custom_all_reduce as car
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_plugin import plugin
    from sglang_plugin.registry import REGISTRY

    original = car.dispatch_custom_allreduce
    seen: list[str] = []

    def other_plugin(orig, *args, **kwargs):
        seen.append("other")
        return orig(*args, **kwargs)

    assert REGISTRY.state is None
    HookRegistry.register(hooks.DISPATCH, other_plugin, HookType.AROUND)
    try:
        state = plugin.install(Settings(enabled=True), attach="plugin", apply=True)
        assert hooks.DISPATCH in state.targets
        wrapped = car.dispatch_custom_allreduce
        assert wrapped is not original and hooks.DISPATCH in HookRegistry._patched
        assert [h for _, h, _ in HookRegistry._hooks[hooks.DISPATCH]] == [other_plugin, hooks.dispatch_custom_allreduce]
        assert plugin.install(Settings(enabled=True), attach="plugin") is state  # idempotent

        assert plugin.unregister() is True and REGISTRY.state is None
        assert [h for _, h, _ in HookRegistry._hooks[hooks.DISPATCH]] == [other_plugin]
        restored = car.dispatch_custom_allreduce
        assert restored is not wrapped and getattr(restored, "__wrapped__", None) is original  # only theirs
        assert plugin.unregister() is False
    finally:
        HookRegistry._hooks.pop(hooks.DISPATCH, None)
        if hooks.DISPATCH in HookRegistry._patched:
            HookRegistry._patched.discard(hooks.DISPATCH)
        car.dispatch_custom_allreduce = original
        plugin.unregister()
    for target in hooks.TARGETS:
        assert not [h for _, h, _ in HookRegistry._hooks.get(target.target, []) if h is target.hook]


def _run_python(code: str, env: dict[str, str], cwd: str = REPO) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PCIE_AR_SGLANG_")}
    full_env.update(env)
    full_env["PYTHONPATH"] = os.pathsep.join([REPO, full_env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=300)


LOAD_PLUGINS = """
    import logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    from tests._sglang import ensure_entry_point
    ensure_entry_point()
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.distributed.device_communicators import custom_all_reduce as car
    from sglang_plugin.registry import REGISTRY
    print("WRAPPED", hasattr(car.dispatch_custom_allreduce, "__wrapped__"), REGISTRY.state is not None)
"""


@needs_sglang
@pytest.mark.parametrize("env,wrapped", [
    ({"PCIE_AR_SGLANG_ENABLE": "1"}, True),
    ({"PCIE_AR_SGLANG_ENABLE": "1", "SGLANG_PLUGINS": "pcie_allreduce"}, True),
    ({"PCIE_AR_SGLANG_ENABLE": "1", "SGLANG_PLUGINS": "someone_else"}, False),
    ({}, False),
], ids=["enabled", "allow-listed", "not-allow-listed", "off"])
def test_load_plugins_finds_the_entry_point(env: dict[str, str], wrapped: bool) -> None:
    """SGLang's own load_plugins() in a fresh interpreter (it loads once per process)."""
    out = _run_python(LOAD_PLUGINS, env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"WRAPPED {wrapped} {wrapped}" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


@needs_sglang
def test_load_plugins_reports_bad_settings_clearly() -> None:
    out = _run_python(LOAD_PLUGINS, {"PCIE_AR_SGLANG_ENABLE": "1", "PCIE_AR_SGLANG_MODE": "fast"})
    assert "WRAPPED False False" in out.stdout
    assert "PCIE_AR_SGLANG_MODE='fast': expected one of pcie, always" in out.stdout + out.stderr


@needs_sglang
@pytest.mark.parametrize("enable", ["1", "0"])
def test_import_hook_attaches_without_the_plugin_framework(tmp_path, enable: str) -> None:
    """The .pth line + finder path (for SGLang versions without plugins), forced with ATTACH=import."""
    from sglang_plugin import import_hook

    assert import_hook.main(["install", "--site-dir", str(tmp_path)]) == 0
    assert (tmp_path / import_hook.PTH_NAME).read_text() == import_hook.PTH_LINE
    code = f"""
        import site, sys
        site.addsitedir({str(tmp_path)!r})   # what site.py does for site-packages at start-up
        from sglang.srt.distributed.device_communicators import custom_all_reduce as car
        from sglang_plugin.registry import REGISTRY
        state = REGISTRY.state
        print("WRAPPED", hasattr(car.dispatch_custom_allreduce, "__wrapped__"), state and state.attach)
        from sglang_plugin import plugin
        plugin.unregister()
        print("AFTER", hasattr(car.dispatch_custom_allreduce, "__wrapped__"))
    """
    out = _run_python(code, {"PCIE_AR_SGLANG_ENABLE": enable, "PCIE_AR_SGLANG_ATTACH": "import"})
    assert out.returncode == 0, out.stderr[-3000:]
    want = "WRAPPED True import" if enable == "1" else "WRAPPED False None"
    assert want in out.stdout and "AFTER False" in out.stdout, out.stdout + out.stderr[-3000:]
    assert import_hook.main(["uninstall", "--site-dir", str(tmp_path)]) == 0
    assert not (tmp_path / import_hook.PTH_NAME).exists()


# ---------------------------------------------------------------------------- the adapter, on CPU


def _cpu_facts(unavailable_on: int | None):
    def facts(device) -> RankFacts:
        rank = dist.get_rank()
        reason = "no GPU (test)" if rank == unavailable_on else None
        return RankFacts(host="testhost", unavailable=reason, physical_gpu=rank, sm="SM120")
    return facts


def _coordinator(ctx, name: str, use_custom_allreduce: bool = True):
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    return GroupCoordinator(group_ranks=[list(range(ctx.world_size))], local_rank=ctx.rank,
                            torch_distributed_backend="gloo", use_pynccl=False, use_mscclpp=False,
                            use_custom_allreduce=use_custom_allreduce, use_torch_symm_mem_all_reduce=False,
                            use_hpu_communicator=False, use_xpu_communicator=False, group_name=name)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _current_stream_of_the_cpu_ranks() -> None:
    """Where torch is a CUDA build on a machine without a GPU: SGLang's graph_capture() asks for the
    current stream of torch's build-time accelerator (CUDA, which then fails for want of a driver),
    not of the group's device; give it the CPU stream, which is what it finds under a CPU build of
    torch, where nothing is replaced."""
    from sglang.srt.distributed import parallel_state

    if torch.get_device_module() is not torch.cpu and not torch.accelerator.is_available():
        parallel_state.get_current_device_stream_fast = torch.cpu.current_stream


def _plugin_rank(ctx, unavailable_on: int | None = None) -> dict:
    """One rank: SGLang's load_plugins() loads the plugin, SGLang's GroupCoordinator uses it."""
    ensure_entry_point()
    from sglang.srt.plugins import load_plugins

    from sglang_plugin import plugin
    from sglang_plugin.adapter import PcieAllReduceAdapter
    from sglang_plugin.registry import REGISTRY

    lines = _Lines()
    logging.getLogger("sglang_plugin").addHandler(lines)
    logging.getLogger("sglang_plugin").setLevel(logging.INFO)
    load_plugins()
    state = REGISTRY.state
    assert state is not None, "load_plugins() did not run the plugin's entry point"
    # The two test seams: our communicator and the GPU facts (see GlooCommunicator).
    state.communicator_factory = GlooCommunicator
    state.facts_fn = _cpu_facts(unavailable_on)
    out: dict = {}

    tp = _coordinator(ctx, "tp")
    out["ca_comm"] = type(tp.ca_comm).__name__
    out["lines"] = [line for line in lines.lines if line.startswith("pcie_allreduce[sglang] rank ")]
    if unavailable_on is not None:
        return out
    adapter = tp.ca_comm
    assert isinstance(adapter, PcieAllReduceAdapter) and not adapter.disabled
    comm = adapter.comm

    # Dispatch, exactly as GroupCoordinator.all_reduce resolves it for a CUDA tensor.
    small = torch.full((4, 7168), float(ctx.rank + 1), dtype=torch.bfloat16)
    out["method_small"] = tp._resolve_outplace_all_reduce_method(small)
    out["method_large"] = tp._resolve_outplace_all_reduce_method(torch.zeros(8 << 20, dtype=torch.bfloat16))
    out["method_strided"] = tp._resolve_outplace_all_reduce_method(small.t())
    out["method_int"] = tp._resolve_outplace_all_reduce_method(torch.zeros(16, dtype=torch.int32))
    out["method_empty"] = tp._resolve_outplace_all_reduce_method(torch.zeros(0, dtype=torch.bfloat16))

    # The outplace op's body: a NEW tensor holding the sum, input untouched.
    before = small.clone()
    reduced = tp._all_reduce_out_place(small, "ca")
    expected = ctx.world_size * (ctx.world_size + 1) / 2
    out["sum_ok"] = bool(torch.equal(reduced, torch.full_like(small, expected)))
    out["input_untouched"] = bool(torch.equal(small, before)) and reduced.data_ptr() != small.data_ptr()
    out["auto_sum_ok"] = bool(torch.equal(tp._all_reduce_out_place(small, "auto"), reduced))

    # graph_capture(): ca_comm.capture() agrees on the stream's workspace, flags capturing.
    _current_stream_of_the_cpu_ranks()
    with tp.graph_capture() as graph_ctx:
        out["capturing_inside"] = adapter._IS_CAPTURING
        out["capture_stream"] = type(graph_ctx.stream).__name__
    out["capturing_after"] = adapter._IS_CAPTURING

    # SGLang's GroupCoordinator.fused_allreduce_rmsnorm probes the adapter's fused method.
    x = torch.randn(4, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(ctx.rank))
    residual = torch.randn(4, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(99))
    weight = torch.rand(64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(98))
    normed, new_residual = tp.fused_allreduce_rmsnorm(x, residual, weight, 1e-6)
    plain = tp._all_reduce_out_place(x, "ca")  # the unfused path: all-reduce, then add + norm
    out["fused_residual_equal"] = bool(torch.equal(new_residual, residual + plain))
    out["fused_norm_equal"] = bool(torch.equal(normed, rmsnorm(residual + plain, weight, 1e-6)))
    out["fused_declines_3d"] = tp.fused_allreduce_rmsnorm(x.view(2, 2, 64), residual.view(2, 2, 64), weight, 1e-6)

    # The fused-op hook, through SGLang's runtime context (attention-TP group = this tp group).
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_tp_group=tp, attn_tp_size=ctx.world_size, attn_tp_rank=ctx.rank):
        hooked = hooks.flashinfer_allreduce_residual_rmsnorm(
            lambda *a: (None, None), x, residual, weight, 1e-6, use_attn_tp_group=True)
        out["op_hook_equal"] = bool(torch.equal(hooked[0], normed) and torch.equal(hooked[1], new_residual))
        out["gate_open"] = hooks.flashinfer_ar_fusion_applies(lambda b: False, 4)
        out["gate_closed_big"] = hooks.flashinfer_ar_fusion_applies(lambda b: False, 4096)
        out["gate_sglang_wins"] = hooks.flashinfer_ar_fusion_applies(lambda b: True, 4096)

    # A group the plugin does not serve keeps SGLang's choice (on a CPU that is: no ca_comm).
    other = _coordinator(ctx, "pp")
    out["pp_ca_comm"] = type(other.ca_comm).__name__
    out["calls"] = [c[0] for c in comm.calls]

    # After unregister(), new groups get SGLang's own dispatch again.
    assert plugin.unregister()
    out["after_unregister"] = type(_coordinator(ctx, "tp").ca_comm).__name__
    adapter.close()
    out["closed"] = comm.closed and adapter.disabled
    out["cuda_started"] = torch.cuda.is_initialized()
    return out


def _plugin_env(**extra: str) -> dict[str, str]:
    return {"PCIE_AR_SGLANG_ENABLE": "1", "PCIE_AR_SGLANG_MODE": "always", "SGLANG_PLUGINS": "pcie_allreduce",
            "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]), **extra}


@needs_sglang
@pytest.mark.parametrize("world", [2, 4])
def test_group_coordinator_uses_the_adapter(world: int) -> None:
    results = ranks.run_ranks(_plugin_rank, world, gpu=False, timeout_s=240, env=_plugin_env())
    for rank, r in enumerate(results):
        assert r["ca_comm"] == "PcieAllReduceAdapter"
        assert len(r["lines"]) == 1, r["lines"]
        line = r["lines"][0]
        assert f"rank {rank}/{world} group tp" in line and "-> pcie_allreduce" in line and "why: mode=always" in line
        assert "oneshot<=256KiB, twoshot<=8MiB" in line and "fused all-reduce+residual+RMSNorm" in line
        per_stream = Layout.make(8 << 20, world).total_bytes
        assert f"workspaces {per_stream / 2**20:.0f} MiB of GPU memory per stream" in line
        assert r["method_small"] == "ca"
        assert r["method_large"] is None and r["method_strided"] is None
        assert r["method_int"] is None and r["method_empty"] is None
        assert r["sum_ok"] and r["input_untouched"]
        assert r["auto_sum_ok"]
        assert r["capturing_inside"] is True and r["capturing_after"] is False
        assert r["fused_residual_equal"] and r["fused_norm_equal"] and r["fused_declines_3d"] is None
        assert r["op_hook_equal"] and r["gate_open"] and not r["gate_closed_big"] and r["gate_sglang_wins"]
        assert r["pp_ca_comm"] == "NoneType"
        assert r["after_unregister"] == "NoneType" and r["closed"]
        assert r["cuda_started"] is False, "a CPU rank started CUDA"
        assert "all_reduce_rmsnorm" in r["calls"]
    assert len({tuple(r["calls"]) for r in results}) == 1, "ranks issued different call sequences"


@needs_sglang
def test_all_ranks_decline_together_and_say_why() -> None:
    results = ranks.run_ranks(_plugin_rank, 2, 1, gpu=False, timeout_s=240, env=_plugin_env())
    for r in results:
        assert r["ca_comm"] == "NoneType"  # SGLang's own dispatch ran (and, on a CPU, built nothing)
        assert len(r["lines"]) == 1 and "not serving" in r["lines"][0]
        assert "why: rank 1 cannot run the kernels: no GPU (test)" in r["lines"][0]


# ---------------------------------------------------------------------------- every forward step


class _Failed:
    """An adapter whose communicator recorded a failure (a collective in a replayed graph timed out)."""

    disabled = False

    class comm:  # noqa: N801 - the adapter's attribute
        @staticmethod
        def check() -> None:
            from pcie_allreduce.errors import CollectiveTimeout

            raise CollectiveTimeout("rank 1 waited more than 10 s for rank 0 in one-shot gather of call #99")


@needs_sglang
@pytest.mark.parametrize("attach", ["plugin", "import"])
@pytest.mark.parametrize("loaded_first", [True, False])
def test_every_forward_step_raises_a_recorded_failure_first(monkeypatch: pytest.MonkeyPatch, attach: str,
                                                            loaded_first: bool) -> None:
    """ModelRunner.forward is hooked whether its module was imported before the plugin installed
    or after (the finder attaches it then, in both attach modes, and the plugin never imports it);
    a step runs untouched while every adapter is healthy and raises the recorded failure before
    running once one is not; unregister puts the original back."""
    from pcie_allreduce.errors import CollectiveTimeout
    from sglang_plugin import import_hook, plugin
    from sglang_plugin.registry import REGISTRY

    module = fake_model_runner_module()
    name = module.__name__
    original = module.ModelRunner.forward
    if loaded_first:
        monkeypatch.setitem(sys.modules, name, module)
    else:
        monkeypatch.delitem(sys.modules, name, raising=False)
    plugin.unregister()
    try:
        state = plugin.install(Settings(enabled=True, fused=False), attach=attach)
        if not loaded_first:
            assert module.ModelRunner.forward is original, "hooked before its module was imported"
            assert any(isinstance(f, import_watch._Finder) for f in sys.meta_path), "nothing watches for it"
            monkeypatch.setitem(sys.modules, name, module)
            import_hook.on_module_loaded(name)  # what the finder's loader does after the module ran
        assert hooks.FORWARD_STEP in state.targets
        runner = module.ModelRunner()
        assert runner.forward("batch", split_forward_count=2) == ("ran", "batch", 2)
        state.adapters.add(failed := _Failed())
        with pytest.raises(CollectiveTimeout, match="call #99"):
            runner.forward("batch")
        state.adapters.discard(failed)
    finally:
        plugin.unregister()
    assert module.ModelRunner.forward is original and REGISTRY.state is None
    assert not any(isinstance(f, import_watch._Finder) for f in sys.meta_path)
