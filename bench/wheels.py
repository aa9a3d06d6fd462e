"""Trimmed copies of third-party wheels too large to carry to an offline GPU machine.

Their Python stays untouched (the benchmarks and tests run the real code); what they never load
is dropped, and RECORD loses those files' lines so the wheel stays installable:

    python -m bench.wheels flashinfer flashinfer_python-0.7.4-py3-none-any.whl DEST_DIR
    python -m bench.wheels sglang sglang-0.5.23-py3-none-any.whl DEST_DIR

- FlashInfer (the ``flashinfer`` backend): every Python file (``import flashinfer.comm`` imports much
  of the package), and of the CUDA sources only what the PCIe IPC all-reduce's JIT build compiles
  (``csrc/pcie_ipc_all_reduce.cu``, ``csrc/tvm_ffi_utils.h`` and ``include/``): 100 MB -> about
  15 MB. Its import-time dependencies there: apache-tvm-ffi, nvidia-ml-py, cuda-bindings, numpy,
  requests, tqdm, jinja2, filelock, packaging; the JIT build needs nvcc, libcuda and libcudart.
- SGLang (the plugin's GPU test): all but the native server extensions its distributed and plugin
  code never imports.
"""

from __future__ import annotations

import os
import sys
import zipfile
from typing import Callable

FLASHINFER_DATA_KEPT: tuple[str, ...] = (
    "flashinfer/data/include/",
    "flashinfer/data/csrc/pcie_ipc_",
    "flashinfer/data/csrc/tvm_ffi_utils.h",
)
FLASHINFER_SUFFIXES_KEPT: tuple[str, ...] = (".py", ".json", ".txt", ".typed", ".csv")
SGLANG_NATIVE_DROPPED: tuple[str, ...] = ("sglang/srt/rust_extensions/", "sglang/srt/mem_cache/rust_tree_core/")


def copy_wheel_keeping(src: str, dest_dir: str, keep: Callable[[str], bool]) -> str:
    """Write ``src`` into ``dest_dir`` (same file name) with only the members ``keep`` accepts;
    returns the new path."""
    dest = os.path.join(dest_dir, os.path.basename(src))
    if os.path.abspath(dest) == os.path.abspath(src):
        raise ValueError("DEST_DIR must differ from the wheel's own directory")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        dropped = {n for n in zin.namelist() if not keep(n)}
        for info in zin.infolist():
            if info.filename in dropped:
                continue
            data = zin.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if line.split(",", 1)[0] not in dropped).encode()
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return dest


def keep_flashinfer(name: str) -> bool:
    """Whether a file of FlashInfer's wheel stays."""
    if ".dist-info/" in name:
        return True
    if name.startswith("flashinfer/data/"):
        return name.startswith(FLASHINFER_DATA_KEPT)
    return name.endswith(FLASHINFER_SUFFIXES_KEPT)


def keep_sglang(name: str) -> bool:
    """Whether a file of SGLang's wheel stays (all but its native server extensions)."""
    return not (name.startswith(SGLANG_NATIVE_DROPPED) and name.endswith(".so"))


TRIMS: dict[str, Callable[[str], bool]] = {"flashinfer": keep_flashinfer, "sglang": keep_sglang}


def trim_wheel(package: str, src: str, dest_dir: str) -> str:
    """The trimmed copy of ``package``'s wheel ``src`` in ``dest_dir`` (same file name); its path."""
    return copy_wheel_keeping(src, dest_dir, TRIMS[package])


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in TRIMS:
        sys.exit(f"usage: python -m bench.wheels {{{','.join(TRIMS)}}} WHEEL DEST_DIR")
    print(trim_wheel(*sys.argv[1:]))
