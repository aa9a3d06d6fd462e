"""The vLLM plugin's settings: environment variables with the one prefix ``PCIE_AR_VLLM_``.

Every one of them means what its ``PCIE_AR_SGLANG_*`` namesake means for SGLang: both plugins take
their definitions, defaults and parser from :mod:`pcie_allreduce.plugin_settings`. Read once per
process (when vLLM loads the plugin) into a frozen :class:`Settings`; vLLM's worker processes
inherit the launcher's environment, which keeps every rank's decisions identical.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from pcie_allreduce import plugin_settings as shared
from pcie_allreduce.settings import SettingsError

__all__ = ["DOCS", "PREFIX", "Settings", "SettingsError", "describe", "from_env"]

PREFIX = "PCIE_AR_VLLM_"
NAMES = shared.names(PREFIX)
ENABLE = NAMES.enable
MAX_BYTES = NAMES.max_bytes
ALGO = NAMES.algo
MODE = NAMES.mode
FUSED = NAMES.fused
TIMEOUT_S = NAMES.timeout_s
WIRE = NAMES.wire
WIRE_MIN_BYTES = NAMES.wire_min_bytes

# name -> (default shown in docs, what it does); vllm_plugin/README.md's table repeats it.
DOCS: dict[str, tuple[str, str]] = shared.docs(NAMES, "vLLM")


@dataclasses.dataclass(frozen=True)
class Settings(shared.Settings):
    """What the plugin does in this process: the shared settings (:class:`pcie_allreduce.plugin_settings.Settings`);
    vLLM's plugin has none of its own."""


def from_env(environ: Mapping[str, str]) -> Settings:
    """Parse the plugin's variables from ``environ``; unknown ``PCIE_AR_VLLM_*`` names are errors.

    Raises:
        SettingsError: a value cannot be used (the message names the variable), a variable with
            the prefix is misspelt, or two settings contradict each other.
    """
    shared.check_known(PREFIX, set(DOCS), environ)
    return Settings(**shared.parse(NAMES, environ))


def describe(settings: Settings) -> str:
    """A short ``key=value`` rendering for log lines."""
    return shared.describe(settings)
