"""CPU conformance tests of the vLLM plugin against vLLM's real code (pinned 0.34.0).

What runs on a CPU: vLLM's plugin loader (``load_general_plugins``), its real ``CudaCommunicator``
and ``GroupCoordinator`` on gloo ranks (the communicator builds its ``ca_comm`` through the class
the plugin put in place), its ``torch.ops.vllm.all_reduce`` and IR ``fused_add_rms_norm`` ops in
an FX graph the plugin's compile pass rewrites, and its ``CompilationConfig`` resolving the pass by
name. The one substitution is ours, not vLLM's: a gloo-backed stand-in for
``pcie_allreduce.Communicator`` (its kernels need a GPU) and the per-rank GPU facts.

Tests that need vLLM skip with the reason when it is not importable (CI sets
PCIE_AR_REQUIRE_VLLM=1 after installing it, so a broken install fails instead).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pcie_allreduce import plugin_settings
from pcie_allreduce.tools import ranks
from pcie_allreduce.settings import SettingsError
from sglang_plugin import settings as sglang_settings
from tests._standins import CappedCommunicator, GlooCommunicator
from tests._vllm import REPO, cpu_facts, ensure_entry_point, plugin_env, tp_group, vllm_skip_reason
from vllm_plugin import settings as settings_mod
from pcie_allreduce.plugin_eligibility import RankFacts
from vllm_plugin.settings import Settings

VLLM_SKIP = vllm_skip_reason()
needs_vllm = pytest.mark.skipif(VLLM_SKIP is not None, reason=VLLM_SKIP or "")


def test_vllm_is_importable_where_required() -> None:
    if os.environ.get("PCIE_AR_REQUIRE_VLLM") == "1":
        assert VLLM_SKIP is None, VLLM_SKIP


# ---------------------------------------------------------------------------- settings


def test_settings_defaults_are_off_and_shared_with_sglang() -> None:
    s = settings_mod.from_env({})
    assert s == Settings() and not s.enabled and s.max_bytes == 8 << 20 and s.mode == "pcie" and s.fused
    assert s.timeout_s == 300 and s.wire == "exact" and s.wire_min_bytes == 1 << 20
    assert all(n.startswith("PCIE_AR_VLLM_") for n in settings_mod.DOCS)
    # Every vLLM setting is an SGLang one under the other prefix.
    assert {n.removeprefix(settings_mod.PREFIX) for n in settings_mod.DOCS} <= {
        n.removeprefix(sglang_settings.PREFIX) for n in sglang_settings.DOCS}
    assert settings_mod.ALGO == plugin_settings.names("PCIE_AR_VLLM_").algo


@pytest.mark.parametrize("module", [settings_mod, sglang_settings], ids=["vllm", "sglang"])
def test_each_documented_default_is_what_the_code_does_when_unset(module) -> None:
    """Setting a variable to the default its documentation gives changes nothing: the docs' defaults
    are the parser's, for every setting of both plugins."""
    unset = module.from_env({})
    for name, (default, _) in module.DOCS.items():
        assert module.from_env({name: default}) == unset, (name, default)


def test_settings_parse_values() -> None:
    s = settings_mod.from_env({"PCIE_AR_VLLM_ENABLE": "yes", "PCIE_AR_VLLM_MAX_BYTES": "512KiB",
                               "PCIE_AR_VLLM_ALGO": "TwoShot", "PCIE_AR_VLLM_MODE": "always",
                               "PCIE_AR_VLLM_FUSED": "off", "PCIE_AR_VLLM_TIMEOUT_S": "2.5", "OTHER": "x"})
    assert s == Settings(enabled=True, max_bytes=512 << 10, algo="twoshot", mode="always", fused=False,
                         timeout_s=2.5)
    wired = settings_mod.from_env({"PCIE_AR_VLLM_WIRE": "FP8", "PCIE_AR_VLLM_WIRE_MIN_BYTES": "4MiB"})
    assert (wired.wire, wired.wire_min_bytes) == ("fp8", 4 << 20) and "wire=fp8>=4MiB" in settings_mod.describe(wired)


@pytest.mark.parametrize("name,value,needle", [
    ("PCIE_AR_VLLM_ENABLE", "maybe", "expected 1 or 0"),
    ("PCIE_AR_VLLM_MAX_BYTES", "lots", "byte count"),
    ("PCIE_AR_VLLM_MAX_BYTES", "1G", "must be between 1 byte and 256MiB"),
    ("PCIE_AR_VLLM_ALGO", "fastest", "auto, oneshot, staged, twoshot"),
    ("PCIE_AR_VLLM_MODE", "nvlink", "pcie, always"),
    ("PCIE_AR_VLLM_FUSED", "2", "expected 1 or 0"),
    ("PCIE_AR_VLLM_TIMEOUT_S", "nan", "number of seconds in (0, 86400]"),
    ("PCIE_AR_VLLM_WIRE", "int4", "exact, fp8"),
    ("PCIE_AR_VLLM_WIRE_MIN_BYTES", "big", "byte count"),
    ("PCIE_AR_VLLM_MAXBYTES", "1", "unknown setting(s) PCIE_AR_VLLM_MAXBYTES"),
])
def test_settings_errors_name_the_variable(name: str, value: str, needle: str) -> None:
    with pytest.raises(SettingsError) as info:
        settings_mod.from_env({name: value})
    assert name in str(info.value) and needle in str(info.value)


def test_contradictory_settings_name_both() -> None:
    with pytest.raises(SettingsError, match="PCIE_AR_VLLM_WIRE=fp8 .* PCIE_AR_VLLM_ALGO=twoshot"):
        settings_mod.from_env({"PCIE_AR_VLLM_WIRE": "fp8", "PCIE_AR_VLLM_ALGO": "twoshot"})
    with pytest.raises(SettingsError, match="PCIE_AR_VLLM_WIRE_MIN_BYTES=8MiB is above PCIE_AR_VLLM_MAX_BYTES=4MiB"):
        settings_mod.from_env({"PCIE_AR_VLLM_WIRE": "fp8", "PCIE_AR_VLLM_MAX_BYTES": "4MiB",
                               "PCIE_AR_VLLM_WIRE_MIN_BYTES": "8MiB"})


# ---------------------------------------------------------------------------- packaging


def test_pyproject_declares_the_package_and_entry_point() -> None:
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        pyproject = tomllib.load(f)
    eps = pyproject["project"]["entry-points"]["vllm.general_plugins"]
    assert eps == {"pcie_allreduce": "vllm_plugin.plugin:register"}
    assert {"vllm_plugin", "vllm_plugin.*"} <= set(pyproject["tool"]["setuptools"]["packages"]["find"]["include"])


def test_package_imports_without_vllm_and_then_without_torch() -> None:
    code = ("import sys; sys.modules['vllm'] = None; import vllm_plugin, vllm_plugin.settings; "
            "print('torch' in sys.modules, hasattr(vllm_plugin, 'fuse_allreduce_rmsnorm'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"


# ---------------------------------------------------------------------------- vLLM's surface


@needs_vllm
def test_vllm_surface_the_plugin_relies_on() -> None:
    from vllm_plugin import surface

    wrong = {e.path: surface.parameters(e.path) for e in surface.EXPECTED if surface.parameters(e.path) != e.params}
    assert not wrong, wrong


@needs_vllm
def test_adapter_answers_everything_cuda_communicator_asks() -> None:
    """Every CustomAllreduce method vLLM calls on ca_comm exists on the adapter with vLLM's parameters."""
    import inspect

    from vllm.distributed.device_communicators.custom_all_reduce import CustomAllreduce

    from vllm_plugin.adapter import VllmAllReduceAdapter

    for name in ("should_custom_ar", "custom_all_reduce", "capture", "close", "register_graph_buffers",
                 "should_custom_all_gather", "custom_all_gather", "should_custom_reduce_scatter",
                 "should_mnnvl_multimem_reduce_scatter", "custom_reduce_scatter"):
        assert (list(inspect.signature(getattr(VllmAllReduceAdapter, name)).parameters)
                == list(inspect.signature(getattr(CustomAllreduce, name)).parameters)), name
    assert VllmAllReduceAdapter.fully_connected is False and VllmAllReduceAdapter.mnnvl_lamport_ag_multicast_ptr == 0


LOAD = """
    import logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    from tests._vllm import ensure_entry_point
    ensure_entry_point()
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm.distributed.device_communicators import custom_all_reduce as car
    from vllm_plugin import plugin
    print("PATCHED", car.CustomAllreduce is not plugin.STATE.original if plugin.STATE else False)
"""


def _run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PCIE_AR_VLLM_", "VLLM_PLUGINS"))}
    full.update(env)
    full["PYTHONPATH"] = os.pathsep.join([REPO, full.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=300)


@needs_vllm
@pytest.mark.parametrize("env,patched", [
    ({"PCIE_AR_VLLM_ENABLE": "1"}, True),
    ({"PCIE_AR_VLLM_ENABLE": "1", "VLLM_PLUGINS": "pcie_allreduce"}, True),
    ({"PCIE_AR_VLLM_ENABLE": "1", "VLLM_PLUGINS": "someone_else"}, False),
    ({}, False),
], ids=["enabled", "allow-listed", "not-allow-listed", "off"])
def test_vllm_plugin_loader_loads_the_plugin_and_it_logs_its_line(env: dict[str, str], patched: bool) -> None:
    out = _run_python(LOAD, env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"PATCHED {patched}" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("pcie_allreduce[vllm]: on (")]
    assert len(lines) == (1 if patched else 0), out.stdout
    if patched:
        assert "vLLM's tp custom all-reduce (CudaCommunicator.ca_comm) -> pcie_allreduce" in lines[0]
        assert "max_bytes=8MiB algo=auto mode=pcie fused=1 timeout_s=300" in lines[0]


@needs_vllm
def test_a_bad_setting_is_logged_by_name_and_vllm_runs_without_the_plugin() -> None:
    out = _run_python(LOAD, {"PCIE_AR_VLLM_ENABLE": "1", "PCIE_AR_VLLM_MODE": "fast"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "PATCHED False" in out.stdout
    assert "PCIE_AR_VLLM_MODE='fast': expected one of pcie, always" in out.stdout + out.stderr


# ---------------------------------------------------------------------------- vLLM's communicator, on CPU


def _rank(ctx, unavailable_on: int | None = None) -> dict:
    """One rank: vLLM's loader loads the plugin; vLLM's CudaCommunicator builds and uses our adapter."""
    import logging

    ensure_entry_point()
    from vllm.plugins import load_general_plugins

    from vllm_plugin import plugin
    from vllm_plugin.adapter import VllmAllReduceAdapter

    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("vllm_plugin").addHandler(handler)
    logging.getLogger("vllm_plugin").setLevel(logging.INFO)
    load_general_plugins()
    assert plugin.STATE is not None, "load_general_plugins() did not run the entry point"
    plugin.STATE.communicator_factory = GlooCommunicator  # the two seams: our communicator, the GPU facts
    plugin.STATE.facts_fn = cpu_facts(unavailable_on)
    device = torch.device("cpu")
    tp = tp_group(ctx, device)
    cc = tp.device_communicator
    out: dict = {"ca_comm": type(cc.ca_comm).__name__,
                 "lines": [line for line in lines if line.startswith("pcie_allreduce[vllm] rank ")]}
    if unavailable_on is not None:
        return out
    adapter = cc.ca_comm
    assert isinstance(adapter, VllmAllReduceAdapter) and not adapter.disabled
    world = ctx.world_size
    small = torch.full((4, 7168), float(ctx.rank + 1), dtype=torch.bfloat16)
    before = small.clone()
    reduced = cc.all_reduce(small)  # CudaCommunicator's dispatch: ca_comm.should_custom_ar -> custom_all_reduce
    out["sum_ok"] = torch.equal(reduced, torch.full_like(small, world * (world + 1) / 2))
    out["out_of_place"] = torch.equal(small, before) and reduced.data_ptr() != small.data_ptr()
    out["served"] = [adapter.should_custom_ar(t) for t in (
        small, torch.zeros(8 << 20, dtype=torch.bfloat16), small.t(), torch.zeros(16, dtype=torch.int32),
        torch.zeros(0, dtype=torch.bfloat16), torch.ones(3, dtype=torch.float16))]
    big = torch.ones(8 << 20, dtype=torch.bfloat16)  # above max_bytes: vLLM's next backend (gloo here)
    out["big_ok"] = torch.equal(cc.all_reduce(big), torch.full_like(big, world))
    out["tp_op_ok"] = torch.equal(torch.ops.vllm.all_reduce(small, group_name=tp.unique_name), reduced)
    with adapter.capture():  # what GroupCoordinator.graph_capture enters with the capture stream current
        out["capturing"] = adapter._IS_CAPTURING
    out["after_capture"] = adapter._IS_CAPTURING
    out["gather_rs"] = (cc.custom_all_gather(small), cc.custom_reduce_scatter(small),
                        adapter.should_custom_all_gather(small), adapter.should_custom_reduce_scatter(small))
    # The fused op (what the compile pass puts in graphs): fused where the adapter takes it, else
    # the unfused pair; the new residual is bitwise residual + all_reduce(x) either way.
    import vllm.ir.ops  # noqa: F401 - registers vLLM's IR ops (its model code imports it)

    from vllm_plugin import ops

    gen = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    residual = torch.randn(4, 64, generator=torch.Generator().manual_seed(99)).to(torch.bfloat16)
    weight = (1 + torch.rand(64, generator=torch.Generator().manual_seed(98))).to(torch.bfloat16)
    op = torch.ops.pcie_allreduce_vllm.all_reduce_rmsnorm
    plain = cc.all_reduce(x)
    normed, new_residual = op(x, residual, weight, 1e-6, tp.unique_name)
    want_normed, want_residual = ops.engine_add_rms_norm(plain, residual, weight, 1e-6)
    out["fused_residual_bitwise"] = torch.equal(new_residual, residual + plain) and torch.equal(new_residual,
                                                                                                want_residual)
    out["fused_norm_close"] = torch.allclose(normed.float(), want_normed.float(), rtol=2 ** -7, atol=2 ** -7)
    ir_normed, ir_residual = torch.ops.vllm_ir.fused_add_rms_norm(plain, residual, weight, 1e-6)
    x3, r3 = x.view(2, 2, 64), residual.view(2, 2, 64)  # 3-D: declined by the adapter, unfused inside the op
    n3, nr3 = op(x3, r3, weight, 1e-6, tp.unique_name)
    ir3 = torch.ops.vllm_ir.fused_add_rms_norm(cc.all_reduce(x3), r3, weight, 1e-6)
    out["declined_equals_vllm"] = torch.equal(nr3, ir3[1]) and torch.equal(n3, ir3[0]) and torch.equal(
        ir_residual, new_residual)
    out["compile_pass"] = _compile_pass(tp, x, residual, weight, ir_normed, ir_residual)
    out["calls"] = [c[0] for c in adapter.comm.calls]
    assert plugin.unregister()
    cc2 = type(cc)(cpu_group=tp.cpu_group, device=device, device_group=tp.device_group, unique_name=tp.unique_name)
    out["after_unregister"] = type(cc2.ca_comm).__name__
    adapter.close()
    out["closed"] = adapter.comm.closed and adapter.disabled
    out["nccl_or_cuda"] = (cc.pynccl_comm is not None and not cc.pynccl_comm.disabled, torch.cuda.is_initialized())
    return out


def _compile_pass(tp, x, residual, weight, want_normed, want_residual) -> dict:
    """The pass on an FX graph holding vLLM's own ops as vLLM's post-grad graph does."""
    import torch.fx as fx

    from vllm_plugin import fuse_allreduce_rmsnorm

    def layer(x, residual, weight):
        reduced = torch.ops.vllm.all_reduce.default(x, tp.unique_name)
        normed, new_residual = torch.ops.vllm_ir.fused_add_rms_norm.default(reduced, residual, weight, 1e-6)
        shared = torch.ops.vllm.all_reduce.default(normed, tp.unique_name)  # used twice: left alone
        return normed * 2, new_residual, shared + shared

    gm = fx.symbolic_trace(layer)
    before = gm(x, residual, weight)
    fuse_allreduce_rmsnorm(gm.graph)  # the entry vLLM's CompilationConfig resolves by name
    gm.recompile()
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    after = gm(x, residual, weight)
    return {"fused_ops": targets.count("pcie_allreduce_vllm.all_reduce_rmsnorm.default"),
            "norm_ops": targets.count("vllm_ir.fused_add_rms_norm.default"),
            "all_reduces": targets.count("vllm.all_reduce.default"),
            "residual_bitwise": torch.equal(after[1], before[1]) and torch.equal(after[1], want_residual),
            "norm_close": torch.allclose(after[0].float(), 2 * want_normed.float(), rtol=2 ** -7, atol=2 ** -6)}


@needs_vllm
@pytest.mark.parametrize("world", [2, 4])
def test_cuda_communicator_builds_and_uses_the_adapter(world: int) -> None:
    results = ranks.run_ranks(_rank, world, gpu=False, timeout_s=300, env=plugin_env(PCIE_AR_VLLM_MODE="always"))
    for rank, r in enumerate(results):
        assert r["ca_comm"] == "VllmAllReduceAdapter", r
        assert len(r["lines"]) == 1 and f"rank {rank}/{world} cpu: all-reduce of contiguous" in r["lines"][0], r
        assert "-> pcie_allreduce over p2p" in r["lines"][0] and "why: mode=always (SM120)" in r["lines"][0]
        assert r["sum_ok"] and r["out_of_place"] and r["big_ok"] and r["tp_op_ok"], r
        assert r["served"] == [True, False, False, False, False, True], r
        assert r["capturing"] is True and r["after_capture"] is False
        assert r["gather_rs"] == (None, None, False, False)
        assert r["fused_residual_bitwise"] and r["fused_norm_close"] and r["declined_equals_vllm"], r
        assert r["compile_pass"] == {"fused_ops": 1, "norm_ops": 0, "all_reduces": 1, "residual_bitwise": True,
                                     "norm_close": True}, r["compile_pass"]
        assert "all_reduce_rmsnorm" in r["calls"] and "workspace" not in r["calls"]
        assert r["after_unregister"] == "CustomAllreduce" and r["closed"]
        assert r["nccl_or_cuda"] == (False, False), "a CPU rank started vLLM's NCCL communicator or CUDA"
    assert len({tuple(r["calls"]) for r in results}) == 1, "ranks issued different call sequences"


@needs_vllm
def test_all_ranks_decline_together_and_say_why() -> None:
    for r in ranks.run_ranks(_rank, 2, 1, gpu=False, timeout_s=300, env=plugin_env(PCIE_AR_VLLM_MODE="always")):
        assert r["ca_comm"] == "CustomAllreduce", r  # vLLM's own (disabled on a CPU)
        assert len(r["lines"]) == 1 and "not serving" in r["lines"][0], r
        assert "why: rank 1 cannot run the kernels: no GPU (test)" in r["lines"][0]


@needs_vllm
def test_the_compile_pass_is_taken_by_vllms_compilation_config() -> None:
    """vLLM's own config resolves the pass by its qualified name and its pass manager accepts it."""
    from vllm.compilation.passes.inductor_pass import InductorPass
    from vllm.compilation.passes.pass_manager import PostGradPassManager
    from vllm.config import CompilationConfig

    import vllm_plugin

    config = CompilationConfig(inductor_passes={"post_grad_custom_post_pass": "vllm_plugin.fuse_allreduce_rmsnorm"})
    entry = config.inductor_compile_config["post_grad_custom_post_pass"]
    assert isinstance(entry, InductorPass) and entry is vllm_plugin.fuse_allreduce_rmsnorm  # not wrapped
    manager = PostGradPassManager()
    manager.add(entry)
    assert manager.passes == [entry]


# ---------------------------------------------------------------------------- eligibility and declines


def _decide(ctx, cases: list[tuple]) -> list:
    from vllm_plugin.eligibility import decide

    out = []
    for facts_by_rank, nvlink_by_rank, mode in cases:
        facts = RankFacts(**facts_by_rank[ctx.rank])
        out.append(decide(ctx.group, ctx.device, Settings(enabled=True, mode=mode), facts_fn=lambda d: facts,
                          nvlink_fn=lambda ids: nvlink_by_rank[ctx.rank]))
    return out


FACT = dict(host="h", unavailable=None, physical_gpu=0, sm="SM120")
GPU1 = {**FACT, "physical_gpu": 1}
CASES = [
    (([FACT, GPU1], [False, False], "pcie"), (True, "2 GPUs without full NVLink (SM120, mode=pcie)")),
    (([FACT, GPU1], [True, True], "pcie"), (False, "fully NVLinked; mode=pcie leaves them to vLLM's own")),
    (([FACT, GPU1], [True, False], "pcie"), (True, "without full NVLink")),
    (([FACT, GPU1], [True, True], "always"), (True, "mode=always")),
    (([FACT, {**GPU1, "host": "other"}], [False, False], "always"), (False, "spans 2 nodes")),
    (([FACT, {**GPU1, "unavailable": "no driver"}], [False, False], "pcie"), (False, "rank 1 cannot run")),
]


def test_eligibility_is_one_decision_for_all_ranks() -> None:
    per_rank = ranks.run_ranks(_decide, 2, [c for c, _ in CASES], gpu=False, timeout_s=120)
    for (case, (serve, needle)), mine, theirs in zip(CASES, *per_rank):
        assert mine == theirs, case
        assert mine.serve is serve and needle in mine.reason, (case, mine)


@pytest.mark.parametrize("algo", ["oneshot_ll", "twoshot_full", "host_oneshot", "twoshot", "auto"])
@pytest.mark.parametrize("transport", ["p2p", "host"])
def test_a_forced_algorithm_declines_what_it_cannot_take(algo: str, transport: str) -> None:
    """What is served never raises in the forward pass; the rest is declined to vLLM's next backend."""
    from vllm_plugin.adapter import VllmAllReduceAdapter

    adapter = VllmAllReduceAdapter(None, "cpu", Settings(enabled=True, algo=algo),
                                   communicator_factory=lambda *a, **k: CappedCommunicator(transport=transport))
    for nbytes in sorted({16, adapter.comm.ll_capacity, adapter.comm.ll_capacity + 16, adapter.max_bytes}):
        x = torch.ones(nbytes // 2, dtype=torch.bfloat16)
        served = adapter.should_custom_ar(x)
        assert served is (0 < nbytes <= adapter.largest_served)
        assert (adapter.custom_all_reduce(x) is not None) is served


def test_readme_settings_table_is_settings_py() -> None:
    """vllm_plugin/README.md's table names exactly the plugin's settings, with their defaults."""
    import re

    with open(os.path.join(REPO, "vllm_plugin", "README.md"), encoding="utf-8") as f:
        rows = dict(re.findall(r"^\| `(PCIE_AR_VLLM_\w+)` \| `([^`]*)` \|", f.read(), re.MULTILINE))
    assert rows == {name: default for name, (default, _) in settings_mod.DOCS.items()}
