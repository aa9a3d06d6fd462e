"""The vLLM plugin's compile pass against vLLM's own compiler code (pinned 0.34.0).

The cache key: vLLM keeps compiled graphs on disk under a key built from the compilation config
(``compute_env_and_config_hashes``, used by both its AOT and JIT caches) and from the post-grad pass
manager's ``uuid()`` (Inductor's FX graph cache). Both must change whenever what the pass would
write into a graph changes: the plugin switched on or off, the fused path on or off, or the pass's
code; otherwise a graph compiled with the rewrite is reused where the fused op is not registered.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests._vllm import REPO, vllm_skip_reason

VLLM_SKIP = vllm_skip_reason()
needs_vllm = pytest.mark.skipif(VLLM_SKIP is not None, reason=VLLM_SKIP or "")

PASS_NAME = "vllm_plugin.fuse_allreduce_rmsnorm"

CACHE_KEYS = f"""
import json, os

import torch
from vllm.compilation.caching import compute_env_and_config_hashes
from vllm.compilation.passes.inductor_pass import pass_context
from vllm.compilation.passes.pass_manager import PostGradPassManager
from vllm.config import CompilationConfig, DeviceConfig, VllmConfig
from vllm.config.utils import Range

import vllm_plugin
from vllm_plugin import plugin


def keys():
    config = VllmConfig(device_config=DeviceConfig(device="cpu"), compilation_config=CompilationConfig(
        inductor_passes={{"post_grad_custom_post_pass": "{PASS_NAME}"}}))
    entry = config.compilation_config.inductor_compile_config["post_grad_custom_post_pass"]
    manager = PostGradPassManager()  # what VllmBackend.configure_post_pass builds and hands Inductor
    manager.configure(config)
    manager.add(entry)
    with pass_context(Range(1, 8)):
        return {{"config_hash": compute_env_and_config_hashes(config)[1], "pass_manager_uuid": manager.uuid(),
                 "resolved_ours": entry is vllm_plugin.fuse_allreduce_rmsnorm,
                 "op_registered": hasattr(torch.ops.pcie_allreduce_vllm, "all_reduce_rmsnorm")}}


out = {{}}
for label, enable, fused in (("off", "0", "1"), ("fused", "1", "1"), ("unfused", "1", "0"), ("fused again", "1", "1")):
    os.environ.update(PCIE_AR_VLLM_ENABLE=enable, PCIE_AR_VLLM_FUSED=fused)
    plugin.register()  # what vLLM's plugin loader runs in every process
    out[label] = keys()
    plugin.unregister()
print("KEYS " + json.dumps(out))
"""


def _cache_keys(pythonpath: str) -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PCIE_AR_VLLM_", "VLLM_PLUGINS"))}
    env["PYTHONPATH"] = os.pathsep.join([pythonpath, REPO])
    out = subprocess.run([sys.executable, "-c", CACHE_KEYS], cwd=pythonpath, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("KEYS ")]
    assert line, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(line[0][len("KEYS "):])


@needs_vllm
def test_vllms_cache_key_changes_with_the_settings_and_the_code_of_the_pass(tmp_path) -> None:
    here = _cache_keys(REPO)
    for key in ("config_hash", "pass_manager_uuid"):
        by_setting = {label: keys[key] for label, keys in here.items()}
        assert by_setting["fused"] == by_setting["fused again"], by_setting  # a key, not noise
        assert len({by_setting["off"], by_setting["fused"], by_setting["unfused"]}) == 3, (key, by_setting)
    for label, keys in here.items():
        assert keys["resolved_ours"], (label, keys)  # vLLM took our pass as is, not wrapped by its source
    assert here["fused"]["op_registered"]  # installed with the fused path on: the op exists before any graph

    # The same settings, the pass's module edited: every key differs.
    shutil.copytree(os.path.join(REPO, "vllm_plugin"), tmp_path / "vllm_plugin",
                    ignore=shutil.ignore_patterns("__pycache__"))
    fusion = tmp_path / "vllm_plugin" / "fusion.py"
    fusion.write_text(fusion.read_text().replace("        count += 1\n", "        count += 1  # edited\n", 1))
    assert "# edited" in fusion.read_text()
    edited = _cache_keys(str(tmp_path))
    for label in here:
        for key in ("config_hash", "pass_manager_uuid"):
            assert edited[label][key] != here[label][key], (label, key)
