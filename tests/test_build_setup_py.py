"""CPU tests of setup.py's helpers, run with stand-ins for setuptools (nothing is built).

The stable copy of pybind11 that outlives pip's build environment, the ninja it picks, the
frontend's verbosity, the terminal the build's progress goes to (the capturing frontend's, or
none), the progress lines and what they count, and a build setting that cannot be used stopping
the build with its name.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- setup.py helpers


def _load_setup() -> ModuleType:
    """setup.py as a module, with stand-ins for setuptools: its helpers run, nothing is built."""
    names = ("setuptools", "setuptools.command", "setuptools.command.build_ext")
    stubs = {name: ModuleType(name) for name in names}
    stubs["setuptools"].Extension = type("Extension", (), {"__init__": lambda self, *args, **kwargs: None})
    stubs["setuptools"].setup = lambda **kwargs: None
    stubs["setuptools.command.build_ext"].build_ext = type("build_ext", (), {})
    saved = {name: sys.modules.get(name) for name in names}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location("_pcie_ar_setup_under_test", ROOT / "setup.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, module_before in saved.items():
            if module_before is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module_before
    return module


@pytest.fixture(scope="module")
def setup_py() -> ModuleType:
    return _load_setup()


def _fake_pybind11(root: Path, header: str = "// v1\n") -> Path:
    """A pybind11 package laid out as its wheel installs it; returns its CMake config dir."""
    (root / "include" / "pybind11").mkdir(parents=True)
    (root / "include" / "pybind11" / "pybind11.h").write_text(header)
    cmake_dir = root / "share" / "cmake" / "pybind11"
    cmake_dir.mkdir(parents=True)
    (cmake_dir / "pybind11Config.cmake").write_text('set(pybind11_INCLUDE_DIR "${PACKAGE_PREFIX_DIR}/include")\n')
    # pip compiles share/__init__.py at install: bytecode that differs from one install to the next.
    (root / "share" / "__init__.py").write_text("")
    (root / "share" / "__pycache__").mkdir()
    (root / "share" / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(os.urandom(16))
    return cmake_dir


def test_stable_pybind11_copy_outlives_the_build_env(setup_py: ModuleType, tmp_path: Path) -> None:
    build = tmp_path / "build"
    build.mkdir()
    first = setup_py.stable_pybind11(_fake_pybind11(tmp_path / "env1" / "pybind11"), build)
    assert first.parts[-3:] == ("share", "cmake", "pybind11") and build in first.parents
    prefix = first.parents[2]
    assert (prefix / "include" / "pybind11" / "pybind11.h").read_text() == "// v1\n"
    stamp = (prefix / "include" / "pybind11" / "pybind11.h").stat().st_mtime_ns
    shutil.rmtree(tmp_path / "env1")  # pip deletes its build environment
    # The next isolated build: same pybind11 in another temporary directory, same copy, untouched.
    again = setup_py.stable_pybind11(_fake_pybind11(tmp_path / "env2" / "pybind11"), build)
    assert again == first
    assert (prefix / "include" / "pybind11" / "pybind11.h").stat().st_mtime_ns == stamp
    # Another pybind11 gets a copy of its own.
    other = setup_py.stable_pybind11(_fake_pybind11(tmp_path / "env3" / "pybind11", "// v2\n"), build)
    assert other != first and (other.parents[2] / "include" / "pybind11" / "pybind11.h").read_text() == "// v2\n"
    assert not [p for p in build.iterdir() if p.name.endswith(".partial")]
    assert not list(build.rglob("__pycache__"))


def test_stable_pybind11_leaves_other_layouts_alone(setup_py: ModuleType, tmp_path: Path) -> None:
    system = tmp_path / "usr" / "lib" / "cmake" / "pybind11"
    system.mkdir(parents=True)
    assert setup_py.stable_pybind11(system, tmp_path) == system
    assert sorted(p.name for p in tmp_path.iterdir()) == ["usr"]


def test_stable_pybind11_of_the_installed_pybind11(setup_py: ModuleType, tmp_path: Path) -> None:
    pybind11 = pytest.importorskip("pybind11")
    copy = setup_py.stable_pybind11(Path(pybind11.get_cmake_dir()), tmp_path)
    assert (copy / "pybind11Config.cmake").is_file()
    assert (copy.parents[2] / "include" / "pybind11" / "pybind11.h").is_file()


def test_ninja_of_the_pip_package_before_path(setup_py: ModuleType, tmp_path: Path, monkeypatch) -> None:
    for name in ("package", "path"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "ninja").write_text("#!/bin/sh\n")
        (tmp_path / name / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    monkeypatch.setitem(sys.modules, "ninja", ModuleType("ninja"))
    sys.modules["ninja"].BIN_DIR = str(tmp_path / "package")
    assert setup_py.ninja_dir() == str(tmp_path / "package")
    sys.modules["ninja"].BIN_DIR = str(tmp_path / "missing")  # a package without its binary
    assert setup_py.ninja_dir() == str(tmp_path / "path")


@pytest.mark.parametrize(
    ("argv", "env", "level"),
    [
        (["pip", "install", "-e", "."], {}, 0),
        (["python", "-m", "pip", "install", "-v", "."], {}, 1),
        (["pip", "wheel", "-vv", "--no-deps", "."], {}, 2),
        (["pip", "install", "--quiet", "."], {}, -1),
        (["pip", "install", "-qv", "."], {}, 0),
        (["pip", "install", "--verbose", "-q", "-q", "."], {}, -1),
        (["pip", "install", "-e", "."], {"PIP_VERBOSE": "1"}, 1),
        (["pip", "install", "-e", "."], {"PIP_VERBOSE": "yes", "PIP_QUIET": "0"}, 1),
        (["pip", "install", "-e", "."], {"PIP_QUIET": "true"}, -1),
        (["pip", "install", "-r", "-v.txt"], {}, 0),  # an argument, not an option
        (["pip", "install", "--", "-v"], {}, 0),
    ],
)
def test_frontend_verbosity(setup_py: ModuleType, argv: list[str], env: dict[str, str], level: int) -> None:
    assert setup_py.frontend_verbosity(argv, env) == level


def _fake_proc(root: Path, *, parent_fd1: str, holds_pipe: bool = True, cmdline: str = "pip\0install\0.\0") -> Path:
    """A /proc with this process's stdout a pipe and a parent (pid 42) whose fds are given."""
    (root / "self" / "fd").mkdir(parents=True)
    (root / "self" / "fd" / "1").symlink_to("pipe:[777]")
    (root / "42" / "fd").mkdir(parents=True)
    (root / "42" / "fd" / "1").symlink_to(parent_fd1)
    (root / "42" / "fd" / "4").symlink_to("pipe:[777]" if holds_pipe else "pipe:[778]")
    (root / "42" / "cmdline").write_bytes(cmdline.encode())
    return root


@pytest.fixture
def pty_pair():
    master, slave = os.openpty()
    yield master, os.ttyname(slave)
    os.close(master)
    os.close(slave)


def test_progress_terminal_is_the_capturing_frontends_terminal(setup_py: ModuleType, tmp_path: Path, pty_pair) -> None:
    master, tty = pty_pair
    proc = _fake_proc(tmp_path, parent_fd1=tty)
    terminal = setup_py.open_progress_terminal(env={}, ppid=42, proc=proc)
    assert terminal is not None
    terminal.write("hello\n")
    terminal.close()
    assert b"hello" in os.read(master, 1024)


@pytest.mark.parametrize(
    ("case", "env"),
    [("not captured by the parent", {}), ("pip -v", {}), ("pip -q", {}), ("log file", {}),
     ("turned off", {"PCIE_AR_BUILD_PROGRESS": "0"})],
)
def test_no_progress_terminal(setup_py: ModuleType, tmp_path: Path, pty_pair, case: str, env: dict[str, str]) -> None:
    _, tty = pty_pair
    log = tmp_path / "pip.log"
    log.touch()
    kwargs = {
        "not captured by the parent": {"parent_fd1": tty, "holds_pipe": False},  # e.g. a shell's `| tee`
        "pip -v": {"parent_fd1": tty, "cmdline": "pip\0install\0-v\0.\0"},
        "pip -q": {"parent_fd1": tty, "cmdline": "pip\0install\0-q\0.\0"},
        "log file": {"parent_fd1": str(log)},  # CI: pip's stdout is a file
        "turned off": {"parent_fd1": tty},
    }[case]
    proc = _fake_proc(tmp_path / "proc", **kwargs)
    assert setup_py.open_progress_terminal(env=env, ppid=42, proc=proc) is None


def test_no_progress_terminal_without_proc(setup_py: ModuleType, tmp_path: Path) -> None:
    assert setup_py.open_progress_terminal(env={}, ppid=42, proc=tmp_path / "missing") is None


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_build_progress_lines(setup_py: ModuleType, capsys) -> None:
    import io

    terminal, clock = io.StringIO(), _Clock()
    progress = setup_py.BuildProgress(terminal, clock=clock, quiet_after=30)
    progress.note("compiling")
    for text, later in [("[0/2] Re-checking globbed directories...\n", 1), ("nvcc warning : something\n", 1),
                        ("[1/6] Building CXX object CMakeFiles/_C.dir/csrc/bindings.cpp.o\n", 10)]:
        clock.now += later
        progress.line(text)
    clock.now += 29
    progress.tick()  # 29 s quiet: nothing yet
    clock.now += 1
    progress.tick()
    clock.now += 65
    progress.line("[6/6] Linking CXX shared module /tmp/tmpab12.build-lib/pcie_allreduce/_C.cpython-311-x86_64-linux-gnu.so\n")
    progress.line("ninja: no work to do.\n")
    assert capsys.readouterr().out == "pcie_allreduce: compiling\n"  # stdout: notes only
    assert terminal.getvalue().split("\n") == [
        "",  # below pip's "Building ... (pyproject.toml) ... " line
        "  pcie_allreduce: compiling",
        "\r  pcie_allreduce: compiled csrc/bindings.cpp (12s)",
        "\r  pcie_allreduce: still compiling: 42s so far, 1 step done",
        "\r  pcie_allreduce: linked _C.cpython-311-x86_64-linux-gnu.so (1m47s)",
        "",
    ]


def test_build_progress_heartbeat_before_the_first_step(setup_py: ModuleType) -> None:
    import io

    terminal, clock = io.StringIO(), _Clock()
    progress = setup_py.BuildProgress(terminal, clock=clock, quiet_after=30)
    progress.line("[0/2] Re-checking globbed directories...\n")  # not a step of the build
    clock.now += 34
    progress.tick()
    assert terminal.getvalue() == "\n  pcie_allreduce: still compiling: 34s so far\n"


def test_build_progress_without_terminal(setup_py: ModuleType, capsys) -> None:
    progress = setup_py.BuildProgress(None)
    progress.note("configure took 1.0s")
    progress.line("[1/2] Linking\n")
    progress.tick()
    assert capsys.readouterr().out == "pcie_allreduce: configure took 1.0s\n"


def test_run_forwarding_copies_everything_shows_ninja_lines(setup_py: ModuleType) -> None:
    import io

    terminal, out = io.StringIO(), io.StringIO()
    progress = setup_py.BuildProgress(terminal)
    code = (
        "import sys\n"
        "print('[1/2] Building CUDA object CMakeFiles/_C.dir/csrc/a.cu.o', flush=True)\n"
        "print('a.cu(3): warning: something', file=sys.stderr, flush=True)\n"
        "sys.stdout.buffer.write(b'bytes \\xff\\n')\n"
        "print('[2/2] Linking CXX shared module lib/_C.so', flush=True)\n"
        "sys.exit(3)\n"
    )
    assert setup_py.run_forwarding([sys.executable, "-c", code], dict(os.environ), progress, out=out) == 3
    assert out.getvalue() == ("[1/2] Building CUDA object CMakeFiles/_C.dir/csrc/a.cu.o\na.cu(3): warning: something\n"
                              "bytes \ufffd\n[2/2] Linking CXX shared module lib/_C.so\n")
    shown = terminal.getvalue()
    assert "compiled csrc/a.cu" in shown and "linked _C.so" in shown and progress.compiled == 2
    assert "warning" not in shown and "bytes" not in shown


def test_build_progress_counts_what_was_rebuilt(setup_py: ModuleType) -> None:
    """The closing note says "nothing to compile" only when ninja reported no compile or link
    step (its glob re-check and "no work to do" are not steps), also without a terminal."""
    progress = setup_py.BuildProgress(None)
    for line in ("[0/2] Re-checking globbed directories...\n", "ninja: no work to do.\n"):
        progress.line(line)
    assert progress.compiled == 0
    progress.line("[1/2] Building CUDA object CMakeFiles/_C.dir/csrc/launch.cu.o\n")
    progress.line("[2/2] Linking CXX shared module lib/_C.cpython-311-x86_64-linux-gnu.so\n")
    assert progress.compiled == 2


@pytest.mark.parametrize(("name", "value"), [("PCIE_AR_BUILD_PROGRESS", "maybe"), ("MAX_JOBS", "0"),
                                             ("MAX_JOBS", "²"), ("PCIE_AR_NVCC_THREADS", "-1"),
                                             ("PCIE_AR_NVCC_THREADS", "lots")])
def test_a_build_setting_that_cannot_be_used_stops_the_build_naming_it(
        setup_py: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    """The build reads its settings through the library's one parser: "maybe" is no boolean, not on."""
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit, match=name):
        if name == "PCIE_AR_BUILD_PROGRESS":
            setup_py.open_progress_terminal(env={name: value}, ppid=42, proc=tmp_path / "missing")
        elif name == "MAX_JOBS":
            setup_py.parallel_jobs()
        else:
            setup_py.nvcc_threads(4, 4, 2)
