"""Argument checks for the collective entry points, with messages that name the problem.

Pure functions over tensors' metadata (no CUDA calls), so they run, and are tested, on a CPU.
"""

from __future__ import annotations

import torch

from pcie_allreduce.algo import ALGO_IDS, ALGORITHMS

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


def validate_tensor(x: object, *, name: str, device: torch.device, max_bytes: int,
                    dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES) -> torch.Tensor:
    """``x`` must be a contiguous tensor of a supported dtype on ``device`` within ``max_bytes``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} has dtype {x.dtype}; supported: {names}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, the communicator on {device}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {tuple(x.stride())}); call .contiguous() first")
    nbytes = x.numel() * x.element_size()
    if nbytes > max_bytes:
        raise ValueError(f"{name} has {nbytes} bytes, more than the communicator's max_bytes={max_bytes}; "
                         "create the Communicator with a larger max_bytes")
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


def validate_algo(algo: object) -> str:
    """``algo`` must be 'auto' or one of the algorithms."""
    if not isinstance(algo, str) or (algo != "auto" and algo not in ALGO_IDS):
        raise ValueError(f"unknown algo {algo!r}; expected 'auto' or one of {ALGORITHMS}")
    return algo


RMSNORM_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
MAX_RMSNORM_HIDDEN = 16384


def validate_rmsnorm_args(x: object, residual: object, weight: object, eps: object, *, device: torch.device,
                          max_bytes: int) -> None:
    """Arguments of the fused all-reduce + residual + RMSNorm."""
    validate_tensor(x, name="x", device=device, max_bytes=max_bytes, dtypes=RMSNORM_DTYPES)
    assert isinstance(x, torch.Tensor)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
    hidden = x.shape[1]
    if not 1 <= hidden <= MAX_RMSNORM_HIDDEN:
        raise ValueError(f"hidden size {hidden} is outside [1, {MAX_RMSNORM_HIDDEN}]")
    validate_tensor(residual, name="residual", device=device, max_bytes=max_bytes, dtypes=RMSNORM_DTYPES)
    assert isinstance(residual, torch.Tensor)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual ({residual.dtype}, {tuple(residual.shape)}) must match x "
                         f"({x.dtype}, {tuple(x.shape)})")
    validate_tensor(weight, name="weight", device=device, max_bytes=max_bytes, dtypes=(x.dtype, torch.float32))
    assert isinstance(weight, torch.Tensor)
    if tuple(weight.shape) != (hidden,):
        raise ValueError(f"weight must have shape ({hidden},), got {tuple(weight.shape)}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
        raise ValueError(f"eps must be a positive float, got {eps!r}")
