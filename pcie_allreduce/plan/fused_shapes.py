"""Launch shapes and call signatures of the fused Triton kernels, as pure arithmetic (no Triton).

Every rank must launch the same grid with the same signature for the same call (the kernels'
flags are per program), so each shape here is a pure function of the call's shape and of the
communicator's agreed block cap. The fused plan (:func:`pcie_allreduce.plan.dispatch.fused_plan`)
computes them once per call shape and the launches (:mod:`pcie_allreduce.fused.path`) take what
it computed: this module imports neither Triton nor a kernel module.
"""

from __future__ import annotations

import functools
import math
import zlib

from pcie_allreduce.constants import MAX_FLAG_BLOCKS, MAX_LAUNCH_BLOCKS, ROW_STATS_SLOTS
from pcie_allreduce.plan.algorithms import DATA_AS_FLAG_ONESHOTS, fits_capacity

#: (programs, C chunks per row, chunk width (elements), BLOCK_W (words), num_warps) of the
#: data-as-flag one-shot (fused/oneshot_ll.py).
DataAsFlagShape = tuple[int, int, int, int, int]

MAX_PROGRAMS = MAX_LAUNCH_BLOCKS  # the data-as-flag one-shot's cap: the CUDA kernels'
MAX_CHUNK = 2048    # columns per program: the [peers, chunk] tile of words must fit in registers
MIN_CHUNK = 512     # below this, more programs only add statistics traffic
PUSH_WORDS = 1024   # words per push step
MAX_WARPS = 32      # 1024 threads: one word per thread up to MAX_CHUNK columns
QUAD_ELEMENTS = 8   # a 16-byte quad of 2-byte elements: what one thread of the quads kernel moves
# Programs of at least this many warps take the quads kernel (takes_quads): 4 up to four ranks,
# 16 beyond (at W = 8 it lost in 2- and 4-warp programs and won in 16-warp ones).
QUAD_MIN_WARPS = 4
QUAD_MIN_WARPS_WIDE_WORLD = 16
QUAD_WIDE_WORLD = 5  # from this many ranks the wider minimum holds
# Columns of a chunk of the full payload's quads shape (data_as_flag's second try): 512 threads of
# one quad each, so a row of up to 8192 elements is two chunks where the word kernel needs four.
QUAD_WIDE_COLUMNS = 4096
# Programs of this many columns when there are at least MIN_SPREAD_PROGRAMS of them within the
# block cap (one program per SM). Several programs per SM (register-capped, at 2x or 4x the cap)
# were tried and dropped: 8-warp ones at 2x timed out under MPS (other ranks' kernels may hold
# part of an SM, so register arithmetic is no residency guarantee) and 4-warp ones at 4x were
# slower at W=8 than the regular shape (16.6 vs 13.1 us, bench/PERF_NOTES.md).
MEDIUM_COLUMNS = 1024
MIN_SPREAD_PROGRAMS = 16       # fewer 1024-column programs leave the push to too few SMs (1 token)
# A rank's share of a GPU of at most this many SMs (a dozen or more ranks sharing one under MPS)
# need not be there whole at any moment: the other clients' programs sit on SMs too. The data-as-
# flag one-shot needs every program of a row running at once (they exchange the row's statistics),
# so on such a share it takes at most half of it (12 ranks on an H100, cap 10: 10 programs of 512
# threads, one per SM, hung and 7 ran; 16 ranks on an H200, cap 8: 7 such programs hung, 4 of 1024
# ran). At 8 ranks on an H100 (cap 16) 16 programs ran the harness but stalled twice in long
# graph loops (bench/PERF_NOTES.md, "The data-as-flag fused kernel under MPS at eight ranks").
CROWDED_SHARE = 10


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1): ``triton.next_power_of_2`` without Triton."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


@functools.lru_cache(maxsize=1024)  # pure, and asked on every new call shape
def data_as_flag(tokens: int, hidden: int, world: int, max_programs: int,
                 interpret: bool = False, full: bool = False) -> DataAsFlagShape | None:
    """The data-as-flag one-shot's launch shape, or None when it cannot take the call (odd hidden
    size, or more programs than may run at once: ``max_programs``, the communicator's block cap,
    halved on a crowded GPU share, :func:`resident_programs`). ``full``: for the full-payload
    kernel, which where the word shape has too many programs tries chunks of QUAD_WIDE_COLUMNS
    in 16-byte quads (:func:`takes_quads` must take them): W = 8 on an H100 under MPS, 4 x 7168,
    two 16-warp quads programs per row took 9.88 us against 12.71 for the word kernel in the same
    shape and 10.94 for our pair (bench/RESULTS.md, "The full-payload kernel's shapes, each
    kernel forced").

    1024-column programs if there are at least 16 of them within the cap (fastest at 4 x 7168,
    W=4: 7.66 us against 7.95 for 512 columns and 9.03 for 1792), else as many column chunks as
    the cap allows, 512 to 2048 columns each (W=8, cap 16: 1792-column programs, 13.1 us against
    16.6 for 56 small ones; bench/PERF_NOTES.md, "Launch shapes and residency"), then as few as
    the program's power-of-two width covers. Always one word (two elements) per thread: at 4 x 7168, 16 warps instead of 8 at W=4
    and 32 instead of 16 at W=8 were faster (bench/PERF_NOTES.md). Under the interpreter
    (programs run one after another) C is 1."""
    if hidden % 2 or tokens < 1:
        return None
    cap = resident_programs(max_programs)
    if not interpret:
        medium = shape_with_chunks(tokens, hidden, math.ceil(hidden / MEDIUM_COLUMNS))
        if _fits(tokens, medium[1], cap) and medium[0] >= MIN_SPREAD_PROGRAMS:
            return medium
    chunks = 1 if interpret else max(math.ceil(hidden / MAX_CHUNK), min(cap // tokens, math.ceil(hidden / MIN_CHUNK)))
    shape = shape_with_chunks(tokens, hidden, chunks)
    if not interpret:
        # A program's BLOCK_W threads hold their registers whether or not each has a word, so take
        # the fewest chunks that width serves: the same work per thread in fewer programs, where
        # a 16-warp program fills an SM (why few programs matter on a shared GPU: CROWDED_SHARE).
        shape = shape_with_chunks(tokens, hidden, math.ceil(hidden / (2 * shape[3])))
    if _fits(tokens, shape[1], cap):
        return shape
    if full and not interpret:
        wide = shape_with_chunks(tokens, hidden, math.ceil(hidden / QUAD_WIDE_COLUMNS))
        if takes_quads(wide, hidden, world) and _fits(tokens, wide[1], cap):
            return wide
    return None


def data_as_flag_for_call(kernel: str, tokens: int, hidden: int, elem_size: int, world: int,
                          ll_capacity: int | None, max_programs: int, interpret: bool = False) -> DataAsFlagShape | None:
    """The launch shape of the data-as-flag fused ``kernel`` for a call of ``[tokens, hidden]``
    elements of ``elem_size`` bytes, or None where the message exceeds the kernel's low-latency
    capacity (``ll_capacity``; None: unbounded) or no shape fits (:func:`data_as_flag`; the full
    payload's may take the wide quads shape). The one answer the dispatch and the soak schedule ask."""
    if not fits_capacity(kernel, tokens * hidden * elem_size, ll_capacity):
        return None
    return data_as_flag(tokens, hidden, world, max_programs, interpret, kernel == DATA_AS_FLAG_ONESHOTS[1])


def resident_programs(max_programs: int) -> int:
    """How many data-as-flag programs one call may launch under the block cap ``max_programs``:
    the cap, or half of it where the cap is a crowded GPU share (``CROWDED_SHARE``)."""
    cap = max(1, min(MAX_PROGRAMS, max_programs))
    return max(1, cap // 2) if cap <= CROWDED_SHARE else cap


def _fits(tokens: int, chunks: int, cap: int) -> bool:
    return tokens * chunks <= cap and tokens * chunks * chunks <= ROW_STATS_SLOTS


def with_chunks_if_resident(tokens: int, hidden: int, chunks: int, max_programs: int) -> DataAsFlagShape | None:
    """:func:`shape_with_chunks`, or None where its programs would not all run at once under the
    block cap ``max_programs`` (:func:`resident_programs`) or overflow the row statistics' slots:
    a forced chunk count that is safe to launch (the harness's chunk sweep)."""
    if hidden % 2 or tokens < 1 or chunks < 1:
        return None
    shape = shape_with_chunks(tokens, hidden, chunks)
    return shape if _fits(tokens, shape[1], resident_programs(max_programs)) else None


def shape_with_chunks(tokens: int, hidden: int, chunks: int) -> DataAsFlagShape:
    """The data-as-flag shape with (about) ``chunks`` column chunks of one even width per row (a
    word never straddles two), a multiple of 8 where the row is (whole 16-byte quads: the full
    payload's quads kernel, :func:`quad_warps`): BLOCK_W is the chunk's words rounded up to a power
    of two, one per thread (at least 4 warps, at most MAX_WARPS; wider chunks, which only forced
    shapes have, give each thread several)."""
    unit = QUAD_ELEMENTS if hidden % QUAD_ELEMENTS == 0 else 2
    width = unit * math.ceil(math.ceil(hidden / max(chunks, 1)) / unit)
    chunks = math.ceil(hidden / width)
    block_w = max(next_power_of_2(width // 2), 128)
    return tokens * chunks, chunks, width, block_w, min(block_w // 32, MAX_WARPS)


@functools.lru_cache(maxsize=1024)  # pure, and asked on every data-as-flag launch
def quad_warps(shape: DataAsFlagShape, hidden: int) -> int | None:
    """num_warps of the full-payload data-as-flag kernel that moves 16-byte quads
    (fused/oneshot_quads.py: one quad per thread, at least one warp) for ``shape``, or None where a
    chunk is not whole quads (``hidden`` or the chunk width not a multiple of 8 elements): whether
    that kernel can take the call at all (:func:`takes_quads` says whether it does)."""
    _, _, width, block_w, _ = shape
    if hidden % QUAD_ELEMENTS or width % QUAD_ELEMENTS:
        return None
    return max(1, min(block_w // 128, MAX_WARPS))


@functools.lru_cache(maxsize=1024)  # pure, and asked on every full-payload launch
def takes_quads(shape: DataAsFlagShape, hidden: int, world: int) -> bool:
    """Whether a full-payload call of ``shape`` runs the quads kernel rather than the word kernel:
    where it can (:func:`quad_warps`) and where it was measured faster, programs of at least
    QUAD_MIN_WARPS warps (chunks wider than 512 columns) up to four ranks and of at least
    QUAD_MIN_WARPS_WIDE_WORLD from five. A function of the call's shape and world alone, so every
    rank runs the same kernel (a row's sum of squares is summed in the kernel's own order).

    Measured (one H100 under MPS, graph loop, hidden 7168 unless said: bench/RESULTS.md, "The
    full-payload kernel in 16-byte quads, A/B" and "The full-payload kernel's shapes, each kernel
    forced"): at W = 2 the quads kernel took 0.95x the word kernel's time at 4 and 8 tokens (4-warp
    programs) and 0.81x at 16 (8-warp programs), 1.03x at 1 and 2 tokens (2-warp programs); at
    W = 4 0.89-0.91x at 4 and 8 tokens in 4-warp programs (1.05x at 4 x 4096, a draw at 2 x 8192)
    and 0.70-0.71x in 8-warp ones (8 x 7168, 8 x 8192); at W = 8 1.01-1.16x in 2-, 4- and 8-warp
    programs (1-4 tokens) and 0.78-0.80x the word kernel in the same 16-warp shape (4 x 7168,
    4 x 8192: two programs per row)."""
    warps = quad_warps(shape, hidden)
    least = QUAD_MIN_WARPS if world < QUAD_WIDE_WORLD else QUAD_MIN_WARPS_WIDE_WORLD
    return warps is not None and warps >= least


#: The flag-based kernels' (fused/rmsnorm.py) cap: few programs, since W ranks' programs must be
#: co-resident when GPUs are shared.
FLAG_MAX_PROGRAMS = 32


@functools.lru_cache(maxsize=1024)  # pure, and asked on every new call shape
def flag_based(algo: str, tokens: int, world: int, hidden: int,
               max_programs: int = FLAG_MAX_PROGRAMS) -> tuple[int, int, int, int]:
    """(programs, rows per program, BLOCK_H, num_warps) of the flag-based one-shot (``algo``
    "oneshot": every row) or the token-split two-shot (any other: a rank's share of the rows),
    the row in one program. BLOCK_H spans the world too: the waits poll one peer per element of
    that tensor, so a row narrower than the world must not leave a peer unpolled."""
    rows = tokens if algo == "oneshot" else math.ceil(tokens / world)
    programs = max(1, min(FLAG_MAX_PROGRAMS, max_programs, rows))
    rows_per_program = max(1, math.ceil(rows / programs))
    programs = max(1, math.ceil(rows / rows_per_program))
    block_h = next_power_of_2(max(hidden, world))
    return programs, rows_per_program, block_h, 4 if block_h <= 1024 else 8 if block_h <= 4096 else 16


@functools.lru_cache(maxsize=256)  # pure, and asked on every new call shape
def add_rmsnorm(hidden: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of the add + RMSNorm kernel for rows of ``hidden`` elements: the row in
    one program, up to 32 elements (two 16-byte accesses of bf16) per thread."""
    block = next_power_of_2(hidden)
    return block, 4 if block <= 1024 else 8 if block <= 8192 else 16


def of_kernel(algo: str, dtype: object, tokens: int, hidden: int, world: int, max_programs: int,
              interpret: bool = False, chunks: int | None = None) -> tuple[tuple[int, ...], int] | None:
    """(launch shape, call signature) of the fused kernel ``algo`` for ``[tokens, hidden]`` of
    ``dtype`` within ``max_programs`` programs, or None where a data-as-flag kernel has no shape
    (:func:`data_as_flag`; ``chunks`` forces that many column chunks per row instead). What the
    plan caches and what a launch of a named kernel computes are this one answer."""
    if algo in DATA_AS_FLAG_ONESHOTS:
        shape = (data_as_flag(tokens, hidden, world, max_programs, interpret, algo == DATA_AS_FLAG_ONESHOTS[1])
                 if chunks is None
                 else shape_with_chunks(tokens, hidden, chunks))
        if shape is None:
            return None
        return shape, data_as_flag_signature(dtype, tokens, hidden, shape[0], shape[1],
                                             algo != DATA_AS_FLAG_ONESHOTS[0])
    shape = flag_based(algo, tokens, world, hidden, max_programs)
    if shape[0] > MAX_FLAG_BLOCKS:
        raise ValueError(f"fused all-reduce needs {shape[0]} programs, more than the {MAX_FLAG_BLOCKS} flag slots")
    return shape, flag_based_signature(algo, dtype, tokens, hidden, shape[0])


def no_shape(algo: str, tokens: int, hidden: int, dtype: object, world: int, capacity: int | None,
             max_programs: int) -> str:
    """Why the data-as-flag kernel ``algo`` cannot take ``[tokens, hidden]`` of ``dtype``."""
    return (f"fused {algo} cannot take [{tokens}, {hidden}] {dtype} at world size {world} (needs an even hidden "
            f"size, at most {capacity} bytes and at most {resident_programs(max_programs)} programs); use algo='auto'")


def data_as_flag_signature(dtype: object, tokens: int, hidden: int, programs: int, chunks: int,
                           full: bool = False) -> int:
    """32-bit signature of a data-as-flag call (peers must agree); differs from every other call's."""
    algo = "oneshot_full" if full else "oneshot_ll"
    return zlib.crc32(f"fused-rmsnorm:{algo}:{dtype}:{tokens}:{hidden}:{programs}:{chunks}".encode())


def flag_based_signature(algo: str, dtype: object, tokens: int, hidden: int, programs: int) -> int:
    """32-bit signature of a flag-based call (peers must agree); differs from every plain all-reduce's."""
    return zlib.crc32(f"fused-rmsnorm:{algo}:{dtype}:{tokens}:{hidden}:{programs}".encode())
