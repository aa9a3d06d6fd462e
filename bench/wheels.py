"""Trimmed copies of third-party wheels too large to carry to an offline GPU machine.

Their Python stays untouched (the benchmarks and tests run the real code); what they never load
is dropped, and RECORD loses those files' lines so the wheel stays installable (vLLM's copy gains
one stand-in module, listed in RECORD):

    python -m bench.wheels flashinfer flashinfer_python-0.7.4-py3-none-any.whl DEST_DIR
    python -m bench.wheels sglang sglang-0.5.23-py3-none-any.whl DEST_DIR
    python -m bench.wheels vllm vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl DEST_DIR

- FlashInfer (the ``flashinfer`` backend and the ``fi_addnorm`` baseline): every Python file
  (``import flashinfer.comm`` imports much of the package), and of the CUDA sources only what the
  JIT builds of the PCIe IPC all-reduce and of ``fused_add_rmsnorm`` compile (``csrc/pcie_ipc_*``,
  ``csrc/norm.cu``, ``csrc/flashinfer_norm_binding.cu``, ``csrc/tvm_ffi_utils.h`` and ``include/``):
  100 MB -> about 15 MB. Its import-time dependencies there: apache-tvm-ffi, nvidia-ml-py, cuda-bindings, numpy,
  requests, tqdm, jinja2, filelock, packaging; the JIT build needs nvcc, libcuda and libcudart.
- SGLang (the plugin's GPU test): all but the native server extensions its distributed and plugin
  code never imports.
- vLLM (the plugin's GPU test): every .py/.json/.txt/.typed/.jinja file and the metadata, none of its
  native extensions, its Rust server binary, CUDA/CUTLASS sources or web assets: 239 MB -> about
  14 MB. ``vllm.platforms.cuda`` imports the kernel library ``vllm._C_stable_libtorch`` at import,
  so the copy adds a stand-in module of that name with no ops (the library is built for the torch
  vLLM pins): the distributed and plugin code the test runs never calls them, while
  ``vllm.compilation`` (``torch.ops._C`` at import) and ``vllm.vllm_flash_attn`` stay unimportable.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import sys
import zipfile
from typing import Callable, Mapping

FLASHINFER_DATA_KEPT: tuple[str, ...] = (
    "flashinfer/data/include/",
    "flashinfer/data/csrc/pcie_ipc_",
    "flashinfer/data/csrc/tvm_ffi_utils.h",
    "flashinfer/data/csrc/norm.cu",
    "flashinfer/data/csrc/flashinfer_norm_binding.cu",
)
FLASHINFER_SUFFIXES_KEPT: tuple[str, ...] = (".py", ".json", ".txt", ".typed", ".csv")
SGLANG_NATIVE_DROPPED: tuple[str, ...] = ("sglang/srt/rust_extensions/", "sglang/srt/mem_cache/rust_tree_core/")
VLLM_SUFFIXES_KEPT: tuple[str, ...] = (".py", ".json", ".txt", ".typed", ".jinja")
VLLM_STAND_INS: dict[str, str] = {
    "vllm/_C_stable_libtorch.py": '"""Stand-in for vLLM\'s native kernel library, dropped from this trimmed wheel '
                                  '(bench/wheels.py): registers no ops."""\n',
}


def _record_path(line: str) -> str:
    """The file a RECORD line names (CSV: a name holding a comma is quoted)."""
    return next(csv.reader([line]), [""])[0]


def _record_line(name: str, data: bytes) -> str:
    """RECORD's line for a file ``name`` holding ``data``."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    line = io.StringIO()
    csv.writer(line, lineterminator="\n").writerow([name, f"sha256={digest}", len(data)])
    return line.getvalue()


def copy_wheel_keeping(src: str, dest_dir: str, keep: Callable[[str], bool],
                       added: Mapping[str, str] | None = None) -> str:
    """Write ``src`` into ``dest_dir`` (same file name) with only the members ``keep`` accepts, plus
    the ``added`` files (name -> text; listed in RECORD); returns the new path."""
    dest = os.path.join(dest_dir, os.path.basename(src))
    if os.path.abspath(dest) == os.path.abspath(src):
        raise ValueError("DEST_DIR must differ from the wheel's own directory")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        dropped = {n for n in zin.namelist() if not keep(n)}
        extra = {name: text.encode() for name, text in (added or {}).items()}
        if any(name in zin.namelist() and name not in dropped for name in extra):
            raise ValueError("an added file would replace one the wheel keeps")
        for info in zin.infolist():
            if info.filename in dropped:
                continue
            data = zin.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                kept_lines = [line for line in lines if _record_path(line) not in dropped]
                data = "".join(kept_lines + [_record_line(n, d) for n, d in extra.items()]).encode()
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
        for name, data in extra.items():
            zout.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), data,
                          compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
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


def keep_vllm(name: str) -> bool:
    """Whether a file of vLLM's wheel stays (its Python, configs and templates, not its native code)."""
    return ".dist-info/" in name or name.endswith(VLLM_SUFFIXES_KEPT)


TRIMS: dict[str, Callable[[str], bool]] = {"flashinfer": keep_flashinfer, "sglang": keep_sglang, "vllm": keep_vllm}
ADDED: dict[str, Mapping[str, str]] = {"vllm": VLLM_STAND_INS}


def trim_wheel(package: str, src: str, dest_dir: str) -> str:
    """The trimmed copy of ``package``'s wheel ``src`` in ``dest_dir`` (same file name); its path."""
    return copy_wheel_keeping(src, dest_dir, TRIMS[package], ADDED.get(package))


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in TRIMS:
        sys.exit(f"usage: python -m bench.wheels {{{','.join(TRIMS)}}} WHEEL DEST_DIR")
    print(trim_wheel(*sys.argv[1:]))
