"""CPU tests of the third-party backends of ``python -m bench`` (FlashInfer's PCIe IPC
all-reduce, vLLM's and sgl-kernel's custom all-reduce): why they are skipped when their packages
are missing, and how the rank side drives the libraries' objects (played here by fakes with
their documented surface), including the capture context the custom all-reduce needs and the
per-machine tuning FlashInfer asks its users to run."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import warnings
from typing import Any, Iterator

import pytest
import torch

from pcie_allreduce.tools.ranks import RankContext

from bench import backends, timing
from bench.backend_custom_ar import CustomAllreduceBackend
from bench.backend_flashinfer import FlashInferPcieIpcBackend
from bench.plan import Case, RankJob

CTX = RankContext(rank=0, world_size=2, group=None, device=torch.device("cpu"))


def _job(backend: str, max_bytes: int = 4096, eager: bool = False, cases: tuple[Case, ...] = (),
         progress_dir: str = "") -> RankJob:
    return RankJob(backend=backend, dtype="bfloat16", cases=cases, max_bytes=max_bytes, progress_dir=progress_dir,
                   eager=eager, calls_per_graph=3)


@pytest.mark.parametrize("backend, missing, says", [
    ("vllm", {"vllm"}, "vllm not installed (pip install vllm)"),
    ("sgl_kernel", {"sgl_kernel"}, "sgl_kernel not installed (pip install sglang sgl-kernel)"),
    ("sgl_kernel", {"sgl_kernel", "sglang"}, "sgl_kernel and sglang not installed"),
    ("flashinfer", {"flashinfer"}, "flashinfer not installed (pip install flashinfer-python"),
])
def test_missing_packages_are_a_printed_skip_reason(monkeypatch, backend, missing, says) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else real("json"))
    assert says in (backends.skip_reason(backend, 2, 1) or "")


def test_installed_packages_are_not_skipped(monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    for backend in ("vllm", "sgl_kernel", "flashinfer"):
        assert backends.skip_reason(backend, 8, 8) is None


def test_variants_of_the_third_party_backends() -> None:
    assert backends.algos_for("vllm", ("auto",)) == ("custom_ar",)
    assert backends.algos_for("sgl_kernel", ("auto",)) == ("custom_ar",)
    assert backends.algos_for("flashinfer", ("auto",)) == ("pcie_ipc",)
    assert backends.algos_for("flashinfer", ("auto",), "fused") == (
        "pcie_ipc+norm", "pcie_ipc+addnorm", "pcie_ipc+fi_addnorm", "pcie_ipc+sgl_addnorm")


# ---------------------------------------------------------------------------- custom all-reduce


class FakeCustomAllreduce:
    """The surface of vLLM's / SGLang's CustomAllreduce that the backend uses."""

    def __init__(self, disabled: bool = False) -> None:
        self.disabled = disabled
        self.capturing = False
        self.events: list[str] = []

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        self.capturing = True
        self.events.append("capture begins")
        try:
            yield
        finally:
            self.capturing = False
            self.events.append("capture ends: graph buffers registered")

    def custom_all_reduce(self, x: torch.Tensor) -> torch.Tensor | None:
        self.events.append("call in capture" if self.capturing else "call")
        return x * 2 if x.numel() * x.element_size() <= 4096 else None

    def close(self) -> None:
        self.events.append("closed")


def _custom_backend(fake: Any, backend: str = "vllm") -> CustomAllreduceBackend:
    return CustomAllreduceBackend(CTX, _job(backend), open_wrapper=lambda name, group, device, size: fake)


def test_custom_allreduce_backend_drives_the_wrapper() -> None:
    fake = FakeCustomAllreduce()
    backend = _custom_backend(fake)
    assert backend.skip_reason(Case(0, 4096, 2048, "custom_ar")) is None
    assert "registered" in backend.skip_reason(Case(0, 8192, 4096, "custom_ar"))
    assert "multiple of 16" in backend.skip_reason(Case(0, 24, 12, "custom_ar"))
    bufs = backend.buffers(8, torch.bfloat16, "custom_ar")
    bufs.inp.fill_(3)
    assert torch.equal(backend.call(bufs, "custom_ar"), torch.full((8,), 6, dtype=torch.bfloat16))
    assert not backend.mutates_input("custom_ar")
    backend.device_sync()
    backend.close()
    assert fake.events == ["call", "call", "closed"]


def test_custom_allreduce_declining_a_call_is_an_error_not_a_silent_result() -> None:
    backend = _custom_backend(FakeCustomAllreduce())
    with pytest.raises(RuntimeError, match="declined"):
        backend.call(backend.buffers(4096, torch.bfloat16, "custom_ar"), "custom_ar")


def test_a_disabled_or_broken_wrapper_skips_every_case_with_the_reason() -> None:
    disabled = _custom_backend(FakeCustomAllreduce(disabled=True), "sgl_kernel")
    reason = disabled.skip_reason(Case(0, 1024, 512, "custom_ar"))
    assert "sgl_kernel CustomAllreduce disabled itself" in reason and "NVLink" in reason
    disabled.device_sync()  # no call into a disabled wrapper

    def broken(*_: Any) -> Any:
        raise ImportError("vllm._C has no custom_ar ops")

    backend = CustomAllreduceBackend(CTX, _job("vllm"), open_wrapper=broken)
    assert "could not be created: ImportError: vllm._C" in backend.skip_reason(Case(0, 1024, 512, "custom_ar"))
    backend.close()


def test_graph_capture_runs_inside_the_backends_capture_context(monkeypatch) -> None:
    fake = FakeCustomAllreduce()
    backend = _custom_backend(fake)

    class FakeGraph:
        def replay(self) -> None:
            fake.events.append("replay")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())
    bufs = backend.buffers(8, torch.bfloat16, "custom_ar")
    block = timing.make_block(backend, bufs, "custom_ar", _job("vllm"), capture_stream=None)
    block()
    assert fake.events == ["capture begins", "call in capture", "call in capture", "call in capture",
                           "capture ends: graph buffers registered", "replay"]


# ---------------------------------------------------------------------------- FlashInfer


class FakeWorkspace:
    """The surface of flashinfer.comm.PcieIpcAllReduceWorkspace that the backend uses."""

    profile = "rootcplx"
    profile_reason = "fake"

    def __init__(self, max_numel: int, tune_fails: bool = False) -> None:
        self.max_numel = max_numel
        self.destroyed = False
        self.tuned: list[tuple[list[int], torch.dtype]] = []
        self._tune_fails = tune_fails

    def tune(self, hiddens: list[int], *, dtype: torch.dtype) -> dict[tuple[int, int], str]:
        if self._tune_fails:
            raise ValueError("tune() measured nothing")
        self.tuned.append((list(hiddens), dtype))
        for h in hiddens:  # as FlashInfer 0.7.4 warns when only batch 1 was tuned
            warnings.warn(f"tuning stops at 1 rows (0 MiB at hidden {h}) but this workspace admits up to 0 MiB.",
                          RuntimeWarning)
        return {(h, 1): "config" for h in hiddens}

    def supports(self, x: torch.Tensor) -> bool:
        return x.numel() <= self.max_numel

    def all_reduce(self, x: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        out.copy_(x * 2)
        return out

    def destroy(self) -> None:
        self.destroyed = True


def test_flashinfer_backend_drives_the_workspace() -> None:
    made: list[tuple[int, torch.dtype, str]] = []

    def open_workspace(group: Any, max_numel: int, dtype: torch.dtype, tune_cache: str) -> FakeWorkspace:
        made.append((max_numel, dtype, tune_cache))
        return FakeWorkspace(max_numel)

    backend = FlashInferPcieIpcBackend(CTX, _job("flashinfer", max_bytes=1000, progress_dir="/run"),
                                       open_workspace=open_workspace)
    assert made == [(504, torch.bfloat16, "/run/flashinfer_pcie_ipc_tune.json")], \
        "max_numel: whole 16-byte packs covering max_bytes; the tuning cache is the run's own"
    assert backend.facts() == {"flashinfer_profile": "rootcplx", "flashinfer_profile_reason": "fake",
                               "baseline_tuning": "untuned: seed launch configurations"}
    assert backend.skip_reason(Case(0, 1000, 500, "pcie_ipc")) is None
    assert "supports() is False" in backend.skip_reason(Case(0, 2048, 1024, "pcie_ipc"))
    bufs = backend.buffers(16, torch.bfloat16, "pcie_ipc")
    bufs.inp.fill_(1)
    assert backend.call(bufs, "pcie_ipc") is bufs.out and torch.equal(bufs.out, torch.full_like(bufs.out, 2))
    backend.device_sync()
    ws = backend._ws
    backend.close()
    assert ws.destroyed


@pytest.mark.parametrize("fails", [False, True])
def test_flashinfer_is_tuned_for_every_size_it_takes_before_timing(fails: bool) -> None:
    """What FlashInfer tells its users to run once per machine: ``tune`` of every message count of
    the run that the workspace takes (once each, sorted); a tuning that raises leaves the seed
    configurations and says why, instead of failing the run."""
    cases = (Case(0, 1024, 512, "pcie_ipc"), Case(1, 4096, 2048, "pcie_ipc"), Case(2, 1024, 512, "pcie_ipc"),
             Case(3, 2048, 1024, "pcie_ipc"), Case(4, 1 << 20, 1 << 19, "pcie_ipc"))  # the last: too large
    backend = FlashInferPcieIpcBackend(CTX, _job("flashinfer", max_bytes=8192, cases=cases),
                                       open_workspace=lambda g, n, d, c: FakeWorkspace(n, tune_fails=fails))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend.tune()
    assert not caught, "FlashInfer's per-size batch warning does not apply to the bench's flat messages"
    tuning = backend.facts()["baseline_tuning"]
    if fails:
        assert backend._ws.tuned == []
        assert tuning == "untuned: workspace.tune raised ValueError: tune() measured nothing"
    else:
        assert backend._ws.tuned == [([512, 1024, 2048], torch.bfloat16)]
        assert tuning.startswith("workspace.tune: 3 shapes of 3 sizes in ")
    backend.close()


def test_the_rank_loop_tunes_a_backend_unless_told_not_to(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from bench import rank as bench_rank_module

    calls: list[str] = []

    class Tunable:
        def tune(self) -> None:
            calls.append("tune")

        def prepare_capture(self, stream: Any) -> None:
            calls.append("prepare_capture")

        def close(self) -> None:
            calls.append("close")

    monkeypatch.setattr(bench_rank_module, "open_backend", lambda ctx, job: Tunable())
    monkeypatch.setattr(bench_rank_module, "_run_cases", lambda *a: calls.append("cases"))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(bench_rank_module.dist, "barrier", lambda **k: None)
    # the watchdog's bounds, in order: the tuning gets TUNING_SETUPS set-ups, the rest its own
    monkeypatch.setattr(bench_rank_module.Watchdog, "arm",
                        lambda self, seconds, phase, **facts: calls.append(f"{phase} {seconds:g}"))
    ctx = RankContext(rank=1, world_size=2, group=None, device=torch.device("cpu"))
    for tune_baselines, want in ((True, ["setup 90", "tuning 270", "tune", "setup 90", "prepare_capture", "cases",
                                         "teardown 90", "close"]),
                                 (False, ["setup 90", "prepare_capture", "cases", "teardown 90", "close"])):
        calls.clear()
        job = dataclasses.replace(_job("flashinfer", progress_dir=str(tmp_path)), tune_baselines=tune_baselines)
        bench_rank_module.bench_rank(ctx, job)
        assert calls == want, tune_baselines


def test_flashinfer_without_the_workspace_class_skips_with_its_version() -> None:
    def too_old(*_: Any) -> Any:
        raise RuntimeError("FlashInfer 0.6.18 has no comm.PcieIpcAllReduceWorkspace (added in 0.7)")

    backend = FlashInferPcieIpcBackend(CTX, _job("flashinfer"), open_workspace=too_old)
    assert "0.6.18 has no comm.PcieIpcAllReduceWorkspace" in backend.skip_reason(Case(0, 1024, 512, "pcie_ipc"))
    assert backend.facts() == {}
    backend.device_sync()
    backend.close()


# ---------------------------------------------------------------------------- the trimmed wheel


def test_trimmed_flashinfer_wheel_keeps_python_the_pcie_ipc_and_the_norm_sources(tmp_path) -> None:
    import zipfile

    from bench import wheels

    names = ["flashinfer/__init__.py", "flashinfer/comm/pcie_ipc_ar.py", "flashinfer/tuning.json",
             "flashinfer/data/include/flashinfer/comm/pcie_ipc_all_reduce.cuh",
             "flashinfer/data/csrc/pcie_ipc_all_reduce.cu", "flashinfer/data/csrc/tvm_ffi_utils.h",
             "flashinfer/data/csrc/norm.cu", "flashinfer/data/csrc/flashinfer_norm_binding.cu",
             "flashinfer/data/csrc/renorm.cu", "flashinfer/data/csrc/batch_decode.cu", "flashinfer/data/cutlass/include/cute/tensor.hpp",
             "flashinfer/experimental/kernel.cu", "flashinfer/lib/prebuilt.so"]
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    src = src_dir / "flashinfer_python-0.7.4-py3-none-any.whl"
    record = "".join(f"{n},sha256=x,1\n" for n in names) + "flashinfer_python-0.7.4.dist-info/RECORD,,\n"
    with zipfile.ZipFile(src, "w") as z:
        for n in names:
            z.writestr(n, "x")
        z.writestr("flashinfer_python-0.7.4.dist-info/RECORD", record)
    out = wheels.trim_wheel("flashinfer", str(src), str(tmp_path))
    with zipfile.ZipFile(out) as z:
        kept = set(z.namelist())
        new_record = z.read("flashinfer_python-0.7.4.dist-info/RECORD").decode()
    want = {"flashinfer/__init__.py", "flashinfer/comm/pcie_ipc_ar.py", "flashinfer/tuning.json",
            "flashinfer/data/include/flashinfer/comm/pcie_ipc_all_reduce.cuh",
            "flashinfer/data/csrc/pcie_ipc_all_reduce.cu", "flashinfer/data/csrc/tvm_ffi_utils.h",
            "flashinfer/data/csrc/norm.cu", "flashinfer/data/csrc/flashinfer_norm_binding.cu",
            "flashinfer_python-0.7.4.dist-info/RECORD"}
    assert kept == want
    assert "batch_decode.cu" not in new_record and "pcie_ipc_ar.py" in new_record
    with pytest.raises(ValueError, match="must differ"):
        wheels.trim_wheel("flashinfer", str(src), str(src_dir))


def test_trimmed_sglang_wheel_drops_only_its_native_server_extensions(tmp_path) -> None:
    import zipfile

    from bench import wheels

    names = ["sglang/srt/distributed/parallel_state.py", "sglang/srt/rust_extensions/radix.so",
             "sglang/srt/rust_extensions/__init__.py", "sglang/srt/mem_cache/rust_tree_core/core.so"]
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    src = src_dir / "sglang-0.5.23-py3-none-any.whl"
    with zipfile.ZipFile(src, "w") as z:
        for n in names:
            z.writestr(n, "x")
    with zipfile.ZipFile(wheels.trim_wheel("sglang", str(src), str(tmp_path))) as z:
        assert set(z.namelist()) == {names[0], names[2]}


def test_trimmed_vllm_wheel_keeps_python_and_configs_and_stands_in_for_its_kernel_library(tmp_path) -> None:
    import base64
    import csv
    import hashlib
    import io
    import zipfile

    from bench import wheels

    names = ["vllm/__init__.py", "vllm/py.typed", "vllm/distributed/parallel_state.py",
             "vllm/model_executor/layers/fused_moe/configs/E=8,N=14336.json", "vllm/entrypoints/chat.jinja",
             "vllm/third_party/fmha_sm100/cute/requirements.txt", "vllm-0.34.0.dist-info/METADATA",
             "vllm-0.34.0.dist-info/entry_points.txt", "vllm/_C_stable_libtorch.abi3.so",
             "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs",
             "vllm/third_party/deep_gemm/include/cute/tensor.hpp",
             "vllm/entrypoints/serve/instrumentator/static/swagger-ui-bundle.js",
             "vllm/distributed/kv_transfer/README.md"]
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    src = src_dir / "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    lines = io.StringIO()
    csv.writer(lines, lineterminator="\n").writerows([(n, "sha256=x", "1") for n in names])
    record = lines.getvalue() + "vllm-0.34.0.dist-info/RECORD,,\n"  # a name with a comma is quoted
    with zipfile.ZipFile(src, "w") as z:
        for n in names:
            z.writestr(n, "x")
        z.writestr("vllm-0.34.0.dist-info/RECORD", record)
    with zipfile.ZipFile(wheels.trim_wheel("vllm", str(src), str(tmp_path))) as z:
        kept = set(z.namelist())
        new_record = z.read("vllm-0.34.0.dist-info/RECORD").decode().splitlines()
        stand_in = z.read("vllm/_C_stable_libtorch.py")
    assert kept == set(names[:8]) | {"vllm-0.34.0.dist-info/RECORD", "vllm/_C_stable_libtorch.py"}
    assert {row[0] for row in csv.reader(new_record)} == kept
    digest = base64.urlsafe_b64encode(hashlib.sha256(stand_in).digest()).rstrip(b"=").decode()
    assert f"vllm/_C_stable_libtorch.py,sha256={digest},{len(stand_in)}" in new_record
    compile(stand_in, "vllm/_C_stable_libtorch.py", "exec")


def test_torch_symm_algorithm_without_a_kernel_for_this_world_skips_the_case() -> None:
    """torch's two-shot has no kernel for 16 ranks and says so before launching anything: that
    case is skipped with torch's words, so the backend's other cases still run; any other error
    stays an error."""
    from bench.backend_torch_symm import TorchSymmBackend
    from bench.outcome import CaseSkipped

    def raising(message: str):
        def op(*args: Any) -> torch.Tensor:
            raise RuntimeError(message)
        return op

    backend = object.__new__(TorchSymmBackend)
    backend._group_name = "g"
    backend._one_shot_out = lambda inp, op, group, out: out.copy_(inp)
    bufs = backends.Buffers(torch.arange(4.0), torch.zeros(4))
    assert torch.equal(backend.call(bufs, "one_shot"), torch.arange(4.0))
    backend._two_shot_out = raising("Not implemented for world_size=16")
    with pytest.raises(CaseSkipped, match="two_shot: Not implemented for world_size=16"):
        backend.call(bufs, "two_shot")
    backend._two_shot_out = raising("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        backend.call(bufs, "two_shot")
