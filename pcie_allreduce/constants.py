"""The numbers and names shared with the CUDA kernels, in one place for Python.

C++ holds the definitions (csrc/protocol_constants.h) and the binding exports each one under the
name used here. :data:`MIRROR` repeats them in pure Python so ``import pcie_allreduce`` works
without the extension (CPU machines, docs builds); when ``pcie_allreduce._C`` loads, its values
are the ones used. tests/test_constants.py checks that the mirror equals the extension, so a
constant changed on one side only fails CI instead of mislabelling an error or launching the
wrong kernel. Every Python user (layout, dispatch, validation, the Triton kernels) imports from
here; nothing else types these numbers. The one exception is the algorithm records
(``ALGO_RECORDS``: each algorithm's id, name and the properties C++ checks): they are fields of the
records of :mod:`pcie_allreduce.plan.algorithms`, the one Python list of the algorithms, which
checks them against the extension's at import.
"""

from __future__ import annotations

from typing import Any

from pcie_allreduce import _ext

#: The values of csrc/protocol_constants.h, by the name ``pcie_allreduce._C`` exports them under.
MIRROR: dict[str, Any] = {
    "MIN_RANKS": 2,
    "MAX_RANKS": 16,
    "SMALL_WORLD": 8,          # worlds up to this run the kernel instances of 8-rank capacity
    "MAX_MESSAGE_BYTES": 256 << 20,  # largest max_bytes of a communicator
    "MAX_TIMEOUT_S": 24 * 3600,      # longest kernel wait a communicator takes
    "MAX_LAUNCH_BLOCKS": 64,   # CUDA blocks (or Triton programs) of one call
    "MAX_FLAG_BLOCKS": 128,    # flag slots per (kind, sender)
    "THREADS_PER_BLOCK": 512,
    "FLAG_KINDS": 3,           # 0: first exchange, 1: all-gather, 2: call notices (word 0 of each row) ...
    "NOTICE_KIND": 2,
    "FLAG_ROWS": 6,            # ... each with a row per epoch parity: row 2 * kind + parity
    "ALIGN": 256,              # workspace regions start on this many bytes
    "LOW_LATENCY_MAX_BYTES": 512 * 1024,  # payload cap of the low-latency line slots
    "ROW_STATS_SLOTS": 1024,   # uint64 words for the fused one-shot's per-row statistics
    "LINE_PAYLOAD_BYTES": 8,   # a low-latency line carries this much payload ...
    "LINE_BYTES": 16,          # ... in this many bytes
    "LINE_FLAG_MIX": 0x9E3779B9,  # line flag = signature ^ (epoch * LINE_FLAG_MIX), never 0
    "WRAP_SEAL_MIX": 0x85EBCA6B,  # a flag's low word = signature ^ (wraps * WRAP_SEAL_MIX)
    # Control: one 64-bit epoch copy per flag block, then (as uint32 words) abort, error_claim, ...
    "EPOCH_COPIES": 128,
    "ABORT_WORD": 256,
    "CLAIM_WORD": 257,
    "SHARED_STATE_WORDS": 258,  # ... then one host one-shot state per flag block
    "CONTROL_WORDS": 386,
    "SHARED_BUFFERS": 3,        # the host transport's write-once buffers, each of ...
    "SHARED_AREAS": 2,          # ... two areas (what a rank sends, its reduced shard), ...
    "SHARED_HEADER_BYTES": 3072,  # ... after one header word per (buffer, block)
    "FP8_BLOCK": 128,          # elements per fp32 scale on the FP8 wire (fp8_wire.py, twoshot_fp8)
    "POISON_WORD": 0x80008000,  # an unwritten word of those buffers (and of the full-payload slots)
    "FULL_HEADER_BYTES": 32768,  # the full-payload one-shot's header words, before its slots
    "FULL_TWOSHOT_MARGIN": 16,  # the full-payload two-shot takes messages up to ll_capacity less this
    "ERROR_WORDS": 8,          # kind, rank, peer, stage, block, epoch, expected and observed signature
    "DTYPE_IDS": {"float32": 0, "float16": 1, "bfloat16": 2},
    "ERROR_KINDS": {"timeout": 1, "mismatch": 2},
    "TRANSPORT_IDS": {"p2p": 0, "host": 1},
    "STAGE_NAMES": {1: "one-shot gather", 2: "reduce-scatter", 3: "all-gather", 4: "fused gather",
                    5: "fused reduce-scatter", 6: "fused all-gather", 7: "low-latency gather",
                    8: "fused row statistics", 9: "host transport gather",
                    10: "full-payload gather", 11: "full-payload reduce-scatter", 12: "full-payload all-gather",
                    13: "island chain", 14: "island result", 15: "pull gather", 16: "pull reduce-scatter",
                    17: "pull all-gather", 18: "island gather"},
}


#: Names the extension exports that are mirrored outside :data:`MIRROR`, and where.
MIRRORED_ELSEWHERE: dict[str, str] = {"ALGO_RECORDS": "pcie_allreduce.plan.algorithms"}


def exported(module: Any) -> dict[str, Any]:
    """The values ``module`` (the extension) exports for the names of :data:`MIRROR`, as plain
    ints and dicts; a name it lacks (an older build) keeps the mirror's value."""
    return {name: _plain(getattr(module, name, value)) for name, value in MIRROR.items()}


def _plain(value: Any) -> Any:
    return dict(value) if isinstance(value, dict) else value


def _values() -> dict[str, Any]:
    module = _ext.load()
    return dict(MIRROR) if module is None else exported(module)


_VALUES = _values()

MIN_RANKS: int = _VALUES["MIN_RANKS"]
MAX_RANKS: int = _VALUES["MAX_RANKS"]
SMALL_WORLD: int = _VALUES["SMALL_WORLD"]
MAX_MESSAGE_BYTES: int = _VALUES["MAX_MESSAGE_BYTES"]
MAX_TIMEOUT_S: int = _VALUES["MAX_TIMEOUT_S"]
MAX_LAUNCH_BLOCKS: int = _VALUES["MAX_LAUNCH_BLOCKS"]
MAX_FLAG_BLOCKS: int = _VALUES["MAX_FLAG_BLOCKS"]
THREADS_PER_BLOCK: int = _VALUES["THREADS_PER_BLOCK"]
FLAG_KINDS: int = _VALUES["FLAG_KINDS"]
NOTICE_KIND: int = _VALUES["NOTICE_KIND"]
FLAG_ROWS: int = _VALUES["FLAG_ROWS"]
ALIGN: int = _VALUES["ALIGN"]
LOW_LATENCY_MAX_BYTES: int = _VALUES["LOW_LATENCY_MAX_BYTES"]
ROW_STATS_SLOTS: int = _VALUES["ROW_STATS_SLOTS"]
LINE_PAYLOAD_BYTES: int = _VALUES["LINE_PAYLOAD_BYTES"]
LINE_BYTES: int = _VALUES["LINE_BYTES"]
LINE_FLAG_MIX: int = _VALUES["LINE_FLAG_MIX"]
WRAP_SEAL_MIX: int = _VALUES["WRAP_SEAL_MIX"]
EPOCH_COPIES: int = _VALUES["EPOCH_COPIES"]
ABORT_WORD: int = _VALUES["ABORT_WORD"]
CLAIM_WORD: int = _VALUES["CLAIM_WORD"]
CONTROL_WORDS: int = _VALUES["CONTROL_WORDS"]
SHARED_STATE_WORDS: int = _VALUES["SHARED_STATE_WORDS"]
SHARED_BUFFERS: int = _VALUES["SHARED_BUFFERS"]
SHARED_AREAS: int = _VALUES["SHARED_AREAS"]
SHARED_HEADER_BYTES: int = _VALUES["SHARED_HEADER_BYTES"]
POISON_WORD: int = _VALUES["POISON_WORD"]
FP8_BLOCK: int = _VALUES["FP8_BLOCK"]
FULL_HEADER_BYTES: int = _VALUES["FULL_HEADER_BYTES"]
FULL_TWOSHOT_MARGIN: int = _VALUES["FULL_TWOSHOT_MARGIN"]
ERROR_WORDS: int = _VALUES["ERROR_WORDS"]
#: dtype name (as torch spells it after ``torch.``) -> the kernels' dtype id.
DTYPE_IDS: dict[str, int] = _VALUES["DTYPE_IDS"]
#: Error kind name -> the kind a failed wait records (0: none).
ERROR_KINDS: dict[str, int] = _VALUES["ERROR_KINDS"]
#: Transport name -> the workspace's transport id (where its memory lives).
TRANSPORT_IDS: dict[str, int] = _VALUES["TRANSPORT_IDS"]
#: Stage id a failed wait records -> the name error messages use.
STAGE_NAMES: dict[int, str] = _VALUES["STAGE_NAMES"]

ERROR_TIMEOUT: int = ERROR_KINDS["timeout"]
ERROR_MISMATCH: int = ERROR_KINDS["mismatch"]
_STAGE_IDS = {name: stage for stage, name in STAGE_NAMES.items()}
STAGE_ONE_SHOT_GATHER: int = _STAGE_IDS["one-shot gather"]
STAGE_REDUCE_SCATTER: int = _STAGE_IDS["reduce-scatter"]
STAGE_ALL_GATHER: int = _STAGE_IDS["all-gather"]
STAGE_FUSED_GATHER: int = _STAGE_IDS["fused gather"]
STAGE_FUSED_REDUCE_SCATTER: int = _STAGE_IDS["fused reduce-scatter"]
STAGE_FUSED_ALL_GATHER: int = _STAGE_IDS["fused all-gather"]
STAGE_LOW_LATENCY_GATHER: int = _STAGE_IDS["low-latency gather"]
STAGE_FUSED_ROW_STATS: int = _STAGE_IDS["fused row statistics"]
STAGE_HOST_GATHER: int = _STAGE_IDS["host transport gather"]
STAGE_FULL_GATHER: int = _STAGE_IDS["full-payload gather"]
