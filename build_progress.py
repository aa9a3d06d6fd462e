"""The build's progress lines, for a pip that hides the build's output: which terminal is pip's,
how loud pip was asked to be, and the lines themselves (each compile and link step ninja
finishes, and a word when the build has been quiet for a while).

setup.py loads this file by path (it is build glue, not part of the installed package) and keeps
the setting that turns it off (``PCIE_AR_BUILD_PROGRESS``) and the build itself.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

# Without a terminal ninja prints "[n/m] <description>" as each step finishes (CMake's
# descriptions: "Building CUDA object CMakeFiles/_C.dir/csrc/launch.cu.o", "Linking CXX shared
# module <path>"); the terminal gets them as "compiled csrc/launch.cu".
NINJA_STEP = re.compile(r"^(\[\d+/\d+\]) (?:Building \S+ object \S*?CMakeFiles/[^/]+\.dir/(\S+)\.o"
                        r"|Linking \S+ shared module (\S+))$")


def _count_option(value: str) -> int:
    """A PIP_VERBOSE / PIP_QUIET value as pip reads it: a count, or yes / no."""
    value = value.strip().lower()
    if value.isdigit():
        return int(value)
    return 1 if value in ("y", "yes", "t", "true", "on") else 0


def frontend_verbosity(argv: list[str], env: dict[str, str]) -> int:
    """pip's (or uv's) verbosity: one up per -v / --verbose, one down per -q / --quiet.

    Read from the frontend's command line and PIP_VERBOSE / PIP_QUIET; short options count
    only in tokens made of v and q alone (``-vv``, ``-qq``).
    """
    level = _count_option(env.get("PIP_VERBOSE", "")) - _count_option(env.get("PIP_QUIET", ""))
    for arg in argv[1:]:
        if arg == "--":
            break
        if arg == "--verbose":
            level += 1
        elif arg == "--quiet":
            level -= 1
        elif re.fullmatch(r"-[vq]+", arg):
            level += arg.count("v") - arg.count("q")
    return level


def pip_terminal(env: dict[str, str], ppid: int | None = None, proc: Path = Path("/proc")):
    """The terminal of the frontend that captures this build's output, open for writing; else None.

    pip runs a build backend with stdout and stderr piped into itself and shows that output
    only with -v or when the build fails; meanwhile it draws a spinner on its own stdout when
    that is a terminal. Progress lines written to that terminal reach the person waiting, and
    the captured output (pip's log, the failure report) keeps every line as before. None, so
    nothing is written anywhere but stdout, unless the parent process holds the read end of
    this process's stdout pipe (it captures it) and its own stdout is a terminal (not a CI
    log, not ``| tee``), and it was given neither -v (it shows the output itself) nor -q.
    """
    ppid = os.getppid() if ppid is None else ppid
    parent = proc / str(ppid)
    try:
        ours = os.readlink(proc / "self" / "fd" / "1")
        if not ours.startswith("pipe:"):
            return None
        if not any(os.readlink(fd) == ours for fd in (parent / "fd").iterdir()):
            return None
        argv = (parent / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if frontend_verbosity([a for a in argv if a], dict(env)) != 0:
        return None
    try:
        fd = os.open(parent / "fd" / "1", os.O_WRONLY | os.O_NOCTTY | os.O_APPEND)
    except OSError:
        return None
    if not os.isatty(fd):
        os.close(fd)
        return None
    return os.fdopen(fd, "w", buffering=1, errors="replace")


def duration(seconds: float) -> str:
    """``seconds`` as the progress lines say it: 42s, 3m05s."""
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class BuildProgress:
    """Progress lines: ``note`` to stdout and the terminal, ``show`` to the terminal only.

    The terminal (``open_progress_terminal``) is pip's: its line "Building ... for
    pcie-allreduce (pyproject.toml) ... " ends in the spinner, which pip redraws with
    backspaces as the build prints. The first line here starts below it; each later one starts
    with a carriage return, over the spinner character pip drew at the start of the empty line
    below the last one, so pip's final "done" lands on a line of its own.
    """

    def __init__(self, terminal=None, clock=time.monotonic, quiet_after: float = 30.0) -> None:
        self.terminal = terminal
        self.clock = clock
        self.start = self.last = clock()
        self.quiet_after = quiet_after
        self.compiled = 0  # compile and link steps ninja reported: 0 means nothing was rebuilt
        self._lock = threading.Lock()
        self._first = True

    def note(self, text: str) -> None:
        print(f"pcie_allreduce: {text}", flush=True)
        self.show(text)

    def show(self, text: str) -> None:
        with self._lock:
            if self.terminal is None:
                return
            try:
                lead = "\n" if self._first else "\r"
                self.terminal.write(f"{lead}  pcie_allreduce: {text}\n")
                self.terminal.flush()
            except (OSError, ValueError):
                self.terminal = None
            self._first = False
            self.last = self.clock()

    def line(self, text: str) -> None:
        """One line of CMake's output: each compile and link step ninja finishes goes to the
        terminal. Ninja's own "[n/m]" counter is left out: its total counts the glob re-check
        and the CMake re-run too, which are no compile steps, so it never read m/m."""
        step = NINJA_STEP.match(text.rstrip())
        if not step:
            return
        self.compiled += 1
        what = f"compiled {step.group(2)}" if step.group(2) else f"linked {Path(step.group(3)).name}"
        self.show(f"{what} ({duration(self.clock() - self.start)})")

    def tick(self) -> None:
        """After ``quiet_after`` seconds without a line: say the build is still going."""
        if self.terminal is not None and self.clock() - self.last >= self.quiet_after:
            done = f", {self.compiled} step{'s' if self.compiled > 1 else ''} done" if self.compiled else ""
            self.show(f"still compiling: {duration(self.clock() - self.start)} so far{done}")


def run_forwarding(cmd: list[str], env: dict[str, str], progress: BuildProgress, cwd: Path, out=None) -> int:
    """Run cmd in ``cwd`` with its output copied line by line to stdout and shown to ``progress``."""
    out = sys.stdout if out is None else out
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    finished = threading.Event()

    def heartbeat() -> None:
        while not finished.wait(1.0):
            progress.tick()

    beat = threading.Thread(target=heartbeat, daemon=True)
    beat.start()
    try:
        for raw in proc.stdout:
            text = raw.decode(errors="replace")
            out.write(text)
            out.flush()
            progress.line(text)
    finally:
        finished.set()
        beat.join()
        proc.stdout.close()
    return proc.wait()
