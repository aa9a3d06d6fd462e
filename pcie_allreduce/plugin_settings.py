"""The settings both engine plugins share: what they mean, their defaults, and how they are read.

The SGLang plugin (``PCIE_AR_SGLANG_*``) and the vLLM plugin (``PCIE_AR_VLLM_*``) take the same
switches for the same things (on or off, the largest all-reduce served, a forced algorithm, which
groups to serve, the fused path, the peer timeout, the compressed wire and where it starts). They
are defined once here, under a prefix each plugin passes in, and parsed by the library's one parser
(:mod:`pcie_allreduce.settings`), so a value means the same thing under either prefix and a bad one
is an error naming the variable. Each plugin adds its own engine-specific settings on top. Pure
functions and constants; nothing here imports an engine or keeps state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from pcie_allreduce.plan.algorithms import (ALGORITHMS, HOST_ONLY_ALGORITHMS, ISLAND_ALGORITHMS,
                                            SYMMETRIC_INPUT_ALGORITHMS, WIRE_ALGORITHMS)
from pcie_allreduce.settings import (SettingsError, format_bytes, parse_bool, parse_choice, parse_seconds,  # noqa: F401
                                     parse_size)

# An engine's tensors never lie in the symmetric input area, so the in-place algorithms are not offered.
ALGOS: tuple[str, ...] = ("auto",) + tuple(a for a in ALGORITHMS if a not in SYMMETRIC_INPUT_ALGORITHMS)
MODES: tuple[str, ...] = ("pcie", "always")
# "exact": the message's own bytes; else a compressed wire of all_reduce(x, wire=NAME).
WIRES: tuple[str, ...] = ("exact",) + tuple(WIRE_ALGORITHMS)
DEFAULT_MAX_BYTES = 8 << 20  # the engines' own custom all-reduce default (8 MiB)
# Where the FP8 wire starts to pay on one PCIe link: ~1 MiB (bench/RESULTS.md, "FP8 wire").
DEFAULT_WIRE_MIN_BYTES = 1 << 20
# Longer than the library's 10 s: a serving step whose rank falls behind (a kernel compiling on one
# rank, a host stall) must be delayed, not crash the server, as with NCCL's 10-minute timeout.
DEFAULT_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class Settings:
    """The shared settings' values (each plugin's ``Settings`` subclasses this, adding its own).

    Attributes:
        enabled: serve anything at all.
        max_bytes: largest all-reduce served, in bytes (the communicator's ``max_bytes``).
        algo: algorithm override for plain all-reduces ("auto" uses the agreed table).
        mode: "pcie" (only groups without full NVLink) or "always".
        fused: serve the engine's fused all-reduce + residual + RMSNorm.
        timeout_s: per-call peer wait limit. Longer than the library's 10 s: with NCCL a rank that
            falls behind (compiling a kernel the others had cached, a host stall, a slow first
            graph capture) only delays the step, up to the process group's timeout (10 minutes for
            NCCL in torch); the plugin must not turn such a delay into a crashed server, and a
            dead peer still surfaces, naming rank, peer and stage.
        wire: "exact", or a compressed wire ("fp8") for all-reduces of ``wire_min_bytes`` and
            more (plain and fused; opt-in: it changes the result within fp8_wire's bound).
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


@dataclasses.dataclass(frozen=True)
class Names:
    """The shared settings' variable names under one plugin's prefix."""

    prefix: str
    enable: str
    max_bytes: str
    algo: str
    mode: str
    fused: str
    timeout_s: str
    wire: str
    wire_min_bytes: str


def names(prefix: str) -> Names:
    """``names("PCIE_AR_VLLM_").enable == "PCIE_AR_VLLM_ENABLE"``, and so on for each shared setting."""
    return Names(prefix, *(prefix + s for s in ("ENABLE", "MAX_BYTES", "ALGO", "MODE", "FUSED", "TIMEOUT_S", "WIRE",
                                                "WIRE_MIN_BYTES")))


def docs(n: Names, engine: str) -> dict[str, tuple[str, str]]:
    """Variable name -> (default as documented, what it does), for the shared settings of ``engine``."""
    return {
        n.enable: ("0", "1 turns the plugin on (it is installed but inert by default)"),
        n.max_bytes: (format_bytes(DEFAULT_MAX_BYTES), "largest all-reduce served (bytes, or with KiB/MiB suffix); larger ones go to "
                              f"{engine}'s next backend. Each rank allocates about (2 x W + 1) x this + 6 x W x "
                              "min(this, 512 KiB) per CUDA stream"),
        n.algo: ("auto", "force one algorithm: "
                         + " | ".join(a for a in ALGOS if a not in HOST_ONLY_ALGORITHMS + ISLAND_ALGORITHMS)
                         + " (" + " | ".join(HOST_ONLY_ALGORITHMS) + " on the host transport; "
                         + " | ".join(ISLAND_ALGORITHMS) + " where the ranks form equal islands)"),
        n.mode: ("pcie", f"pcie: serve only GPUs without full NVLink (leave NVLink to {engine}'s own kernels); "
                         "always: serve every single-node tp group of 2-16 GPUs"),
        n.fused: ("1", f"0 keeps {engine}'s unfused all-reduce + add + RMSNorm on GPUs where its FlashInfer fusion "
                       "is unavailable"),
        n.timeout_s: (f"{DEFAULT_TIMEOUT_S:g}", "seconds a kernel waits for a peer before failing loudly instead of hanging (the "
                             "library's own default is 10; a serving step whose rank falls behind must not crash)"),
        n.wire: ("exact", f"fp8 sends all-reduces of at least {n.wire_min_bytes} as FP8 e4m3 blocks "
                          "with an fp32 scale per 128 values (0.52x the bytes of bf16; about 3% relative error, "
                          "bitwise identical on every rank; pcie_allreduce.fp8_wire); exact keeps every bit"),
        n.wire_min_bytes: (format_bytes(DEFAULT_WIRE_MIN_BYTES), f"smallest all-reduce that {n.wire}=fp8 compresses (bytes, or with "
                                   "KiB/MiB suffix); smaller ones stay exact"),
    }


def check_known(prefix: str, known: set[str], environ: Mapping[str, str]) -> None:
    """A variable with ``prefix`` that is not in ``known`` is an error (a misspelt setting is never ignored)."""
    unknown = sorted(k for k in environ if k.startswith(prefix) and k not in known)
    if unknown:
        raise SettingsError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")


def parse(n: Names, environ: Mapping[str, str]) -> dict[str, Any]:
    """The shared settings from ``environ`` as keyword arguments of a plugin's settings class:
    ``enabled, max_bytes, algo, mode, fused, timeout_s, wire, wire_min_bytes``.

    Raises:
        SettingsError: a value cannot be used, or two settings contradict each other (a forced
            algorithm and a compressed wire; a wire threshold above the largest all-reduce served).
    """
    get = environ.get
    default = Settings()
    values = dict(
        enabled=parse_bool(n.enable, get(n.enable)) if n.enable in environ else default.enabled,
        max_bytes=parse_size(n.max_bytes, get(n.max_bytes)) if get(n.max_bytes) else default.max_bytes,
        algo=parse_choice(n.algo, get(n.algo, default.algo), ALGOS),
        mode=parse_choice(n.mode, get(n.mode, default.mode), MODES),
        fused=parse_bool(n.fused, get(n.fused)) if n.fused in environ else default.fused,
        timeout_s=parse_seconds(n.timeout_s, get(n.timeout_s)) if get(n.timeout_s) else default.timeout_s,
        wire=parse_choice(n.wire, get(n.wire, default.wire), WIRES),
        wire_min_bytes=(parse_size(n.wire_min_bytes, get(n.wire_min_bytes)) if get(n.wire_min_bytes)
                        else default.wire_min_bytes),
    )
    if values["wire"] != "exact" and values["algo"] != "auto":
        raise SettingsError(f"{n.wire}={values['wire']} runs its own kernel ({WIRE_ALGORITHMS[values['wire']]}) "
                            f"from {format_bytes(values['wire_min_bytes'])} up, and {n.algo}={values['algo']} forces "
                            "another for every size: set one of them, not both")
    if values["wire"] != "exact" and values["wire_min_bytes"] > values["max_bytes"]:
        raise SettingsError(f"{n.wire_min_bytes}={format_bytes(values['wire_min_bytes'])} is above {n.max_bytes}="
                            f"{format_bytes(values['max_bytes'])}, so {n.wire}={values['wire']} would compress "
                            f"nothing: lower {n.wire_min_bytes} or raise {n.max_bytes}")
    return values


def describe(settings: Any, extra: str = "") -> str:
    """A plugin's settings as ``key=value`` pairs for its log line; ``extra``: the plugin's own,
    placed before the wire."""
    return (f"max_bytes={format_bytes(settings.max_bytes)} algo={settings.algo} mode={settings.mode} "
            f"fused={int(settings.fused)} timeout_s={settings.timeout_s:g}{extra}"
            + (f" wire={settings.wire}>={format_bytes(settings.wire_min_bytes)}" if settings.wire != "exact" else ""))
