"""CPU tests of the SGLang plugin's settings and packaging, and of SGLang's surface it relies on.

The ``PCIE_AR_SGLANG_*`` settings (defaults, parsing, and errors naming the variable); the
packaging (the ``sglang.srt.plugins`` entry point, the import hook's watched modules, the launcher,
an import of the package that stays light); and SGLang's real code (pinned 0.5.23) as the plugin
relies on it: each hook target's signature, the functions and parameters the plugin calls, the
custom all-reduce surface the adapter mirrors, the plugin framework's constants and the fused
gate's size limit. Tests that need SGLang skip with the reason when it is not importable.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pcie_allreduce import plugin_surface
from sglang_plugin import hooks, import_watch, patching, settings as settings_mod, surface
from pcie_allreduce.settings import format_bytes
from sglang_plugin.settings import Settings, SettingsError
from tests._sglang import sglang_skip_reason

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
