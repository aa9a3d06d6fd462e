"""The plugin's settings: environment variables with the one prefix ``PCIE_AR_SGLANG_``.

Read once per process (at plugin registration) and passed around as a frozen :class:`Settings`;
nothing here keeps state. Every rank reads the same environment (SGLang's scheduler processes
inherit the launcher's), which is what keeps their decisions identical.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from pcie_allreduce import plugin_settings as shared
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


@dataclasses.dataclass(frozen=True)
class Settings(shared.Settings):
    """What the plugin does in this process: the shared settings
    (:class:`pcie_allreduce.plugin_settings.Settings`) and SGLang's own.

    Attributes:
        attach: "auto", "plugin" or "import".
        multinode: serve tp groups that span nodes with the hierarchical all-reduce.
    """

    attach: str = "auto"
    multinode: bool = True


# name -> (default shown in docs, what it does); the README table is written from this.
DOCS: dict[str, tuple[str, str]] = {
    **shared.docs(NAMES, "SGLang"),
    MULTINODE: (str(int(Settings.multinode)), "0 leaves tp groups that span nodes to SGLang (NCCL); 1 serves "
                                              "them hierarchically: the library's kernels inside each node, NCCL "
                                              "between nodes, each rank sending 1/L of a message off its node of L GPUs"),
    ATTACH: (Settings.attach, "how the hooks attach: plugin (SGLang's plugin framework), import (import hook, for "
                     "versions without plugins; needs `python -m sglang_plugin.import_hook install`), auto"),
}


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
                    attach=parse_choice(ATTACH, environ.get(ATTACH, Settings.attach), ATTACH_CHOICES),
                    multinode=parse_bool(MULTINODE, environ[MULTINODE]) if MULTINODE in environ else Settings.multinode)


def describe(settings: Settings) -> str:
    """A short ``key=value`` rendering for log lines."""
    return shared.describe(settings, f" multinode={int(settings.multinode)}")
