"""Make FlashInfer's wheel small enough to carry to an offline GPU machine for the ``flashinfer``
bench backend: keep every Python file (``import flashinfer.comm`` imports much of the package),
and of the CUDA sources only what the PCIe IPC all-reduce's JIT build compiles
(``csrc/pcie_ipc_all_reduce.cu``, ``csrc/tvm_ffi_utils.h`` and ``include/``). The rest (CUTLASS,
CCCL, the other kernels' sources, prebuilt binaries) goes: 100 MB -> about 15 MB.

    python -m pcie_allreduce.bench.trim_flashinfer flashinfer_python-0.7.4-py3-none-any.whl DEST_DIR

Its import-time dependencies on that machine: apache-tvm-ffi, nvidia-ml-py, cuda-bindings
(``cuda.bindings.driver``), numpy, requests, tqdm, jinja2, filelock, packaging. The JIT build
needs nvcc and links libcuda / libcudart, so it runs only where those exist.
"""

from __future__ import annotations

import sys

from pcie_allreduce.bench.wheels import copy_wheel_keeping

KEEP_DATA_PREFIXES: tuple[str, ...] = (
    "flashinfer/data/include/",
    "flashinfer/data/csrc/pcie_ipc_",
    "flashinfer/data/csrc/tvm_ffi_utils.h",
)
KEEP_SUFFIXES: tuple[str, ...] = (".py", ".json", ".txt", ".typed", ".csv")


def keep(name: str) -> bool:
    """Whether a file of the wheel stays."""
    if ".dist-info/" in name:
        return True
    if name.startswith("flashinfer/data/"):
        return name.startswith(KEEP_DATA_PREFIXES)
    return name.endswith(KEEP_SUFFIXES)


def trim_wheel(src: str, dest_dir: str) -> str:
    """Write the trimmed copy of ``src`` into ``dest_dir`` (same file name); returns its path."""
    return copy_wheel_keeping(src, dest_dir, keep)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m pcie_allreduce.bench.trim_flashinfer FLASHINFER_WHEEL DEST_DIR")
    print(trim_wheel(sys.argv[1], sys.argv[2]))
