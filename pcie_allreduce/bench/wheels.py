"""Copy a wheel without some of its files, keeping it installable (RECORD loses their lines).

How third-party packages too large to carry (SGLang, FlashInfer) reach the offline GPU machine:
their Python stays untouched, what the tests and benchmarks never load is dropped.
"""

from __future__ import annotations

import os
import zipfile
from typing import Callable


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
