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
killed between creating and that point leaves a segment behind, which
:func:`remove_stale_segments` deletes once its creator is gone. Ownership is read from the name,
``pcie_ar-<boot id>-<pid namespace>-<pid>-<start time>-<counter>-<random>``: the boot, the PID
namespace's inode and the process's start time (in clock ticks since boot) tell a dead creator
from a live one in another container sharing /dev/shm (whose pids mean other processes) or from
a later process that reuses its pid. A segment of another PID namespace is never removed.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import stat
from dataclasses import dataclass

from pcie_allreduce.constants import TRANSPORT_IDS
from pcie_allreduce.settings import parse_choice

TRANSPORTS: tuple[str, ...] = tuple(TRANSPORT_IDS)
CHOICES: tuple[str, ...] = ("auto", *TRANSPORTS)
ENV = "PCIE_AR_TRANSPORT"
SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "pcie_ar"
_BOOT_ID = "/proc/sys/kernel/random/boot_id"
# Every field's size is bounded, so a name anyone can write into /dev/shm parses quickly or not at
# all, never into an absurd integer: boot id (its 32 hex digits), PID namespace inode, pid, start
# time, the creating process's counter, 48 random bits.
_SEGMENT = re.compile(SEGMENT_PREFIX + r"-([0-9a-f]{32})-([1-9][0-9]{0,19})-([1-9][0-9]{0,9})-([0-9]{1,20})"
                      r"-[0-9]{1,20}-[0-9a-f]{12}")
# Linux's PID_MAX_LIMIT (2^22): no process id is larger on any configuration.
_PID_LIMIT = 1 << 22
_UINT64_LIMIT = 1 << 64
_counter = itertools.count()


@dataclass(frozen=True)
class Creator:
    """Who created a host segment: a process on one boot of this machine, in one PID namespace."""

    boot_id: str  # /proc/sys/kernel/random/boot_id without its dashes
    pid_namespace: int  # inode of /proc/<pid>/ns/pid
    pid: int  # as that namespace numbers it
    start_time: int  # field 22 of /proc/<pid>/stat: clock ticks after boot


def validate_transport(transport: object, *, source: str = "transport") -> str:
    """``transport`` must be 'auto' or one of :data:`TRANSPORTS`."""
    if not isinstance(transport, str) or transport not in CHOICES:
        raise ValueError(f"{source}={transport!r}: expected one of {CHOICES}")
    return transport


def requested(transport: str | None) -> str:
    """The transport asked for: the argument, else ``$PCIE_AR_TRANSPORT``, else 'auto'."""
    if transport is not None:
        return validate_transport(transport)
    raw = os.environ.get(ENV, "")
    return "auto" if not raw.strip() else parse_choice(ENV, raw, CHOICES)


def _boot_id() -> str | None:
    try:
        with open(_BOOT_ID, encoding="ascii") as fh:
            text = fh.read(64).strip().replace("-", "")
    except (OSError, ValueError):
        return None
    return text if re.fullmatch(r"[0-9a-f]{32}", text) else None


def _start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat``; raises FileNotFoundError when there is no such process,
    returns None when the file cannot be read or parsed."""
    with open(f"/proc/{pid}/stat", "rb") as fh:  # FileNotFoundError: no such process
        text = fh.read(4096)
    # The command name (field 2) is in parentheses and may hold spaces and ')': fields 3 on
    # follow its last ')'.
    fields = text[text.rfind(b")") + 1:].split()
    if len(fields) < 20 or not fields[19].isdigit() or len(fields[19]) > 20:
        return None
    return int(fields[19])


def current_creator() -> Creator | None:
    """This process as a segment's creator, or None when /proc cannot say who it is (no /proc,
    or one mounted for another PID namespace, where its pids are not ours)."""
    pid = os.getpid()
    boot = _boot_id()
    try:
        if boot is None or os.readlink("/proc/self") != str(pid):
            return None
        namespace = os.stat("/proc/self/ns/pid").st_ino
        start = _start_time(pid)
    except (OSError, ValueError):
        return None
    if start is None or not 0 < namespace < _UINT64_LIMIT:
        return None
    return Creator(boot, namespace, pid, start)


def new_segment_name() -> str:
    """A fresh name for a host segment this process creates, as it appears in /dev/shm. Without
    a :func:`current_creator` the name says nobody's, and no sweep will ever remove it."""
    creator = current_creator()
    tail = f"{next(_counter)}-{secrets.token_hex(6)}"
    if creator is None:
        return f"{SEGMENT_PREFIX}-unknown-{os.getpid()}-{tail}"
    return (f"{SEGMENT_PREFIX}-{creator.boot_id}-{creator.pid_namespace}-{creator.pid}-"
            f"{creator.start_time}-{tail}")


def creator_of(name: str) -> Creator | None:
    """The creator a segment's name records, or None for any name not of that form."""
    match = _SEGMENT.fullmatch(name)
    if match is None:
        return None
    boot, namespace, pid, start = match.groups()
    creator = Creator(boot, int(namespace), int(pid), int(start))
    if creator.pid >= _PID_LIMIT or creator.pid_namespace >= _UINT64_LIMIT or creator.start_time >= _UINT64_LIMIT:
        return None
    return creator


def _creator_gone(creator: Creator, us: Creator) -> bool:
    """Whether ``creator`` can no longer be running; any doubt counts as running, so a doubtful
    segment is kept rather than removed."""
    if creator.boot_id != us.boot_id:
        return True  # /dev/shm outlived the boot it was made on: every process of that boot is gone
    if creator.pid_namespace != us.pid_namespace:
        return False  # its pids are another namespace's: nothing here says whether it runs
    try:
        return _start_time(creator.pid) != creator.start_time  # another start time: the pid was reused
    except FileNotFoundError:
        return True
    except (OSError, ValueError):
        return False


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

    Only regular files this user owns whose names parse as a segment's (:func:`creator_of`), made
    in this PID namespace on this boot by a process that is gone (or, on an earlier boot, by
    anyone); anything else in the (world-writable) directory is ignored, whatever its name, so no
    other user's file can make this fail or make it remove something. Nothing is stale when this
    process cannot tell who it is (:func:`current_creator`)."""
    us = current_creator()
    if us is None:
        return []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    stale = []
    for name in names:
        creator = creator_of(name)
        if creator is not None and _ours(shm_dir, name) and _creator_gone(creator, us):
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
