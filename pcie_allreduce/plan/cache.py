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
one ``tune`` wrote. Pure except for :func:`fingerprint_of`, which asks the extension, and the
reading of tables. :func:`find_tuned` and :func:`resolve_table` are how a communicator adopts a
cached table at creation: rank 0 finds it, every rank resolves rank 0's copy to the same table.
Writing a table is ``tune``'s alone (:mod:`pcie_allreduce.tools.tune.cache`): a serving process
only reads.

A cached table decides what every Communicator here runs, so only the user's own may be used:
:func:`read_table` refuses (a warning, then the built-in table) a directory that is not the user's
(or root's) or that group or others can write, and a file that is a symbolic link, not a regular
file, not the user's, or writable by group or others (:func:`untrusted` says why).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import warnings
from typing import Any, Callable, Mapping, Sequence

from pcie_allreduce.plan.tables import AlgoTable, default_table

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


def read_table(path: str) -> str | None:
    """The text of the cached table at ``path``; None where there is none, or (with a warning) where
    it cannot be read or trusted (module docstring)."""
    try:
        problem = untrusted(os.stat(os.path.dirname(os.path.abspath(path))), "directory")
        if problem is not None:
            if os.path.lexists(path):
                warnings.warn(f"pcie_allreduce: ignoring tuned table {path}: its {problem}; using the default")
            return None
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symbolic link
        why = "it is a symbolic link" if os.path.islink(path) else f"cannot open it ({exc.strerror})"
        warnings.warn(f"pcie_allreduce: ignoring tuned table {path}: {why}; using the default")
        return None
    with os.fdopen(fd, "rb") as fh:
        problem = untrusted(os.fstat(fh.fileno()), "file")
        if problem is not None:
            warnings.warn(f"pcie_allreduce: ignoring tuned table {path}: the {problem}; using the default")
            return None
        try:
            return fh.read().decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            warnings.warn(f"pcie_allreduce: cannot read tuned table {path} ({exc}); using the default")
            return None


def untrusted(st: os.stat_result, what: str) -> str | None:
    """Why a cache ``what`` ("file" or "directory") with this ``stat`` may not be trusted, or None."""
    kind = stat.S_ISDIR if what == "directory" else stat.S_ISREG
    if not kind(st.st_mode):
        return f"{what} is not a regular {what}" if what == "file" else "directory is not a directory"
    if st.st_uid not in _owners():
        return f"{what} belongs to user id {st.st_uid}, not to this user ({os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "others" if st.st_mode & stat.S_IWOTH else "its group"
        return f"{what} is writable by {who} (mode {st.st_mode & 0o7777:o})"
    return None


def _owners() -> tuple[int, ...]:
    """Who may own a cache directory or table: this user, and root (who can write anything anyway)."""
    return (os.geteuid(), 0)


def find_tuned(ext: Any, bus_ids_by_rank: Sequence[str], islands: Sequence[Sequence[int]], gpu_name: str, world: int,
               transport: str) -> tuple[str, str] | None:
    """(path, text) of the table cached for these GPUs, islands, GPU model, W and transport; None
    where there is none or it cannot be trusted (:func:`read_table` warns then)."""
    path = table_path(gpu_name, world, fingerprint_of(ext, bus_ids_by_rank, islands), transport=transport)
    text = read_table(path)
    return None if text is None else (path, text)


def resolve_table(found: Sequence[str] | None, transport: str, islands: Sequence[Sequence[int]],
                  island_ranks: int) -> tuple[AlgoTable, str]:
    """The table a communicator adopts and where it came from (its ``table_source``).

    ``found`` is rank 0's :func:`find_tuned`, the same on every rank: that tuned table where it
    parses and every algorithm it names can run on this ``transport`` with islands of
    ``island_ranks`` ranks, else the built-in table of the transport and islands. A table that
    fails either check warns and means the built-in one, never a failed creation: a table tuned
    where the ranks formed islands names island algorithms, and this group's islands may differ
    ($PCIE_AR_ISLANDS)."""
    table = default_table(transport, islands=len(islands))
    source = ("built-in default" if transport == "host" or len(islands) < 2
              else f"built-in default for {len(islands)} islands (an estimate)")
    path, text = found or (None, None)
    if text is None:
        return table, source
    try:
        tuned = AlgoTable.from_json(text, source=f"tuned table {path}")
    except ValueError as exc:
        warnings.warn(f"pcie_allreduce: ignoring tuned table: {exc}; using the default")
        return table, source
    problem = tuned.availability_problem(transport, island_ranks)
    if problem is not None:
        warnings.warn(f"pcie_allreduce: ignoring tuned table {path}: {problem}; using the default")
        return table, source
    return tuned, f"tune cache {path}"
