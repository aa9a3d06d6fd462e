"""The plugin's settings: environment variables with the one prefix ``PCIE_AR_SGLANG_``.

Read once per process (at plugin registration) and passed around as a frozen :class:`Settings`;
nothing here keeps state. Every rank reads the same environment (SGLang's scheduler processes
inherit the launcher's), which is what keeps their decisions identical.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from pcie_allreduce import plugin_settings as shared
from pcie_allreduce.plugin_settings import (ALGOS, DEFAULT_MAX_BYTES, DEFAULT_WIRE_MIN_BYTES, MODES, WIRES,  # noqa: F401
                                            format_bytes)
from pcie_allreduce.settings import SettingsError, parse_bool, parse_choice

PREFIX = "PCIE_AR_SGLANG_"
# The settings the vLLM plugin shares (same meaning, same parser): pcie_allreduce/plugin_settings.py.
NAMES = shared.names(PREFIX)
ENABLE = NAMES.enable
MAX_BYTES = NAMES.max_bytes
ALGO = NAMES.algo
MODE = NAMES.mode
FUSED = NAMES.fused
TIMEOUT_S = NAMES.timeout_s
WIRE = NAMES.wire
WIRE_MIN_BYTES = NAMES.wire_min_bytes
# SGLang's own.
ATTACH = PREFIX + "ATTACH"
MULTINODE = PREFIX + "MULTINODE"

ATTACH_CHOICES: tuple[str, ...] = ("auto", "plugin", "import")

# name -> (default shown in docs, what it does); the README table is written from this.
DOCS: dict[str, tuple[str, str]] = {
    **shared.docs(NAMES, "SGLang"),
    MULTINODE: ("1", "0 leaves tp groups that span nodes to SGLang (NCCL); 1 serves them hierarchically: the "
                     "library's kernels inside each node, NCCL between nodes, each rank sending 1/L of a message "
                     "off its node of L GPUs"),
    ATTACH: ("auto", "how the hooks attach: plugin (SGLang's plugin framework), import (import hook, for "
                     "versions without plugins; needs `python -m sglang_plugin.import_hook install`), auto"),
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the plugin does in this process.

    Attributes:
        enabled: serve anything at all.
        max_bytes: largest all-reduce served, in bytes (the communicator's ``max_bytes``).
        algo: algorithm override for plain all-reduces ("auto" uses the agreed table).
        mode: "pcie" (only groups without full NVLink) or "always".
        fused: route SGLang's fused all-reduce + residual + RMSNorm where its own is unavailable.
        timeout_s: per-call peer wait limit. 300 s by default, not the library's 10: with NCCL a
            rank that falls behind (compiling a kernel the others had cached, a host stall, a
            slow first graph capture) only delays the step, up to the process group's timeout
            (10 minutes for NCCL in torch); the plugin must not turn such a delay into a crashed
            server, and a dead peer still surfaces, naming rank, peer and stage, in 5 minutes.
        attach: "auto", "plugin" or "import".
        multinode: serve tp groups that span nodes with the hierarchical all-reduce.
        wire: "exact", or a compressed wire ("fp8") for all-reduces of ``wire_min_bytes`` and
            more (plain and fused; opt-in: it changes the result within fp8_wire's bound).
        wire_min_bytes: the smallest all-reduce the compressed wire takes.
    """

    enabled: bool = False
    max_bytes: int = DEFAULT_MAX_BYTES
    algo: str = "auto"
    mode: str = "pcie"
    fused: bool = True
    timeout_s: float = 300.0
    attach: str = "auto"
    multinode: bool = True
    wire: str = "exact"
    wire_min_bytes: int = DEFAULT_WIRE_MIN_BYTES


def from_env(environ: Mapping[str, str]) -> Settings:
    """Parse the plugin's variables from ``environ``; unknown ``PCIE_AR_SGLANG_*`` names are errors.

    Raises:
        SettingsError: a value cannot be used, a variable with the prefix is misspelt, or two
            settings contradict each other (a forced algorithm and a compressed wire; a wire
            threshold above the largest all-reduce served).
    """
    shared.check_known(PREFIX, set(DOCS), environ)
    common = shared.parse(NAMES, environ)
    return Settings(**common,
                    attach=parse_choice(ATTACH, environ.get(ATTACH, "auto"), ATTACH_CHOICES),
                    multinode=parse_bool(MULTINODE, environ.get(MULTINODE, "1")))


def describe(settings: Settings) -> str:
    """A short ``key=value`` rendering for log lines."""
    return shared.describe(settings, f" multinode={int(settings.multinode)}")
