"""Where a communicator's workspaces live, and the /dev/shm housekeeping of the host transport.

- ``p2p``: device memory, mapped by the peers through CUDA IPC; stores cross the GPU-to-GPU path.
- ``host``: pinned host memory in /dev/shm, registered by every rank of the host (boxes where
  peer-to-peer is missing or refused: GeForce cards on stock drivers, VMs, IOMMU/ACS, pairs across
  sockets); every load and store a kernel makes on it crosses that GPU's own PCIe link.
- ``auto`` (the default): ``p2p`` when every pair of ranks has peer access and a real transfer at
  creation arrives, else ``host``; every rank takes the same one (the decision follows exchanges
  of every rank's outcome).

The kernels and the protocol are the same on both (csrc/protocol.cuh), so every guarantee holds
on both: bounded waits, NaN on failure, bitwise identical sums on every rank and transport.

A host segment's name is removed from /dev/shm as soon as every rank has mapped it; a process
killed between creating and that point leaves a segment named ``pcie_ar-<pid>-...``, which
:func:`remove_stale_segments` deletes once that pid is gone.
"""

from __future__ import annotations

import os
import re
import stat

from pcie_allreduce.constants import TRANSPORT_IDS

TRANSPORTS: tuple[str, ...] = tuple(TRANSPORT_IDS)
CHOICES: tuple[str, ...] = ("auto", *TRANSPORTS)
ENV = "PCIE_AR_TRANSPORT"
SHM_DIR = "/dev/shm"
# csrc/workspace.cu's kSegmentPrefix, then "-<pid>-<counter>-<random>" (host_segment.cpp). The
# digit counts are bounded so a name anyone can write into /dev/shm never parses into an integer
# os.kill or the kernel would refuse.
_SEGMENT = re.compile(r"^pcie_ar-([1-9][0-9]{0,9})-[0-9]{1,20}-[0-9a-f]{1,16}$")
# Linux's PID_MAX_LIMIT (2^22): no process id is larger on any configuration.
_PID_LIMIT = 1 << 22


def validate_transport(transport: object, *, source: str = "transport") -> str:
    """``transport`` must be 'auto' or one of :data:`TRANSPORTS`."""
    if not isinstance(transport, str) or transport not in CHOICES:
        raise ValueError(f"{source}={transport!r}: expected one of {CHOICES}")
    return transport


def requested(transport: str | None) -> str:
    """The transport asked for: the argument, else ``$PCIE_AR_TRANSPORT``, else 'auto'."""
    if transport is not None:
        return validate_transport(transport)
    raw = os.environ.get(ENV)
    return "auto" if raw is None or raw == "" else validate_transport(raw.strip().lower(), source=ENV)


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a process; any doubt (an out-of-range id, an error other than "no
    such process") counts as alive, so a doubtful segment is kept rather than removed."""
    if not 0 < pid < _PID_LIMIT:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):  # PermissionError: alive, another user's
        return True
    return True


def _ours(shm_dir: str, name: str) -> bool:
    """Whether ``shm_dir/name`` is a regular file this user owns, looked at without following a
    symlink: another user's file, a link or anything else is never ours to remove."""
    try:
        st = os.lstat(os.path.join(shm_dir, name))
    except (OSError, ValueError):
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()


def stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Host segments in ``shm_dir`` whose creating process no longer exists.

    Only regular files this user owns whose names parse as a segment's count; anything else in
    the (world-writable) directory is ignored, whatever its name, so no other user's file can
    make this fail or make it remove something."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    stale = []
    for name in names:
        match = _SEGMENT.fullmatch(name)
        if match and _ours(shm_dir, name) and not _pid_alive(int(match.group(1))):
            stale.append(os.path.join(shm_dir, name))
    return sorted(stale)


def remove_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Delete :func:`stale_segments`; returns the paths removed (others' files it may not delete
    are left alone)."""
    removed = []
    for path in stale_segments(shm_dir):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed
