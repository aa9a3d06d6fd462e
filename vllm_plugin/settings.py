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
from pcie_allreduce.plugin_settings import DEFAULT_MAX_BYTES, DEFAULT_TIMEOUT_S, DEFAULT_WIRE_MIN_BYTES, format_bytes
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
class Settings:
    """What the plugin does in this process (see :func:`pcie_allreduce.plugin_settings.docs`).

    Attributes:
        enabled: serve anything at all.
        max_bytes: largest all-reduce served, in bytes (the communicator's ``max_bytes``).
        algo: algorithm override for plain all-reduces ("auto" uses the agreed table).
        mode: "pcie" (only groups without full NVLink) or "always".
        fused: serve the fused all-reduce + residual + RMSNorm op (and let the compile pass use it).
        timeout_s: per-call peer wait limit (300 s: a rank that falls behind delays a step, as
            with NCCL, instead of crashing the server).
        wire: "exact", or a compressed wire ("fp8") for all-reduces of ``wire_min_bytes`` and more.
        wire_min_bytes: the smallest all-reduce the compressed wire takes.
    """

    enabled: bool = False
    max_bytes: int = DEFAULT_MAX_BYTES
    algo: str = "auto"
    mode: str = "pcie"
    fused: bool = True
    timeout_s: float = DEFAULT_TIMEOUT_S
    wire: str = "exact"
    wire_min_bytes: int = DEFAULT_WIRE_MIN_BYTES


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
