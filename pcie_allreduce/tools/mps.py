"""A private NVIDIA MPS control daemon, so several processes' kernels share one GPU concurrently.

Used by :func:`pcie_allreduce.tools.ranks.run_ranks` when W ranks share fewer GPUs: without MPS their
contexts time-slice (milliseconds per collective); with it their kernels run side by side, which
spin-waiting collectives need to be fast.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import warnings
from typing import Mapping, Sequence

from pcie_allreduce.plan.dispatch import MPS_SHARE_ENV

MPS_CONTROL_BINARY = "nvidia-cuda-mps-control"
_LOG_PROBLEM = re.compile(r"error|fail|fault|exception|terminat|invalid", re.IGNORECASE)


class MpsError(RuntimeError):
    """A private MPS control daemon could not be started."""


class MpsUnavailableWarning(RuntimeWarning):
    """MPS was wanted but could not be started; ranks sharing a GPU will time-slice."""


def _short_tmp_root() -> str | None:
    """A temp root short enough for the daemon's unix sockets (sun_path is 108 bytes)."""
    root = tempfile.gettempdir()
    if len(root) > 60 and os.path.isdir("/tmp"):
        return "/tmp"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def last_lines(text: str, lines: int) -> str:
    """The last ``lines`` lines of ``text``."""
    return "\n".join(text.strip().splitlines()[-lines:])


def _run_control(
    binary: str, env: Mapping[str, str], args: Sequence[str] = (), command: str | None = None
) -> tuple[int, str]:
    """Run ``nvidia-cuda-mps-control [args]`` (feeding ``command`` on stdin); (rc, output).

    Output goes to a temp file, not a pipe: ``-d`` forks a daemon that may keep inherited
    pipe ends open, and reading a pipe to EOF would then block forever.
    """
    with tempfile.TemporaryFile("w+") as out:
        try:
            proc = subprocess.run(
                [binary, *args],
                input=None if command is None else command + "\n",
                stdin=subprocess.DEVNULL if command is None else None,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(env),
                text=True,
                timeout=30,
                start_new_session=True,  # keep the daemon out of our terminal's Ctrl-C
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return -1, f"{type(exc).__name__}: {exc}"
        out.seek(0)
        return proc.returncode, out.read()


def _answers(rc: int, output: str) -> bool:
    """Whether a client command reached a live control daemon."""
    # It exits 1 with "Cannot find MPS control daemon process" when none listens; check the
    # text too so an unexpected exit status cannot make a dead daemon look alive.
    return rc == 0 and "cannot find" not in output.lower()


def _external_mps_env() -> dict[str, str] | None:
    """The MPS env of a daemon someone else already runs (ours would collide with it), if any.

    Clients connect to ``$CUDA_MPS_PIPE_DIRECTORY`` (default /tmp/nvidia-mps); a daemon there
    that answers ``get_server_list`` is live.
    """
    pipe_dir = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    if pipe_dir is None:
        pipe_dir = "/tmp/nvidia-mps"
        if not os.path.isdir(pipe_dir):  # the common case: skip the subprocess
            return None
    binary = shutil.which(MPS_CONTROL_BINARY)
    if binary is None:
        return None
    env = {"CUDA_MPS_PIPE_DIRECTORY": pipe_dir}
    if "CUDA_MPS_LOG_DIRECTORY" in os.environ:
        env["CUDA_MPS_LOG_DIRECTORY"] = os.environ["CUDA_MPS_LOG_DIRECTORY"]
    rc, out = _run_control(binary, {**os.environ, **env}, command="get_server_list")
    return env if _answers(rc, out) else None


def client_visible_devices(environ: Mapping[str, str]) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for the clients of a daemon started under ``environ`` ({} if unset).

    The daemon serves only the GPUs its own CUDA_VISIBLE_DEVICES names, and its clients count
    from 0 within those: a client that inherits ``CUDA_VISIBLE_DEVICES=1`` is refused ("Invalid
    CUDA_VISIBLE_DEVICES") by a daemon started with that same value, so clients get 0..n-1.
    """
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return {}
    entries = [e for e in (part.strip() for part in value.split(",")) if e]
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(len(entries)))}



def thread_share_env(ranks_per_gpu: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The SM share of each of ``ranks_per_gpu`` MPS clients of one GPU, as the client variable
    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` = floor(100 / ranks_per_gpu) ({} for one rank per GPU).

    Ranks of one collective spin until their peers' blocks arrive; a rank whose kernels may fill the
    whole GPU can starve a lagging peer's kernels (its GEMMs, its norm) of SMs, and under MPS
    nothing guarantees the lagging one progress. Capped at its share (the shares add up to at most
    the GPU), a rank's kernels always leave the others theirs, and the device it sees reports that
    share as its SM count, which becomes its block cap (:func:`pcie_allreduce.plan.dispatch.block_cap`).
    A smaller percentage already in ``environ`` is kept (MPS itself keeps the daemon's, if lower)."""
    if ranks_per_gpu <= 1:
        return {}
    share = 100 // ranks_per_gpu
    current = environ.get(MPS_SHARE_ENV, "")
    with contextlib.suppress(ValueError):
        if 0 < float(current) <= share:
            return {MPS_SHARE_ENV: current}
    return {MPS_SHARE_ENV: str(share)}


class MpsDaemon:
    """A private MPS control daemon whose pipe and log directories live in a temp dir.

    Use ``MpsDaemon.start()`` (raises :class:`MpsError`) and ``stop()``, or ``with
    MpsDaemon.start() as d: ...``. Clients reach it through ``d.env``
    (``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY``), which must be in their environment
    before they initialise CUDA. While ``d.env`` is also in ``os.environ``, :func:`run_ranks`
    reuses this daemon instead of starting another.
    """

    def __init__(self, root: str, binary: str) -> None:
        self.root = root
        self.binary = binary
        self._daemon_env: dict[str, str] = {
            "CUDA_MPS_PIPE_DIRECTORY": os.path.join(root, "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": os.path.join(root, "log"),
        }
        self.env: dict[str, str] = {**self._daemon_env, **client_visible_devices(os.environ)}
        self._stopped = False

    @classmethod
    def start(cls, binary: str | None = None, ready_timeout_s: float = 10.0) -> MpsDaemon:
        """Start a daemon and wait until it answers; raises MpsError saying why it could not."""
        binary = binary or shutil.which(MPS_CONTROL_BINARY)
        if binary is None:
            raise MpsError(f"{MPS_CONTROL_BINARY} not found on PATH")
        daemon = cls(tempfile.mkdtemp(prefix="pcie_ar_mps_", dir=_short_tmp_root()), binary)
        try:
            daemon._launch(ready_timeout_s)
        except BaseException:
            daemon.stop()
            raise
        return daemon

    def _control(self, args: Sequence[str] = (), command: str | None = None) -> tuple[int, str]:
        # The daemon keeps the caller's CUDA_VISIBLE_DEVICES: it decides which GPUs MPS serves.
        return _run_control(self.binary, {**os.environ, **self._daemon_env}, args, command)

    def _launch(self, ready_timeout_s: float) -> None:
        for path in self._daemon_env.values():
            os.makedirs(path, exist_ok=True)
        rc, out = self._control(["-d"])
        if rc != 0:
            detail = last_lines(out, 1) or "no output"
            raise MpsError(f"`{MPS_CONTROL_BINARY} -d` exited with code {rc}: {detail}")
        # -d returns once the daemon forked; a rank that initialises CUDA before the daemon
        # listens silently runs without MPS, so wait until the daemon answers.
        deadline = time.monotonic() + ready_timeout_s
        while True:
            rc, out = self._control(command="get_server_list")
            if _answers(rc, out):
                return
            if time.monotonic() > deadline:
                detail = last_lines(out, 1) or "no output"
                raise MpsError(f"daemon did not answer within {ready_timeout_s:.0f} s: {detail}")
            time.sleep(0.1)

    def log_problems(self, lines: int = 10) -> str:
        """The last error-looking lines of the daemon's control and server logs ('' if none).

        Filtered because the logs are mostly routine client connect/disconnect lines.
        """
        parts = []
        for name in ("control.log", "server.log"):
            path = os.path.join(self.env["CUDA_MPS_LOG_DIRECTORY"], name)
            with contextlib.suppress(OSError), open(path, errors="replace") as f:
                bad = [ln for ln in f if _LOG_PROBLEM.search(ln)]
                if bad:
                    parts.append(f"--- {name} ---\n" + "".join(bad[-lines:]).rstrip())
        return "\n".join(parts)

    def _daemon_pid(self) -> int | None:
        path = os.path.join(self.env["CUDA_MPS_PIPE_DIRECTORY"], "nvidia-cuda-mps-control.pid")
        with contextlib.suppress(OSError, ValueError), open(path) as f:
            return int(f.read().strip())
        return None

    def stop(self) -> None:
        """Quit the daemon (and its server) and remove the temp dir; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            pid = self._daemon_pid()
            self._control(command="quit")
            if pid is not None:
                self._wait_exit(pid)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    @staticmethod
    def _wait_exit(pid: int) -> None:
        # quit waits for the servers to drain; escalate only if the daemon is truly stuck, and
        # only against a process that still looks like the daemon (the pid may have been reused).
        for sig, wait_s in ((None, 10.0), (signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
            if sig is not None:
                with contextlib.suppress(OSError), open(f"/proc/{pid}/comm") as f:
                    if "mps" in f.read():
                        os.kill(pid, sig)
            deadline = time.monotonic() + wait_s
            while _pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not _pid_alive(pid):
                return

    def __enter__(self) -> MpsDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def env_for_run(
    want: bool, gpu: bool, world_size: int, n_gpus: int, stack: contextlib.ExitStack
) -> tuple[dict[str, str] | None, MpsDaemon | None]:
    """MPS env for the children (None: no MPS) and the private daemon, if one was started (stopped
    by ``stack``): a live daemon someone else runs is reused; else one is started where ``want``."""
    external = _external_mps_env() if (gpu or want) else None
    if external is not None:
        return external, None
    if not want:
        return None, None
    try:
        daemon = MpsDaemon.start()
    except MpsError as exc:
        where = (
            f"{world_size} ranks on {n_gpus} GPU(s) will time-slice (correct but slow)"
            if gpu
            else "ranks run without MPS"
        )
        warnings.warn(
            f"pcie_allreduce.tools.ranks: could not start an MPS daemon ({exc}); {where}",
            MpsUnavailableWarning,
            stacklevel=3,
        )
        return None, None
    stack.callback(daemon.stop)
    return daemon.env, daemon
