"""CPU conformance tests of the SGLang plugin against SGLang's real code (pinned 0.5.23).

What runs on a CPU: SGLang's real ``GroupCoordinator`` (gloo groups), ``load_plugins()``,
``HookRegistry``, ``graph_capture()`` and ``fused_allreduce_rmsnorm``. The one substitution is
ours, not SGLang's: a gloo-backed stand-in for ``pcie_allreduce.Communicator`` (whose kernels
need a GPU) and the per-rank GPU facts the eligibility decision gathers. SGLang's custom ops
(``outplace_all_reduce``) are registered for CUDA only, so the CPU tests call the coordinator
methods those ops run; tests/test_sglang_gpu.py drives the ops themselves.

Tests that need SGLang skip with the reason when it is not importable.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from pcie_allreduce import plugin_surface
from pcie_allreduce.tools import ranks
from pcie_allreduce.layout import Layout
from pcie_allreduce.plugin_eligibility import Decision, RankFacts
from sglang_plugin import hooks, import_watch, patching, settings as settings_mod, surface
from pcie_allreduce.settings import format_bytes
from sglang_plugin.settings import Settings, SettingsError
from tests._sglang import ensure_entry_point, fake_model_runner_module, sglang_skip_reason
from tests._standins import GlooCommunicator, rmsnorm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SGLANG_SKIP = sglang_skip_reason()
needs_sglang = pytest.mark.skipif(SGLANG_SKIP is not None, reason=SGLANG_SKIP or "")


def test_sglang_is_importable_where_required() -> None:
    """CI sets PCIE_AR_REQUIRE_SGLANG=1 after installing SGLang, so a broken install fails
    instead of skipping every conformance test."""
    if os.environ.get("PCIE_AR_REQUIRE_SGLANG") == "1":
        assert SGLANG_SKIP is None, SGLANG_SKIP


# ---------------------------------------------------------------------------- settings


def test_settings_defaults_are_off_and_documented() -> None:
    s = settings_mod.from_env({})
    assert s == Settings() and not s.enabled and s.max_bytes == 8 << 20 and s.mode == "pcie" and s.fused
    assert s.multinode
    assert s.wire == "exact" and s.wire_min_bytes == 1 << 20
    assert settings_mod.DOCS[settings_mod.WIRE_MIN_BYTES][0] == format_bytes(s.wire_min_bytes)
    names = {getattr(settings_mod, n) for n in ("ENABLE", "MAX_BYTES", "ALGO", "MODE", "FUSED", "TIMEOUT_S", "ATTACH",
                                                "MULTINODE", "WIRE", "WIRE_MIN_BYTES")}
    assert names == set(settings_mod.DOCS)
    assert all(n.startswith(settings_mod.PREFIX) for n in names)


def test_settings_parse_values() -> None:
    s = settings_mod.from_env({"PCIE_AR_SGLANG_ENABLE": "yes", "PCIE_AR_SGLANG_MAX_BYTES": "512KiB",
                               "PCIE_AR_SGLANG_ALGO": "TwoShot", "PCIE_AR_SGLANG_MODE": "always",
                               "PCIE_AR_SGLANG_FUSED": "off", "PCIE_AR_SGLANG_TIMEOUT_S": "2.5",
                               "PCIE_AR_SGLANG_ATTACH": "import", "PCIE_AR_SGLANG_MULTINODE": "0", "UNRELATED": "x"})
    assert s == Settings(enabled=True, max_bytes=512 << 10, algo="twoshot", mode="always", fused=False,
                         timeout_s=2.5, attach="import", multinode=False)
    assert settings_mod.from_env({"PCIE_AR_SGLANG_MAX_BYTES": "1048576"}).max_bytes == 1 << 20
    wired = settings_mod.from_env({"PCIE_AR_SGLANG_WIRE": "FP8", "PCIE_AR_SGLANG_WIRE_MIN_BYTES": "4MiB"})
    assert (wired.wire, wired.wire_min_bytes) == ("fp8", 4 << 20)
    assert "wire=fp8>=4MiB" in settings_mod.describe(wired)
    assert "wire" not in settings_mod.describe(Settings())
    assert settings_mod.from_env({"PCIE_AR_SGLANG_MAX_BYTES": "2m"}).max_bytes == 2 << 20


@pytest.mark.parametrize("name,value,needle", [
    ("PCIE_AR_SGLANG_ENABLE", "maybe", "expected 1 or 0"),
    ("PCIE_AR_SGLANG_MAX_BYTES", "lots", "byte count"),
    ("PCIE_AR_SGLANG_MAX_BYTES", "0", "must be between 1 byte and 256MiB"),
    ("PCIE_AR_SGLANG_MAX_BYTES", "1G", "must be between 1 byte and 256MiB"),
    ("PCIE_AR_SGLANG_MAX_BYTES", "8 parsecs", "byte count"),
    ("PCIE_AR_SGLANG_ALGO", "fastest", "auto, oneshot, staged, twoshot"),
    ("PCIE_AR_SGLANG_MODE", "nvlink", "pcie, always"),
    ("PCIE_AR_SGLANG_TIMEOUT_S", "-1", "number of seconds in (0, 86400]"),
    ("PCIE_AR_SGLANG_TIMEOUT_S", "1e30", "number of seconds in (0, 86400]"),
    ("PCIE_AR_SGLANG_TIMEOUT_S", "nan", "number of seconds in (0, 86400]"),
    ("PCIE_AR_SGLANG_TIMEOUT_S", "soon", "seconds"),
    ("PCIE_AR_SGLANG_ATTACH", "magic", "auto, plugin, import"),
    ("PCIE_AR_SGLANG_MAXBYTES", "1", "unknown setting(s) PCIE_AR_SGLANG_MAXBYTES"),
    ("PCIE_AR_SGLANG_WIRE", "int4", "exact, fp8"),
    ("PCIE_AR_SGLANG_WIRE_MIN_BYTES", "big", "byte count"),
])
def test_settings_errors_name_the_variable(name: str, value: str, needle: str) -> None:
    with pytest.raises(SettingsError) as info:
        settings_mod.from_env({name: value})
    assert name in str(info.value) and needle in str(info.value)


def test_a_compressed_wire_and_a_forced_algorithm_are_one_too_many() -> None:
    with pytest.raises(SettingsError) as info:
        settings_mod.from_env({"PCIE_AR_SGLANG_WIRE": "fp8", "PCIE_AR_SGLANG_ALGO": "twoshot"})
    assert "PCIE_AR_SGLANG_WIRE=fp8" in str(info.value) and "PCIE_AR_SGLANG_ALGO=twoshot" in str(info.value)


def test_format_bytes() -> None:
    assert format_bytes(8 << 20) == "8MiB"
    assert format_bytes(1536) == "1536B"
    assert format_bytes(3 << 10) == "3KiB"


# ---------------------------------------------------------------------------- packaging


def test_pyproject_declares_the_entry_point() -> None:
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    eps = project.get("entry-points", {}).get("sglang.srt.plugins", {})
    assert eps.get("pcie_allreduce") == "sglang_plugin.plugin:register", (
        'pyproject.toml needs [project.entry-points."sglang.srt.plugins"] '
        'pcie_allreduce = "sglang_plugin.plugin:register"')


def test_import_hook_watches_exactly_the_hook_modules() -> None:
    from sglang_plugin import import_hook

    assert set(import_watch.watched_modules()) == import_watch._WATCHED_NAMES


def test_launcher_turns_the_plugin_on_and_extends_the_allow_list() -> None:
    from sglang_plugin.launch_server import prepare_environment

    env = {"SGLANG_PLUGINS": "other"}
    assert prepare_environment(env).enabled
    assert env == {"SGLANG_PLUGINS": "other,pcie_allreduce", "PCIE_AR_SGLANG_ENABLE": "1"}
    env = {"PCIE_AR_SGLANG_ENABLE": "0"}
    assert not prepare_environment(env).enabled  # an explicit 0 wins
    with pytest.raises(SettingsError):
        prepare_environment({"PCIE_AR_SGLANG_MODE": "x"})


def test_launcher_without_sglang_names_the_version_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from sglang_plugin import launch_server

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sglang" else real_find_spec(name, *a))
    with pytest.raises(SystemExit) as exc:
        launch_server.main(["--help"])
    message = str(exc.value)
    assert "SGLang is not installed" in message
    assert f"sglang=={surface.SUPPORTED_SGLANG_VERSIONS[-1]}" in message


def test_package_import_is_light() -> None:
    code = "import sys, sglang_plugin, sglang_plugin.import_hook; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", "the .pth line imports sglang_plugin in every interpreter"


# ---------------------------------------------------------------------------- SGLang's surface


@needs_sglang
@pytest.mark.parametrize("target", hooks.TARGETS, ids=lambda t: t.target.rsplit(".", 1)[-1])
def test_hook_targets_have_the_expected_signature(target: hooks.HookTarget) -> None:
    """Each hook repeats its target's parameters (and defaults); read from the imported function,
    or from SGLang's source file where the module needs packages a CPU machine lacks."""
    want = surface.hook_parameters(target.hook)
    try:
        patching.resolve(target.target)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "sglang":
            raise
        # The module imports transformers/torchvision (SGLang's model layers); read the source.
        assert plugin_surface.source_parameters(target.target) == want
        return
    problem = surface.hook_problem(target.target, target.hook)
    assert problem is None, problem


@needs_sglang
@pytest.mark.parametrize("expect", surface.EXPECTED, ids=lambda e: e.path.rsplit(".", 2)[-2] + "." + e.path.rsplit(".", 1)[-1])
def test_sglang_surface_the_plugin_relies_on(expect: surface.Expectation) -> None:
    try:
        have = surface.resolve_parameters(expect.path)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "sglang":
            raise
        have = plugin_surface.source_parameters(expect.path)  # module needs packages CPU CI lacks
    assert have == expect.params, f"{expect.path}: {have} != {expect.params} ({expect.why})"


@needs_sglang
def test_adapter_mirrors_sglang_custom_allreduce_surface() -> None:
    from sglang.srt.distributed.device_communicators.custom_all_reduce import CustomAllreduce

    from sglang_plugin.adapter import PcieAllReduceAdapter

    for name in ("should_custom_ar", "capture", "close"):
        assert surface.parameters(getattr(PcieAllReduceAdapter, name)) == surface.parameters(
            getattr(CustomAllreduce, name)), name
    # custom_all_reduce also takes the V2 interface's override_algo, after 0.5.23's parameters.
    ours, theirs = surface.parameters(PcieAllReduceAdapter.custom_all_reduce), surface.parameters(
        CustomAllreduce.custom_all_reduce)
    assert ours[:len(theirs)] == theirs and ours == surface.V2_CUSTOM_ALL_REDUCE
    gc_fused = surface.resolve_parameters(surface.GC + ".fused_allreduce_rmsnorm")
    assert surface.parameters(PcieAllReduceAdapter.fused_allreduce_rmsnorm) == gc_fused


@needs_sglang
def test_sglang_plugin_framework_constants() -> None:
    import sglang.srt.plugins as plugins
    from sglang.srt.environ import envs
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType, _propagate_patch  # noqa: F401

    assert plugins.GENERAL_PLUGINS_GROUP == "sglang.srt.plugins"
    assert hasattr(envs, "SGLANG_PLUGINS") and HookType.AROUND.value == "around"
    assert isinstance(HookRegistry._hooks, dict) and isinstance(HookRegistry._patched, set)


@needs_sglang
def test_fused_gate_size_limit_matches_sglang() -> None:
    src = plugin_surface.package_root("sglang") + "/srt/layers/layer_boundary/residual/add_norm.py"
    with open(src, encoding="utf-8") as f:
        assert f"FUSE_ALLREDUCE_MAX_BATCH_SIZE = {hooks.MAX_FUSED_BATCH}" in f.read()


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


class _Capped:
    """A communicator as the adapter sees it, on ``transport``, raising as the real one does for a
    forced algorithm the message does not fit."""

    device, rank, world_size, max_bytes, island_ranks = torch.device("cpu"), 0, 2, 8 << 20, 0

    def __init__(self, *args, transport: str = "p2p", **kwargs) -> None:
        self.transport = transport
        self.ll_capacity = Layout.make(self.max_bytes, self.world_size).ll_capacity
        self.launched: list[str] = []

    def check(self) -> None:
        pass

    def capacity_of(self, algo: str) -> int | None:
        from pcie_allreduce.plan import algorithms, tables

        return algorithms.capacity_of(algo, self.ll_capacity)

    def all_reduce(self, x, out=None, algo="auto"):
        from pcie_allreduce.plan import algorithms, tables
        from pcie_allreduce.plan import dispatch

        problem = algorithms.call_problem(algo, x.numel() * x.element_size(), x.element_size(), self.transport, 0,
                                          1 << 30, self.ll_capacity)
        if problem is not None:  # raises as the communicator would
            raise ValueError(problem)
        dispatch.plain_choice(x.numel() * x.element_size(), self.world_size, x.dtype, tables.default_table(),
                              ll_capacity=self.ll_capacity, algo=algo)  # raises as the communicator would
        if not algorithms.runs_on(algo, self.transport):
            raise ValueError(f"algo={algo!r} runs on the host transport only")
        self.launched.append(algo)
        return x.clone()


@pytest.mark.parametrize("algo", ["oneshot_ll", "oneshot_full", "twoshot_full", "host_oneshot", "host_twoshot",
                                  "oneshot", "twoshot", "auto"])
@pytest.mark.parametrize("transport", ["p2p", "host"])
def test_a_forced_algorithm_declines_what_it_cannot_take(algo: str, transport: str) -> None:
    """Declined calls take SGLang's own path; the served ones never raise in the forward pass."""
    from pcie_allreduce.plan import algorithms, tables
    from sglang_plugin.adapter import PcieAllReduceAdapter

    adapter = PcieAllReduceAdapter(None, "cpu", Settings(enabled=True, algo=algo),
                                   communicator_factory=lambda *a, **k: _Capped(transport=transport))
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


def test_a_wire_threshold_above_the_largest_all_reduce_is_an_error_naming_both() -> None:
    with pytest.raises(SettingsError) as info:
        settings_mod.from_env({"PCIE_AR_SGLANG_WIRE": "fp8", "PCIE_AR_SGLANG_MAX_BYTES": "4MiB",
                               "PCIE_AR_SGLANG_WIRE_MIN_BYTES": "8MiB"})
    assert "PCIE_AR_SGLANG_WIRE_MIN_BYTES=8MiB is above PCIE_AR_SGLANG_MAX_BYTES=4MiB" in str(info.value)
    same = settings_mod.from_env({"PCIE_AR_SGLANG_WIRE": "fp8", "PCIE_AR_SGLANG_MAX_BYTES": "4MiB",
                                  "PCIE_AR_SGLANG_WIRE_MIN_BYTES": "4MiB"})
    assert same.wire_min_bytes == same.max_bytes == 4 << 20
    exact = settings_mod.from_env({"PCIE_AR_SGLANG_MAX_BYTES": "4MiB", "PCIE_AR_SGLANG_WIRE_MIN_BYTES": "8MiB"})
    assert exact.wire == "exact"  # the threshold of no wire is no contradiction


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
