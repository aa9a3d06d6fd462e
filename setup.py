"""Build glue: compiles ``pcie_allreduce._C`` (csrc/) with nvcc through CMake.

Metadata lives in pyproject.toml; this file only adds the CMake-driven
extension. Knobs (environment variables):

  PCIE_AR_CUDA_ARCHS     archs to build, e.g. "90" or "80;86;89;90;100;120"
                         (default: those of 80;86;89;90;100;120 nvcc supports)
  CUDACXX / CUDA_HOME    which nvcc to use (else PATH, /usr/local/cuda, pip wheels)
  MAX_JOBS / CMAKE_BUILD_PARALLEL_LEVEL   parallel compile jobs (default: all CPUs)
  PCIE_AR_NVCC_THREADS   nvcc --threads per .cu file (default: ~2 x jobs / files)
  PCIE_AR_CMAKE_ARGS     extra arguments for the CMake configure step
  PCIE_AR_BUILD_PROGRESS 0: no progress lines on the terminal of a pip that hides the
                         build's output (open_progress_terminal)
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
MIN_CUDA = (12, 8)
INSTALL_HINT = (
    "install the CUDA toolkit 12.8 or newer and put nvcc on PATH or set CUDA_HOME or "
    "CUDACXX, or `pip install nvidia-cuda-nvcc nvidia-cuda-runtime nvidia-cuda-cccl` "
    "(CUDA 13.x wheels) and set CUDACXX=<site-packages>/nvidia/cu13/bin/nvcc"
)


def _load(name: str, folder: str = "pcie_allreduce"):
    """Import <folder>/<name>.py by path: the package __init__ imports torch, and the build's own
    helpers (build_progress.py) are no package."""
    spec = importlib.util.spec_from_file_location(f"_pcie_ar_{name}", ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The library's one parser of settings (pcie_allreduce/settings.py): a value it cannot use stops
# the build with a message naming the variable, as it does at run time.
settings = _load("settings")
build_progress = _load("build_progress", ".")


def _setting(read, *args, **kwargs):
    try:
        return read(*args, **kwargs)
    except settings.SettingsError as exc:
        _fail(str(exc))


def _fail(message: str) -> None:
    # SystemExit with a string prints it as one line and exits 1, without a
    # traceback through setuptools.
    raise SystemExit(f"error: pcie_allreduce: {message}")


def _pip_nvcc_candidates() -> list[Path]:
    """nvcc inside NVIDIA's pip wheels, on this interpreter's sys.path."""
    found = []
    for entry in sys.path:
        base = Path(entry or ".") / "nvidia"
        # nvidia-cuda-nvcc (13.x) installs nvidia/cu13/bin/nvcc. The -cu12
        # wheels use nvidia/cuda_nvcc/, but on x86_64 they ship ptxas only.
        for rel in ("cu13/bin/nvcc", "cuda_nvcc/bin/nvcc"):
            candidate = base / rel
            if candidate.is_file() and os.access(candidate, os.X_OK):
                found.append(candidate)
    return found


def find_nvcc() -> Path:
    """Locate nvcc: CUDACXX, CUDA_HOME/CUDA_PATH, PATH, /usr/local/cuda, pip wheels."""
    cudacxx = os.environ.get("CUDACXX")
    if cudacxx:
        path = Path(shutil.which(cudacxx) or cudacxx)
        if not path.is_file():
            _fail(f"CUDACXX={cudacxx} does not exist; {INSTALL_HINT}")
        return path
    for var in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return Path(home) / "bin" / "nvcc"
    on_path = shutil.which("nvcc")
    if on_path:
        return Path(on_path)
    default = Path("/usr/local/cuda/bin/nvcc")
    if default.is_file():
        return default
    wheels = _pip_nvcc_candidates()
    if wheels:
        return wheels[0]
    _fail(f"nvcc not found; {INSTALL_HINT}")
    raise AssertionError("unreachable")


def nvcc_version(nvcc: Path) -> tuple[int, int]:
    """(major, minor) from ``nvcc --version``."""
    try:
        out = subprocess.run(
            [str(nvcc), "--version"], check=True, capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        _fail(f"cannot run {nvcc} --version ({exc}); {INSTALL_HINT}")
    match = re.search(r"release (\d+)\.(\d+)", out)
    if not match:
        _fail(f"cannot read the CUDA version from `{nvcc} --version`")
    return int(match.group(1)), int(match.group(2))


def nvcc_supported_archs(nvcc: Path, archs_mod) -> set[int] | None:
    """Archs nvcc can compile for; None when it cannot tell (trust the list)."""
    try:
        out = subprocess.run(
            [str(nvcc), "--list-gpu-arch"], check=True, capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return archs_mod.parse_nvcc_arch_list(out) or None


def cmake_env(nvcc: Path, ninja: str | None) -> dict[str, str]:
    """Environment for CMake: ninja on PATH, and the lib dir of a pip-wheel CUDA.

    NVIDIA's wheels put libcudart_static.a in <root>/lib, but their
    nvcc.profile only searches <root>/lib64, so even CMake's compiler check
    fails to link. CUDAFLAGS seeds CMAKE_CUDA_FLAGS on the first configure.
    """
    env = dict(os.environ)
    if ninja:
        env["PATH"] = ninja + os.pathsep + env.get("PATH", "")
    root = nvcc.resolve().parent.parent
    if (root / "lib" / "libcudart_static.a").is_file() and not (root / "lib64").exists():
        env["CUDAFLAGS"] = f"{env.get('CUDAFLAGS', '')} -L{root / 'lib'}".strip()
    return env


def parallel_jobs() -> int:
    """MAX_JOBS, else CMAKE_BUILD_PARALLEL_LEVEL, else every CPU."""
    for var in ("MAX_JOBS", "CMAKE_BUILD_PARALLEL_LEVEL"):
        value = _setting(settings.env_int, var, lo=1)
        if value is not None:
            return value
    return os.cpu_count() or 1


def nvcc_threads(jobs: int, n_cu: int, n_archs: int) -> int:
    """Per-file nvcc --threads (one arch per thread), aiming at 2x the jobs.

    The .cu files are far from equal (the kernel file dominates: measured 18 s
    vs 6 s for 6 archs), so with jobs/files threads a core idles once the small
    files finish; allowing 2x oversubscription let the 2-core build drop from
    38 s to 21 s.
    """
    value = _setting(settings.env_int, "PCIE_AR_NVCC_THREADS", lo=0)
    if value is not None:
        return value
    if jobs <= 1:  # MAX_JOBS=1 asks for a serial build (e.g. to save memory)
        return 1
    concurrent = max(1, min(jobs, n_cu))
    return max(1, min(n_archs, -(-2 * jobs // concurrent)))


def cmake_executable() -> str:
    """cmake from the `cmake` pip package (a build requirement, so >= 3.24), else PATH."""
    try:
        import cmake  # type: ignore[import-not-found]

        exe = Path(cmake.CMAKE_BIN_DIR) / "cmake"
        if exe.is_file():
            return str(exe)
    except ImportError:
        pass
    exe = shutil.which("cmake")
    if exe:
        return exe
    _fail("cmake >= 3.24 not found; `pip install cmake ninja`")
    raise AssertionError("unreachable")


def ninja_dir() -> str | None:
    """Directory holding a ninja binary (the `ninja` pip package, else PATH), else None.

    The package first, as for cmake: it is a build requirement, so a non-isolated build in an
    environment that has it runs the ninja an isolated build runs, not whatever PATH finds.
    Ninjas of other versions discard each other's build log ("build log version is too old;
    starting over", 1.11 and 1.13) and then recompile everything.
    """
    try:
        import ninja  # type: ignore[import-not-found]

        if (Path(ninja.BIN_DIR) / "ninja").is_file():
            return str(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    on_path = shutil.which("ninja")
    if on_path:
        return str(Path(on_path).parent)
    return None


def forget_stale_cache(build_dir: Path, cmake: str, ninja: str | None) -> None:
    """Drop a CMake cache that names tools which are gone or have changed.

    pip's isolated builds run cmake and ninja from a temporary environment that is deleted
    afterwards; the cache of that build keeps their paths, and the next configure in the same
    checkout (a re-install, or an editable install after ``pip install .``) would fail with
    "Running '.../overlay/bin/ninja' '--version' failed". Only the cache goes: compiled objects
    stay, so ninja still skips compiles whose command lines did not change.
    """
    cache = build_dir / "CMakeCache.txt"
    if not cache.is_file():
        return
    recorded = dict(re.findall(r"^(CMAKE_COMMAND|CMAKE_MAKE_PROGRAM):[A-Z]+=(.*)$",
                               cache.read_text(errors="replace"), flags=re.MULTILINE))
    current = {"CMAKE_COMMAND": str(Path(cmake).resolve())}
    if ninja:
        current["CMAKE_MAKE_PROGRAM"] = str((Path(ninja) / "ninja").resolve())
    stale = [
        f"{key}={path}" for key, path in recorded.items()
        if not Path(path).exists() or (key in current and str(Path(path).resolve()) != current[key])
    ]
    if stale:
        print(f"pcie_allreduce: reconfiguring {build_dir.name}: its cache names other tools ({', '.join(stale)})",
              flush=True)
        cache.unlink()


def stable_pybind11(cmake_dir: Path, dest: Path) -> Path:
    """pybind11's CMake config directory, from a copy kept under ``dest`` whose name is its content hash.

    Under build isolation pybind11 lives in pip's temporary build environment
    (/tmp/pip-build-env-*/overlay/...), deleted after each build. Its include directory is in
    every compile command and its headers in every object's recorded dependencies, so each
    re-install changed every compile command and found those headers gone: ninja recompiled
    everything. The copy (``include`` and ``share`` of the pybind11 package, 1.3 MB) stays at the
    same path for the same pybind11 and is never rewritten, so unchanged units are skipped; a
    different pybind11 gets a copy of its own. A pybind11 laid out otherwise (a system install)
    is used where it is.
    """
    cmake_dir = Path(cmake_dir)
    root = cmake_dir.parents[2] if len(cmake_dir.parts) > 3 else cmake_dir
    if cmake_dir.parts[-3:] != ("share", "cmake", "pybind11") or not (root / "include" / "pybind11").is_dir():
        return cmake_dir
    # The bytecode pip compiles for share/'s __init__.py files differs per install: not copied.
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    digest = hashlib.sha1()
    for sub in ("include", "share"):
        for path in sorted((root / sub).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                digest.update(f"{path.relative_to(root).as_posix()}\0".encode())
                digest.update(path.read_bytes())
                digest.update(b"\0")
    copy = Path(dest) / f"pybind11-{digest.hexdigest()[:12]}"
    if not copy.is_dir():
        partial = Path(dest) / f".{copy.name}.{os.getpid()}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        for sub in ("include", "share"):
            shutil.copytree(root / sub, partial / sub, ignore=skip)
        try:
            partial.rename(copy)
        except OSError:  # another build made it first
            shutil.rmtree(partial, ignore_errors=True)
            if not copy.is_dir():
                raise
    return copy / "share" / "cmake" / "pybind11"


PROGRESS_ENV = "PCIE_AR_BUILD_PROGRESS"
BuildProgress = build_progress.BuildProgress
frontend_verbosity = build_progress.frontend_verbosity


def open_progress_terminal(env: dict[str, str] | None = None, ppid: int | None = None,
                           proc: Path = Path("/proc")):
    """pip's terminal, open for writing, when pip hides this build's output and
    ``PCIE_AR_BUILD_PROGRESS`` is not 0; else None (build_progress.pip_terminal)."""
    env = os.environ if env is None else env
    if not _setting(settings.env_bool, PROGRESS_ENV, True, env):
        return None
    return build_progress.pip_terminal(env, ppid, proc)


def run_forwarding(cmd: list[str], env: dict[str, str], progress: BuildProgress, out=None) -> int:
    """Run cmd in the checkout, its output copied to stdout and shown to ``progress``."""
    return build_progress.run_forwarding(cmd, env, progress, ROOT, out)


# A first build of the six default archs, measured: 2-vCPU x86_64, nvcc 13.0, MAX_JOBS=2, an idle
# machine (README's command 1, 3 min 28 s in all, 2026-12-04); on the same machine shared with
# other work (load average 9-20) it took 19 min 31 s (2026-12-05): bench/RESULTS.md has both.
FIRST_BUILD_MINUTES = 3


def build_time_hint(n_archs: int) -> str:
    """How long a first build takes and how to make it shorter."""
    hint = (f"A first build of the six default archs takes about {FIRST_BUILD_MINUTES} minutes on 2 idle cores, "
            "several times that on a busy machine, less with more cores or fewer archs.")
    if n_archs > 1:
        hint += " PCIE_AR_CUDA_ARCHS=90 (your GPUs' arch) builds one arch."
    return hint


class CMakeExtension(Extension):
    """An extension whose sources CMake finds by itself (csrc/)."""

    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """build_ext that configures and builds CMakeLists.txt with nvcc."""

    def build_extension(self, ext: Extension) -> None:  # noqa: D102
        if not isinstance(ext, CMakeExtension):
            super().build_extension(ext)
            return
        archs_mod = _load("_archs")
        nvcc = find_nvcc()
        version = nvcc_version(nvcc)
        if version < MIN_CUDA:
            _fail(
                f"{nvcc} is CUDA {version[0]}.{version[1]}; sm_120 needs CUDA "
                f"{MIN_CUDA[0]}.{MIN_CUDA[1]}+; {INSTALL_HINT}"
            )
        try:
            archs = archs_mod.select_archs(
                os.environ.get(archs_mod.ENV_VAR), nvcc_supported_archs(nvcc, archs_mod)
            )
        except archs_mod.ArchError as exc:
            _fail(str(exc))

        import pybind11  # build requirement; imported late so egg_info works without it

        out_file = Path(self.get_ext_fullpath(ext.name)).resolve()
        out_file.parent.mkdir(parents=True, exist_ok=True)
        suffix = out_file.name[len(ext.name.rsplit(".", 1)[-1]):]
        jobs = parallel_jobs()
        n_cu = len(list((ROOT / "csrc").glob("*.cu")))
        threads = nvcc_threads(jobs, n_cu, len(archs))
        ninja = ninja_dir()
        generator = os.environ.get("CMAKE_GENERATOR") or ("Ninja" if ninja else "")
        cmake = cmake_executable()
        env = cmake_env(nvcc, ninja)

        # One build dir per (nvcc, generator, interpreter): CMake refuses to
        # switch compilers or generators inside an existing cache. It lives in
        # ./build when writable, not in setuptools' build_temp, because editable
        # installs get a fresh temp dir each time and would rebuild everything.
        key = hashlib.sha1(f"{nvcc.resolve()}|{generator}|{sys.executable}".encode()).hexdigest()[:10]
        base = ROOT / "build" if os.access(ROOT, os.W_OK) else Path(self.build_temp).resolve()
        build_dir = base / f"cmake-{key}"
        build_dir.mkdir(parents=True, exist_ok=True)
        forget_stale_cache(build_dir, cmake, ninja)
        pybind11_dir = stable_pybind11(Path(pybind11.get_cmake_dir()), base)
        # Linked inside the build dir, then copied where setuptools wants it: editable installs
        # want it in a new temporary directory each time, and a new output path would relink.
        linked = build_dir / "lib" / out_file.name

        configure = [
            cmake, "-S", str(ROOT), "-B", str(build_dir),
            f"-DCMAKE_BUILD_TYPE={'Debug' if self.debug else 'Release'}",
            f"-DCMAKE_CUDA_COMPILER={nvcc}",
            f"-DCMAKE_CUDA_ARCHITECTURES={archs_mod.cmake_architectures(archs)}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11_dir}",
            f"-DPCIE_AR_OUTPUT_DIR={linked.parent}",
            f"-DPCIE_AR_EXT_SUFFIX={suffix}",
            f"-DPCIE_AR_NVCC_THREADS={threads}",
        ]
        if generator:
            configure += ["-G", generator]
        if generator == "Ninja" and ninja:
            configure.append(f"-DCMAKE_MAKE_PROGRAM={Path(ninja) / 'ninja'}")
        configure += shlex.split(os.environ.get("PCIE_AR_CMAKE_ARGS", ""))
        build = [cmake, "--build", str(build_dir), "--parallel", str(jobs)]

        progress = BuildProgress(open_progress_terminal())
        print(
            f"pcie_allreduce: nvcc {version[0]}.{version[1]} ({nvcc}), archs "
            f"{';'.join(map(str, archs))}, {jobs} jobs, nvcc --threads {threads}, "
            f"generator {generator or 'default'}",
            flush=True,
        )
        for step, cmd in (("configure", configure), ("build", build)):
            start = time.monotonic()
            if step == "build":
                progress.note(f"building the CUDA extension (sm_{', sm_'.join(map(str, archs))}, nvcc "
                              f"{version[0]}.{version[1]}, {jobs} jobs); a re-install compiles only what changed. "
                              f"{build_time_hint(len(archs))}")
            print("pcie_allreduce:", shlex.join(cmd), flush=True)
            progress.show("running CMake ..." if step == "configure" else
                          f"building with {generator or 'the default generator'} ...")
            returncode = run_forwarding(cmd, env, progress)
            if returncode != 0:
                _fail(f"CMake {step} failed (exit {returncode}); see the output above")
            took = build_progress.duration(time.monotonic() - start)
            if step == "configure":
                progress.note(f"configure took {took}")
            elif progress.compiled:
                progress.note(f"build took {took} ({progress.compiled} steps)")
            else:
                progress.note(f"nothing to compile: the CUDA extension is up to date ({took})")
        if not linked.is_file():
            _fail(f"CMake finished but {linked} was not produced")
        shutil.copy2(linked, out_file)


setup(
    ext_modules=[CMakeExtension("pcie_allreduce._C")],
    cmdclass={"build_ext": CMakeBuild},
)
