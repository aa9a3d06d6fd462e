"""Where ``pcie-allreduce tune`` keeps its tables: one JSON file per (GPU model, W, topology).

    $PCIE_AR_CACHE_DIR, else $XDG_CACHE_HOME/pcie_allreduce, else ~/.cache/pcie_allreduce
        <gpu>-w<W>-<fingerprint>.json      e.g. nvidia-h200-w4-3f9c1a2b7d04.json

The fingerprint is a hash of how the ranks sit on GPUs and of the fabric between them: the PCI bus
id of every rank's GPU (in rank order, so it also tells emulation, several ranks on one GPU, from
distinct GPUs), the CUDA peer-access matrix between those GPUs, and the islands the ranks form
where there are two or more (``Communicator.islands``: switches, NUMA nodes, or
``$PCIE_AR_ISLANDS``), so a table tuned on one fabric (whose picks may be island or pull forms)
is never loaded by a group that sees another. One island adds nothing, so flat fingerprints are
the same as before islands counted. A communicator can compute it at creation from facts it
already exchanges (see :func:`fingerprint_of`), so the table it loads is keyed exactly like the
one ``tune`` wrote. Pure except for :func:`fingerprint_of`, which asks the extension.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any, Callable, Mapping, Sequence

CACHE_ENV = "PCIE_AR_CACHE_DIR"
FINGERPRINT_CHARS = 12


def cache_dir(environ: Mapping[str, str] | None = None) -> str:
    """The cache directory (not created here)."""
    env = os.environ if environ is None else environ
    if env.get(CACHE_ENV):
        return env[CACHE_ENV]
    base = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pcie_allreduce")


def gpu_slug(name: str) -> str:
    """"NVIDIA H200" -> "nvidia-h200"; "NVIDIA RTX PRO 6000 Blackwell" -> "nvidia-rtx-pro-6000-blackwell"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def fingerprint(bus_ids_by_rank: Sequence[str], can_access: Callable[[str, str], bool],
                islands: Sequence[Sequence[int]] = ()) -> str:
    """Hash of the ranks' GPUs (PCI bus ids, rank order), the peer access between distinct ones,
    and ``islands`` (groups of ranks) where there are two or more."""
    ids = [b.strip().lower() for b in bus_ids_by_rank]
    gpus = sorted(set(ids))
    access = [[a == b or bool(can_access(a, b)) for b in gpus] for a in gpus]
    facts: dict[str, Any] = {"ranks": ids, "gpus": gpus, "peer_access": access}
    if len(islands) > 1:
        facts["islands"] = sorted(sorted(int(r) for r in group) for group in islands)
    blob = json.dumps(facts, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:FINGERPRINT_CHARS]


def fingerprint_of(ext: Any, bus_ids_by_rank: Sequence[str], islands: Sequence[Sequence[int]] = ()) -> str:
    """:func:`fingerprint` with peer access asked of ``pcie_allreduce._C`` (GPUs found by bus id).

    For a communicator: ``fingerprint_of(comm._ext, [p.pci_bus_id for p in comm.placements], comm.islands)``.
    """
    def can_access(a: str, b: str) -> bool:
        da, db = ext.device_by_pci_bus_id(a), ext.device_by_pci_bus_id(b)
        return da >= 0 and db >= 0 and bool(ext.can_access_peer(da, db))

    return fingerprint(bus_ids_by_rank, can_access, islands)


def table_name(gpu_name: str, world: int, fp: str, transport: str = "p2p") -> str:
    return f"{gpu_slug(gpu_name)}-w{world}-{fp}{'-host' if transport == 'host' else ''}.json"


def table_path(gpu_name: str, world: int, fp: str, directory: str | None = None, transport: str = "p2p") -> str:
    """The cache file of a (GPU model, W, fingerprint, transport): the host transport's tables
    are kept apart, since its algorithms and crossovers differ."""
    return os.path.join(directory or cache_dir(), table_name(gpu_name, world, fp, transport))


def write_table(path: str, table_json: str, meta: dict[str, Any]) -> None:
    """Write an AlgoTable's JSON with a ``meta`` object beside its ``rules`` (the loader ignores it)."""
    data = json.loads(table_json)
    data["meta"] = meta
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, path)  # readers never see a half-written table
