"""CPU tests of the build: arch-list parsing and the compiled extension's contents.

The extension tests read the built ``pcie_allreduce/_C*.so`` as an ELF file
(no GPU, no CUDA driver needed) and skip with a reason when it is not built;
set PCIE_AR_REQUIRE_BUILD=1 (CI does) to make a missing build a failure.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_archs() -> ModuleType:
    # By path, as setup.py does: the package __init__ imports torch.
    spec = importlib.util.spec_from_file_location(
        "_pcie_ar_archs_under_test", ROOT / "pcie_allreduce" / "_archs.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


archs = _load_archs()

NVCC_13_0_LIST = "\n".join(
    f"compute_{a}" for a in (75, 80, 86, 87, 88, 89, 90, 100, 110, 103, 120, 121)
)
NVCC_12_6_LIST = "\n".join(f"sm_{a}" for a in (50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90)) + "\nsm_90a"


# --------------------------------------------------------------------------- arch parsing


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90", [90]),
        ("80;86;89;90;100;120", [80, 86, 89, 90, 100, 120]),
        ("120,80 , 90", [80, 90, 120]),
        ("  86\t89\n", [86, 89]),
        ("9.0", [90]),
        ("8.6;12.0;10.0", [86, 100, 120]),
        ("sm_90;compute_100;SM80", [80, 90, 100]),
        ("90;9.0;sm_90;", [90]),
    ],
)
def test_parse_arch_list_valid(text: str, expected: list[int]) -> None:
    assert archs.parse_arch_list(text) == expected


@pytest.mark.parametrize(
    "text", ["", " ;, ", "native", "all", "90a", "sm_90a", "9.0.1", "8.10", "abc", "30", "9", "90+PTX"]
)
def test_parse_arch_list_invalid(text: str) -> None:
    with pytest.raises(archs.ArchError):
        archs.parse_arch_list(text)


def test_arch_error_is_value_error_naming_the_token() -> None:
    with pytest.raises(ValueError, match="native"):
        archs.parse_arch_list("90;native")


def test_parse_nvcc_arch_list() -> None:
    assert archs.parse_nvcc_arch_list(NVCC_13_0_LIST) == {75, 80, 86, 87, 88, 89, 90, 100, 110, 103, 120, 121}
    # Arch-specific entries are not archs of their own.
    assert 90 in archs.parse_nvcc_arch_list(NVCC_12_6_LIST)
    assert archs.parse_nvcc_arch_list("sm_100a\nsm_100f\n") == set()
    assert archs.parse_nvcc_arch_list("") == set()


def test_select_defaults_filtered_by_nvcc() -> None:
    assert archs.select_archs(None, archs.parse_nvcc_arch_list(NVCC_13_0_LIST)) == list(archs.DEFAULT_ARCHS)
    # An nvcc without Blackwell keeps the rest.
    assert archs.select_archs("", archs.parse_nvcc_arch_list(NVCC_12_6_LIST)) == [80, 86, 89, 90]
    # Unknown support: trust the defaults.
    assert archs.select_archs(None, None) == list(archs.DEFAULT_ARCHS)
    assert archs.DEFAULT_ARCHS == (80, 86, 89, 90, 100, 120)


def test_select_explicit_request() -> None:
    supported = archs.parse_nvcc_arch_list(NVCC_13_0_LIST)
    assert archs.select_archs("9.0", supported) == [90]
    assert archs.select_archs("120;90", None) == [90, 120]
    with pytest.raises(archs.ArchError, match="sm_120"):
        archs.select_archs("90;120", archs.parse_nvcc_arch_list(NVCC_12_6_LIST))
    with pytest.raises(archs.ArchError, match="native"):
        archs.select_archs("native", supported)


def test_select_nothing_supported() -> None:
    with pytest.raises(archs.ArchError, match="12.8"):
        archs.select_archs(None, {50, 52})


def test_cmake_architectures_sass_for_all_ptx_for_highest() -> None:
    assert archs.cmake_architectures([90]) == "90"
    assert archs.cmake_architectures([120, 80, 90, 90]) == "80-real;90-real;120"
    with pytest.raises(archs.ArchError):
        archs.cmake_architectures([])


# --------------------------------------------------------------------------- ELF reading

_FATBIN_MAGIC = 0xBA55ED50
_KIND_PTX, _KIND_ELF = 1, 2


def _elf_sections(data: bytes) -> list[tuple[str, int, int, int]]:
    """(name, file offset, size, sh_link) of each section of a little-endian ELF64 file."""
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not a little-endian ELF64 file"
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQI", data, shoff + i * shentsize) for i in range(shnum)]
    str_off = headers[shstrndx][4]

    def name(at: int) -> str:
        return data[str_off + at : data.index(b"\0", str_off + at)].decode()

    return [(name(h[0]), h[4], h[5], h[6]) for h in headers]


def _section(data: bytes, wanted: str) -> tuple[int, int, int]:
    for name, offset, size, link in _elf_sections(data):
        if name == wanted:
            return offset, size, link
    raise AssertionError(f"no {wanted} section")


def _needed_libraries(data: bytes) -> list[str]:
    """DT_NEEDED entries of the ELF's .dynamic section (what readelf -d shows)."""
    dyn_off, dyn_size, link = _section(data, ".dynamic")
    dynstr_off = _elf_sections(data)[link][1]
    needed = []
    for at in range(dyn_off, dyn_off + dyn_size, 16):
        tag, value = struct.unpack_from("<qQ", data, at)
        if tag == 0:  # DT_NULL
            break
        if tag == 1:  # DT_NEEDED
            start = dynstr_off + value
            needed.append(data[start : data.index(b"\0", start)].decode())
    return needed


def _fatbins(data: bytes) -> list[list[tuple[int, int]]]:
    """The (kind, sm) entries of every fatbinary in .nv_fatbin, one list per .cu file.

    Layout (as read by cuobjdump): a 16-byte header {u32 magic 0xBA55ED50, u16 version,
    u16 header size, u64 payload size}, then entries {u16 kind (1 PTX, 2 ELF), u16 version,
    u32 header size, u64 payload size, ..., u32 sm at offset 28}.
    """
    offset, size, _ = _section(data, ".nv_fatbin")
    blob = data[offset : offset + size]
    found, pos = [], 0
    while pos + 16 <= len(blob):
        magic, _ver, header, payload = struct.unpack_from("<IHHQ", blob, pos)
        if magic != _FATBIN_MAGIC:
            pos += 8  # fatbins are 8-byte aligned; skip padding
            continue
        entries, at, end = [], pos + header, pos + header + payload
        while at < end:
            kind, _v, entry_header, entry_size = struct.unpack_from("<HHIQ", blob, at)
            (sm,) = struct.unpack_from("<I", blob, at + 28)
            entries.append((kind, sm))
            at += entry_header + entry_size
        found.append(entries)
        pos = end
    return found


# --------------------------------------------------------------------------- built extension


def _built_extension() -> Path:
    """The built _C next to the sources, else in an installed copy; skip if none."""
    # Looked up by file, not imported: importing the package would import torch, and
    # ./pcie_allreduce (no .so after a non-editable install) shadows site-packages.
    dirs = [ROOT / "pcie_allreduce"] + [Path(entry or ".") / "pcie_allreduce" for entry in sys.path]
    for directory in dirs:
        hits = sorted(directory.glob("_C*.so"))
        if hits:
            return hits[0]
    reason = "pcie_allreduce._C is not built (pip install -e . or python setup.py build_ext --inplace)"
    if os.environ.get("PCIE_AR_REQUIRE_BUILD") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def _find_tool(name: str) -> str | None:
    """A CUDA tool next to the nvcc setup.py would pick, else on PATH."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    cudacxx = os.environ.get("CUDACXX")
    candidates = [str(Path(cudacxx).parent / name)] if cudacxx else []
    candidates += [str(Path(h) / "bin" / name) for h in homes if h]
    for candidate in candidates:
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which(name)


def _expected_archs() -> list[int]:
    """What the build should contain: PCIE_AR_CUDA_ARCHS, else the defaults nvcc supports."""
    nvcc = _find_tool("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: cannot tell which archs the build should contain")
    out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, check=True).stdout
    return archs.select_archs(os.environ.get(archs.ENV_VAR), archs.parse_nvcc_arch_list(out))


def test_extension_has_sass_for_every_arch_and_ptx_for_highest() -> None:
    data = _built_extension().read_bytes()
    expected = _expected_archs()
    fatbins = _fatbins(data)
    assert fatbins, "no fatbinary found in .nv_fatbin"
    for entries in fatbins:  # one per .cu file
        sass = sorted(sm for kind, sm in entries if kind == _KIND_ELF)
        ptx = sorted(sm for kind, sm in entries if kind == _KIND_PTX)
        assert sass == expected, (
            f"SASS for {sass}, expected {expected}; a build made with {archs.ENV_VAR} set "
            f"must be tested with the same {archs.ENV_VAR} exported"
        )
        assert ptx == [max(expected)], f"PTX for {ptx}, expected only sm_{max(expected)}"


def test_cuobjdump_lists_sass_for_every_arch() -> None:
    so = _built_extension()
    cuobjdump = _find_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump not found (the fatbin parser test covers the same ground)")
    out = subprocess.run([cuobjdump, "--list-elf", str(so)], capture_output=True, text=True, check=True).stdout
    listed = {int(m) for m in re.findall(r"\.sm_(\d+)[a-z]?\.cubin", out)}
    assert listed == set(_expected_archs())


def test_extension_links_no_cuda_driver_cudart_or_torch() -> None:
    so = _built_extension()
    needed = _needed_libraries(so.read_bytes())
    assert needed, "no DT_NEEDED entries read"
    banned = ("libcuda.", "libcudart.", "libtorch", "libc10", "libpython")
    assert not [lib for lib in needed if lib.startswith(banned)], needed
    readelf = shutil.which("readelf")
    if readelf:  # cross-check the parser
        out = subprocess.run([readelf, "-d", str(so)], capture_output=True, text=True, check=True).stdout
        assert re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out) == needed


def test_extension_loads_without_gpu() -> None:
    # In a child process: loading the module a second time under another name in this
    # process would re-register its pybind11 types. By path, so the torch-importing
    # package __init__ stays out; static cudart does nothing until called, so this
    # works on a machine without libcuda.
    so = _built_extension()
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('_C', sys.argv[1])\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "print('loaded', module.__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(so)], capture_output=True, text=True)
    assert result.returncode == 0 and "loaded _C" in result.stdout, result.stderr


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
