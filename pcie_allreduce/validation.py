"""Argument checks for the collective entry points, with messages that name the problem.

Pure functions over tensors' metadata (no CUDA calls), so they run, and are tested, on a CPU.
"""

from __future__ import annotations

import math

import torch

from pcie_allreduce.constants import DTYPE_IDS, MAX_MESSAGE_BYTES, MAX_TIMEOUT_S
from pcie_allreduce.plan.algorithms import (ALGO_IDS, FORCEABLE_ALGORITHMS, FUSED_ALGORITHMS, UNFUSED, WIRE_ALGORITHMS,
                                            fused_problem)

#: The dtypes the kernels take (those with a kernel dtype id), in id order.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(getattr(torch, name)
                                                  for name in sorted(DTYPE_IDS, key=DTYPE_IDS.__getitem__))
_SUPPORTED_DTYPE_SET: frozenset[torch.dtype] = frozenset(SUPPORTED_DTYPES)


def tensor_problem(x: object, *, name: str, device: torch.device, max_bytes: int,
                   dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES) -> Exception | None:
    """What :func:`validate_tensor` would raise for ``x`` (not raised), or None: the one check that a
    plugin's ``should_custom_ar`` asks before a call and the call makes again."""
    if not isinstance(x, torch.Tensor):
        return TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        return TypeError(f"{name} has dtype {x.dtype}; supported: {names}")
    if x.device != device:
        return ValueError(f"{name} is on {x.device}, the communicator on {device}")
    if not x.is_contiguous():
        return ValueError(f"{name} must be contiguous (got strides {tuple(x.stride())}); call .contiguous() first")
    nbytes = x.numel() * x.element_size()
    if nbytes > max_bytes:
        return ValueError(f"{name} has {nbytes} bytes, more than the communicator's max_bytes={max_bytes}; "
                          "create the Communicator with a larger max_bytes")
    return None


def validate_tensor(x: object, *, name: str, device: torch.device, max_bytes: int,
                    dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES) -> torch.Tensor:
    """``x`` must be a contiguous tensor of a supported dtype on ``device`` within ``max_bytes``."""
    problem = tensor_problem(x, name=name, device=device, max_bytes=max_bytes, dtypes=dtypes)
    if problem is not None:
        raise problem
    assert isinstance(x, torch.Tensor)
    return x


def validate_out(x: torch.Tensor, out: object, *, name: str = "out") -> None:
    """``out`` must be ``x`` itself (in place) or a same-shaped, non-overlapping contiguous tensor."""
    if out is None or out is x:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != x.dtype or out.shape != x.shape or out.device != x.device:
        raise ValueError(f"{name} ({out.dtype}, {tuple(out.shape)}, {out.device}) must match the input "
                         f"({x.dtype}, {tuple(x.shape)}, {x.device})")
    if not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {tuple(out.stride())})")
    nbytes = x.numel() * x.element_size()
    a, b = x.data_ptr(), out.data_ptr()
    if a != b and a < b + nbytes and b < a + nbytes:
        raise ValueError(f"{name} partially overlaps the input; pass {name}=x for in place or a separate tensor")


def common_call_nbytes(x: object, out: object, device: torch.device, max_bytes: int) -> int:
    """``x``'s size in bytes when (x, out) is the common, valid all-reduce call, else -1.

    The same conditions as :func:`validate_tensor` + :func:`validate_out` with the cheapest reads
    torch has (those functions were half of an eager call's Python time): a plain tensor of a
    supported dtype on ``device``, contiguous, within ``max_bytes``; ``out`` None, ``x``, or a
    matching contiguous tensor that does not partly overlap it. Stricter only where that is
    cheaper (subclasses go the long way), so -1 never means the call is invalid: the caller then
    runs the full checks, which raise the precise error or accept the call."""
    if (type(x) is not torch.Tensor or x.dtype not in _SUPPORTED_DTYPE_SET or x.device != device
            or not x.is_contiguous()):
        return -1
    nbytes = x.nbytes
    if nbytes > max_bytes:
        return -1
    if out is None or out is x:
        return nbytes
    if (type(out) is not torch.Tensor or out.dtype is not x.dtype or out.shape != x.shape
            or out.device != device or not out.is_contiguous()):
        return -1
    a, b = x.data_ptr(), out.data_ptr()
    return -1 if a != b and a < b + nbytes and b < a + nbytes else nbytes


def plain_call(x: object, out: object, algo: object, *, device: torch.device, max_bytes: int) -> int:
    """The one check of an ``all_reduce(x, out, algo)`` call: ``x``, ``out`` (and their overlap)
    and the algorithm name; returns the message size in bytes, what dispatch needs. The common
    call costs :func:`common_call_nbytes`; anything else runs the full checks, which raise the
    precise error or accept the call."""
    nbytes = common_call_nbytes(x, out, device, max_bytes)
    if nbytes < 0:
        validate_tensor(x, name="input", device=device, max_bytes=max_bytes)
        assert isinstance(x, torch.Tensor)
        validate_out(x, out)
        nbytes = x.numel() * x.element_size()
    if algo != "auto":
        validate_algo(algo)
    return nbytes


def symmetric_input_numel(shape: tuple[object, ...], dtype: object, *, max_bytes: int, transport: str) -> int:
    """Elements of a ``Communicator.symmetric_input(shape, dtype)`` tensor, after checking the
    shape (non-negative ints), the dtype (one the kernels take), the size (within ``max_bytes``,
    the area's size) and the transport (p2p: the host transport's workspace has no such area)."""
    if transport != "p2p":
        raise ValueError(f"symmetric_input needs the p2p transport: this communicator's is {transport!r}, whose "
                         "workspace lives in host memory; pass ordinary tensors to all_reduce")
    if not isinstance(dtype, torch.dtype) or dtype not in _SUPPORTED_DTYPE_SET:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"symmetric_input's dtype must be one of {names}, got {dtype!r}")
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise ValueError(f"symmetric_input's shape must be non-negative ints, got {shape!r}")
    numel = math.prod(shape)  # type: ignore[arg-type]
    if numel * dtype.itemsize > max_bytes:
        raise ValueError(f"symmetric_input({shape}, {dtype}) needs {numel * dtype.itemsize} bytes, more than the "
                         f"communicator's max_bytes={max_bytes} (the area's size); create the Communicator with a "
                         "larger max_bytes")
    return numel


def validate_max_bytes(max_bytes: object) -> int:
    """``max_bytes`` of a communicator: an int in [1, MAX_MESSAGE_BYTES]."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or not 1 <= max_bytes <= MAX_MESSAGE_BYTES:
        raise ValueError(f"max_bytes must be an int in [1, {MAX_MESSAGE_BYTES}] ({MAX_MESSAGE_BYTES >> 20} MiB: "
                         f"larger messages are NCCL's ground), got {max_bytes!r}")
    return max_bytes


def validate_timeout(timeout_s: object, *, source: str = "timeout_s") -> float:
    """A kernel timeout in seconds: a finite number in (0, MAX_TIMEOUT_S]; ``source`` names where
    it came from in the error (the argument or the environment variable)."""
    try:
        value = float(timeout_s)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{source}={timeout_s!r} is not a number of seconds") from None
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise ValueError(f"{source} must be a number of seconds in (0, {MAX_TIMEOUT_S}], got {timeout_s!r}")
    return value


def validate_algo(algo: object) -> str:
    """``algo`` must be 'auto' or one of the algorithms."""
    if not isinstance(algo, str) or (algo != "auto" and algo not in ALGO_IDS):
        raise ValueError(f"unknown algo {algo!r}; expected 'auto' or one of {FORCEABLE_ALGORITHMS}")
    return algo


def wire_algo(wire: object, algo: str) -> str:
    """The algorithm a call with ``wire`` (None: the message's own bytes; or a name of
    WIRE_ALGORITHMS) and ``algo`` runs: ``algo`` itself without a wire, else the wire's kernel,
    which ``algo`` must be "auto" or name."""
    if wire is None:
        return algo
    if not isinstance(wire, str) or wire not in WIRE_ALGORITHMS:
        raise ValueError(f"unknown wire {wire!r}; expected None (lossless) or one of {tuple(WIRE_ALGORITHMS)}")
    kernel = WIRE_ALGORITHMS[wire]
    if algo not in ("auto", kernel):
        raise ValueError(f"wire={wire!r} runs {kernel!r}; algo={algo!r} cannot be combined with it (leave algo='auto')")
    return kernel


RMSNORM_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
MAX_RMSNORM_HIDDEN = 16384


def rmsnorm_problem(x: object, residual: object, weight: object, eps: object, *, device: torch.device,
                    max_bytes: int) -> Exception | None:
    """What :func:`validate_rmsnorm_args` would raise (not raised), or None: the one check that a
    plugin's ``can_fuse`` asks before a fused call and the call makes again, so nothing a plugin
    accepts is refused inside a forward pass."""
    problem = tensor_problem(x, name="x", device=device, max_bytes=max_bytes, dtypes=RMSNORM_DTYPES)
    if problem is not None:
        return problem
    assert isinstance(x, torch.Tensor)
    if x.dim() != 2:
        return ValueError(f"x must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
    hidden = x.shape[1]
    if not 1 <= hidden <= MAX_RMSNORM_HIDDEN:
        return ValueError(f"hidden size {hidden} is outside [1, {MAX_RMSNORM_HIDDEN}]")
    problem = tensor_problem(residual, name="residual", device=device, max_bytes=max_bytes, dtypes=RMSNORM_DTYPES)
    if problem is not None:
        return problem
    assert isinstance(residual, torch.Tensor)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        return ValueError(f"residual ({residual.dtype}, {tuple(residual.shape)}) must match x "
                          f"({x.dtype}, {tuple(x.shape)})")
    # The weight is read in place, never staged in the workspace: no max_bytes for it.
    problem = tensor_problem(weight, name="weight", device=device, max_bytes=MAX_MESSAGE_BYTES,
                             dtypes=(x.dtype, torch.float32))
    if problem is not None:
        return problem
    assert isinstance(weight, torch.Tensor)
    if tuple(weight.shape) != (hidden,):
        return ValueError(f"weight must have shape ({hidden},), got {tuple(weight.shape)}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not (math.isfinite(eps) and eps > 0):
        return ValueError(f"eps must be a positive finite float, got {eps!r}")
    return None


def validate_rmsnorm_args(x: object, residual: object, weight: object, eps: object, *, device: torch.device,
                          max_bytes: int) -> None:
    """Arguments of the fused all-reduce + residual + RMSNorm (:func:`rmsnorm_problem`, raised)."""
    problem = rmsnorm_problem(x, residual, weight, eps, device=device, max_bytes=max_bytes)
    if problem is not None:
        raise problem


def fused_call(x: object, residual: object, weight: object, eps: object, out: object, residual_out: object,
               algo: object, wire: object, *, device: torch.device, max_bytes: int,
               world: int) -> tuple[int, int, str, str | None]:
    """The one check of an ``all_reduce_rmsnorm`` call on ``world`` ranks: every tensor, both
    outputs against their inputs, every pair of arguments for shared memory, the algorithm name
    (and that it serves ``world``) and the wire; returns ``(tokens, hidden, algo, wire_algo)``,
    what the fused plan needs: a call with a wire runs the all-reduce with the wire's kernel
    (``wire_algo``), then the add + RMSNorm kernel, so ``algo`` is then "unfused"."""
    validate_rmsnorm_args(x, residual, weight, eps, device=device, max_bytes=max_bytes)
    assert isinstance(x, torch.Tensor) and isinstance(residual, torch.Tensor) and isinstance(weight, torch.Tensor)
    validate_out(x, out, name="out")
    validate_out(residual, residual_out, name="residual_out")
    if algo != "auto" and algo not in FUSED_ALGORITHMS:
        raise ValueError(f"unknown fused algo {algo!r}; expected 'auto' or one of {FUSED_ALGORITHMS}")
    problem = None if algo == "auto" else fused_problem(algo, world)  # type: ignore[arg-type]
    if problem is not None:
        raise ValueError(problem)
    validate_rmsnorm_aliasing(x, residual, weight, out, residual_out)  # type: ignore[arg-type]
    if wire is None:
        return x.shape[0], x.shape[1], algo, None  # type: ignore[return-value]
    kernel = wire_algo(wire, "auto")
    if algo not in ("auto", UNFUSED):
        raise ValueError(f"wire={wire!r} runs the all-reduce, then the add + RMSNorm kernel; algo={algo!r} "
                         f"cannot be combined with it (leave algo='auto')")
    return x.shape[0], x.shape[1], UNFUSED, kernel


def warm_up_calls(shapes: object, dtype: torch.dtype, weight_dtype: torch.dtype, algo: object, *,
                  device: torch.device, max_bytes: int,
                  world: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]]:
    """The calls ``warm_up_fused`` compiles, each checked as :func:`fused_call` checks a call:
    ``(x, residual, weight, algo)`` with (uninitialised) tensors of each ``(tokens, hidden)`` of
    ``shapes``. A shape that is not two positive ints is refused, naming it."""
    calls = []
    for shape in shapes:  # type: ignore[attr-defined]
        if not (isinstance(shape, (tuple, list)) and len(shape) == 2
                and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)):
            raise ValueError(f"warm_up_fused: each shape must be (tokens, hidden), two positive ints; got {shape!r}")
        x = torch.empty(tuple(shape), dtype=dtype, device=device)
        residual, weight = torch.empty_like(x), torch.empty(shape[1], dtype=weight_dtype, device=device)
        _, _, call_algo, _ = fused_call(x, residual, weight, 1e-6, None, None, algo, None, device=device,
                                        max_bytes=max_bytes, world=world)
        calls.append((x, residual, weight, call_algo))
    return calls


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def validate_rmsnorm_aliasing(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              normed: torch.Tensor | None, new_residual: torch.Tensor | None) -> None:
    """The outputs of the fused all-reduce + RMSNorm may be their own inputs (``out`` is ``x``,
    ``residual_out`` is ``residual``: in place) and must share memory with nothing else: the
    kernels store a row of one output while other rows of the inputs are still to be read, so any
    other overlap would corrupt a result without an error. An output left None is a new tensor
    (an empty span, which overlaps nothing)."""
    operands = (("x", x), ("residual", residual), ("weight", weight), ("out", normed), ("residual_out", new_residual))
    in_place = {("out", "x"), ("residual_out", "residual")}
    spans = {name: (0, 0) if t is None else _span(t) for name, t in operands}
    for written in ("out", "residual_out"):
        a0, a1 = spans[written]
        for name, _ in operands:
            if name == written or (written, name) in in_place or (name == "out" and written == "residual_out"):
                continue
            b0, b1 = spans[name]
            if a0 < b1 and b0 < a1:
                problem = "is" if (a0, a1) == (b0, b1) else "overlaps"
                raise ValueError(f"{written} {problem} {name}: the outputs may only be their own inputs "
                                 "(out=x, residual_out=residual, in place) and must not share memory with "
                                 "any other argument")
