"""Both engine plugins stand on one core: the eligibility decision, the installed state, the
settings' defaults, the log line and the reading of an engine's source are the shared modules'
(pcie_allreduce/plugin_*.py), and each plugin keeps only its engine's wiring."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from pcie_allreduce import plugin_adapter, plugin_eligibility, plugin_logline, plugin_settings
from pcie_allreduce.layout import Layout
from pcie_allreduce.settings import format_bytes
from sglang_plugin import eligibility as sglang_eligibility, registry, settings as sglang_settings
from tests.test_plugin_eligibility_cpu import CheckingCommunicator


def test_both_plugins_decide_through_one_function(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm_eligibility = pytest.importorskip("vllm_plugin.eligibility")
    seen = []

    def shared_decide(group, device, settings, engine, *, nvlink_fn, facts_fn):
        seen.append((engine, nvlink_fn, facts_fn))
        return plugin_eligibility.Decision(False, "recorded")

    monkeypatch.setattr(plugin_eligibility, "decide", shared_decide)
    assert not sglang_eligibility.decide(None, torch.device("cpu"), sglang_settings.Settings()).serve
    assert not vllm_eligibility.decide(None, torch.device("cpu"), sglang_settings.Settings()).serve
    (sglang_engine, sglang_nvlink, facts_a), (vllm_engine, vllm_nvlink, facts_b) = seen
    # One set of facts (the physical-GPU mapping included); each engine its own NVLink answer.
    assert facts_a is facts_b is plugin_eligibility.local_facts
    assert (sglang_nvlink, vllm_nvlink) == (sglang_eligibility.sglang_full_nvlink, vllm_eligibility.vllm_full_nvlink)
    assert (sglang_engine.multinode_variable, vllm_engine.multinode_variable) == (sglang_settings.MULTINODE, None)


def test_the_installed_state_and_settings_are_the_shared_ones() -> None:
    vllm_plugin = pytest.importorskip("vllm_plugin.plugin")
    vllm_settings = pytest.importorskip("vllm_plugin.settings")
    assert issubclass(registry.PluginState, plugin_adapter.PluginState)
    assert issubclass(vllm_plugin.PluginState, plugin_adapter.PluginState)
    shared = {f.name: f.default for f in dataclasses.fields(plugin_settings.Settings)}
    for cls in (sglang_settings.Settings, vllm_settings.Settings):
        assert {f.name: f.default for f in dataclasses.fields(cls) if f.name in shared} == shared
    assert sglang_settings.from_env({}).timeout_s == plugin_settings.DEFAULT_TIMEOUT_S


def test_the_serving_line_names_the_largest_size_served() -> None:
    """A forced capped algorithm serves less than max_bytes: the line says what is served."""
    settings = types.SimpleNamespace(max_bytes=8 << 20, timeout_s=1.0, fused=True, wire="exact", algo="oneshot_ll",
                                     wire_min_bytes=1 << 20)
    adapter = plugin_adapter.CaCommAdapter.__new__(plugin_adapter.CaCommAdapter)
    plugin_adapter.CaCommAdapter.__init__(adapter, None, torch.device("cpu"), settings,  # type: ignore[arg-type]
                                          communicator_factory=lambda g, d, max_bytes, timeout_s:
                                          CheckingCommunicator(4, "p2p", max_bytes))
    assert 0 < adapter.largest_served < adapter.max_bytes
    line = plugin_logline.serving("start", adapter, "why", engine_name="SGLang", max_bytes_variable="X", fused="f")
    assert f"tensors of 1B..{format_bytes(adapter.largest_served)} ->" in line
    assert f"{round(Layout.make(8 << 20, 4).total_bytes / 2**20)} MiB of GPU memory per stream" in line
