"""The plugin's settings: environment variables with the one prefix ``PCIE_AR_SGLANG_``.

Read once per process (at plugin registration) and passed around as a frozen :class:`Settings`;
nothing here keeps state. Every rank reads the same environment (SGLang's scheduler processes
inherit the launcher's), which is what keeps their decisions identical.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from pcie_allreduce.algo import (ALGORITHMS, HOST_ONLY_ALGORITHMS, ISLAND_ALGORITHMS, SYMMETRIC_INPUT_ALGORITHMS,
                                 WIRE_ALGORITHMS)
from pcie_allreduce.settings import SettingsError, parse_bool, parse_choice, parse_seconds, parse_size

PREFIX = "PCIE_AR_SGLANG_"
ENABLE = PREFIX + "ENABLE"
MAX_BYTES = PREFIX + "MAX_BYTES"
ALGO = PREFIX + "ALGO"
MODE = PREFIX + "MODE"
FUSED = PREFIX + "FUSED"
TIMEOUT_S = PREFIX + "TIMEOUT_S"
ATTACH = PREFIX + "ATTACH"
MULTINODE = PREFIX + "MULTINODE"
WIRE = PREFIX + "WIRE"
WIRE_MIN_BYTES = PREFIX + "WIRE_MIN_BYTES"

# SGLang's tensors never lie in the symmetric input area, so its in-place algorithms are not offered.
ALGOS: tuple[str, ...] = ("auto",) + tuple(a for a in ALGORITHMS if a not in SYMMETRIC_INPUT_ALGORITHMS)
MODES: tuple[str, ...] = ("pcie", "always")
ATTACH_CHOICES: tuple[str, ...] = ("auto", "plugin", "import")
# "exact": the message's own bytes; else a compressed wire of all_reduce(x, wire=NAME).
WIRES: tuple[str, ...] = ("exact",) + tuple(WIRE_ALGORITHMS)
# Where the FP8 wire starts to pay on one PCIe link: ~1 MiB (bench/RESULTS.md, "FP8 wire").
DEFAULT_WIRE_MIN_BYTES = 1 << 20
DEFAULT_MAX_BYTES = 8 << 20  # SGLang's own custom all-reduce default (8 MiB)

# name -> (default shown in docs, what it does); the README table is written from this.
DOCS: dict[str, tuple[str, str]] = {
    ENABLE: ("0", "1 turns the plugin on (it is installed but inert by default)"),
    MAX_BYTES: ("8MiB", "largest all-reduce served (bytes, or with KiB/MiB suffix); larger ones go to "
                        "SGLang's next backend. Each rank allocates about (2 x W + 1) x this + 6 x W x min(this, "
                        "512 KiB) per CUDA stream"),
    ALGO: ("auto", "force one algorithm: "
                   + " | ".join(a for a in ALGOS if a not in HOST_ONLY_ALGORITHMS + ISLAND_ALGORITHMS)
                   + " (" + " | ".join(HOST_ONLY_ALGORITHMS) + " on the host transport; "
                   + " | ".join(ISLAND_ALGORITHMS) + " where the ranks form equal islands)"),
    MODE: ("pcie", "pcie: serve only GPUs without full NVLink (leave NVLink to SGLang's own kernels); "
                   "always: serve every single-node tp group of 2-16 GPUs"),
    FUSED: ("1", "0 keeps SGLang's unfused all-reduce + add + RMSNorm on GPUs where its FlashInfer fusion "
                 "is unavailable"),
    TIMEOUT_S: ("300", "seconds a kernel waits for a peer before failing loudly instead of hanging (the "
                       "library's own default is 10; a serving step whose rank falls behind must not crash)"),
    MULTINODE: ("1", "0 leaves tp groups that span nodes to SGLang (NCCL); 1 serves them hierarchically: the "
                     "library's kernels inside each node, NCCL between nodes, each rank sending 1/L of a message "
                     "off its node of L GPUs"),
    WIRE: ("exact", "fp8 sends all-reduces of at least PCIE_AR_SGLANG_WIRE_MIN_BYTES as FP8 e4m3 blocks "
                    "with an fp32 scale per 128 values (0.52x the bytes of bf16; about 3% relative error, "
                    "bitwise identical on every rank; pcie_allreduce.fp8_wire); exact keeps every bit"),
    WIRE_MIN_BYTES: ("1MiB", "smallest all-reduce that PCIE_AR_SGLANG_WIRE=fp8 compresses (bytes, or with "
                             "KiB/MiB suffix); smaller ones stay exact"),
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
    known = set(DOCS)
    unknown = sorted(k for k in environ if k.startswith(PREFIX) and k not in known)
    if unknown:
        raise SettingsError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    base = Settings()
    get = environ.get
    settings = Settings(
        enabled=parse_bool(ENABLE, get(ENABLE, "0")),
        max_bytes=parse_size(MAX_BYTES, get(MAX_BYTES)) if get(MAX_BYTES) else base.max_bytes,
        algo=parse_choice(ALGO, get(ALGO, base.algo), ALGOS),
        mode=parse_choice(MODE, get(MODE, base.mode), MODES),
        fused=parse_bool(FUSED, get(FUSED, "1")),
        timeout_s=parse_seconds(TIMEOUT_S, get(TIMEOUT_S)) if get(TIMEOUT_S) else base.timeout_s,
        attach=parse_choice(ATTACH, get(ATTACH, base.attach), ATTACH_CHOICES),
        multinode=parse_bool(MULTINODE, get(MULTINODE, "1")),
        wire=parse_choice(WIRE, get(WIRE, base.wire), WIRES),
        wire_min_bytes=(parse_size(WIRE_MIN_BYTES, get(WIRE_MIN_BYTES)) if get(WIRE_MIN_BYTES)
                        else base.wire_min_bytes),
    )
    if settings.wire != "exact" and settings.algo != "auto":
        raise SettingsError(f"{WIRE}={settings.wire} runs its own kernel ({WIRE_ALGORITHMS[settings.wire]}) from "
                            f"{format_bytes(settings.wire_min_bytes)} up, and {ALGO}={settings.algo} forces another "
                            f"for every size: set one of them, not both")
    if settings.wire != "exact" and settings.wire_min_bytes > settings.max_bytes:
        raise SettingsError(f"{WIRE_MIN_BYTES}={format_bytes(settings.wire_min_bytes)} is above {MAX_BYTES}="
                            f"{format_bytes(settings.max_bytes)}, so {WIRE}={settings.wire} would compress nothing: "
                            f"lower {WIRE_MIN_BYTES} or raise {MAX_BYTES}")
    return settings


def describe(settings: Settings) -> str:
    """A short ``key=value`` rendering for log lines."""
    return (f"max_bytes={format_bytes(settings.max_bytes)} algo={settings.algo} mode={settings.mode} "
            f"fused={int(settings.fused)} timeout_s={settings.timeout_s:g} multinode={int(settings.multinode)}"
            + (f" wire={settings.wire}>={format_bytes(settings.wire_min_bytes)}" if settings.wire != "exact" else ""))


def format_bytes(n: int) -> str:
    """``8388608`` -> ``8MiB``; exact binary units only, else plain bytes."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"
