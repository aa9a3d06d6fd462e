"""CPU tests of the ``python -m bench`` command itself and of ``python -m bench topo``.

The topology probe and its table on a fake extension; the one-line exit (status 3, no traceback)
where no GPU can run the benchmark or no requested backend can run; help for the command and its
subcommands; the report printed and the files written (on a FAKE result set); the command line
as result files record it; the NCCL LL row and the backends registered for boxes without P2P;
and ``python -m bench.graph_loop`` parsing its sizes and exiting with 3 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

import pcie_allreduce
from pcie_allreduce.tools import ranks

from bench import __main__ as bench_cli
from bench import backends, command, environment, report, runner, topo

from tests._bench_cli_support import _config, _fake_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_GPU = ranks.skip_reason_no_gpu() is not None or not pcie_allreduce.is_available()
NO_GPU_TOPO = NO_GPU


# ----------------------------------------------------------------------------- topo


class _FakeExt:
    """Four GPUs on two NUMA nodes; GPUs 0 and 3 have no peer access to each other."""

    def pci_bus_id(self, device: int) -> str:
        return f"00000000:{0x19 + device * 0x20:02X}:00.0"

    def can_access_peer(self, device: int, peer: int) -> bool:
        return {device, peer} != {0, 3}


def test_topo_probe_and_format(tmp_path) -> None:
    for device, node in enumerate(("0", "0", "1", "-1")):
        path = tmp_path / topo.sysfs_bus_id(_FakeExt().pci_bus_id(device))
        path.mkdir()
        (path / "numa_node").write_text(node + "\n")
    found = topo.probe(_FakeExt(), ["RTX PRO 6000"] * 4, sysfs_root=str(tmp_path), smi_topo="GPU0 X PIX")
    assert [g.pci_bus_id for g in found.gpus] == ["0000:19:00.0", "0000:39:00.0", "0000:59:00.0", "0000:79:00.0"]
    assert [g.numa_node for g in found.gpus] == [0, 0, 1, None]
    assert found.peer_access[0] == (True, True, True, False) and found.peer_access[3][0] is False
    text = topo.format_topology(found)
    assert "\nGPU0  X     Y     Y     N\n" in text and "\n      GPU0  GPU1  GPU2  GPU3\n" in text
    assert "2 pairs without peer access" in text and "nvidia-smi topo -m" in text
    data = json.loads(json.dumps(found.to_dict()))
    assert data["gpus"][2]["numa_node"] == 1 and data["peer_access"][3] == [False, True, True, True]
    assert topo.numa_node("0000:ff:00.0", str(tmp_path)) is None
    assert topo.sysfs_bus_id("0000:19:00.0") == "0000:19:00.0"


@pytest.mark.skipif(not NO_GPU_TOPO, reason="this machine has a GPU and the extension")
def test_topo_without_gpu_exits_with_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench", "topo"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 3 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- the command itself



@pytest.mark.skipif(not NO_GPU, reason="this machine can run the benchmark")
@pytest.mark.parametrize("argv", [[], ["--sizes", "14K"], ["--out", "{tmp}"]])
def test_bench_without_gpu_exits_with_one_line(argv: list[str], tmp_path) -> None:
    argv = [a.format(tmp=tmp_path) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "bench", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("python -m bench: cannot run here: ")
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.skipif(not NO_GPU, reason="this machine can run the benchmark")
@pytest.mark.parametrize("argv, prefix", [(["--fused"], "python -m bench: "),
                                          (["verify", "--fused"], "python -m bench verify: ")])
def test_modes_without_gpu_exit_with_one_line(argv: list[str], prefix: str, capsys) -> None:
    assert bench_cli.main(argv) == 3
    captured = capsys.readouterr()
    assert captured.err.startswith(prefix + "cannot run here: ") and captured.err.count("\n") == 1
    assert captured.out == ""


def test_help_works_everywhere() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "--calls-per-graph" in proc.stdout and "--eager" in proc.stdout
    assert "--fused" in proc.stdout and all(mode in proc.stdout for mode in ("verify", "topo", "plot"))


@pytest.mark.parametrize("argv, fragment", [(["verify", "--help"], "--draft-tokens"),
                                            (["topo", "--help"], "--no-probe"), (["plot", "--help"], "JSON")])
def test_subcommand_help(argv: list[str], fragment: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        bench_cli.main(argv)
    assert info.value.code == 0 and fragment in capsys.readouterr().out


def test_main_reports_unavailable_in_one_line(monkeypatch, capsys) -> None:
    from pcie_allreduce.errors import UnavailableError

    def refuse(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        raise UnavailableError("no GPU\nat all")

    monkeypatch.setattr(command, "run", refuse)
    assert bench_cli.main([]) == 3
    assert capsys.readouterr().err == "python -m bench: cannot run here: no GPU at all\n"


def test_bench_command_prints_report_and_writes_files(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setattr(command, "unavailable_reason", lambda cfg: None)
    monkeypatch.setattr(environment, "host_environment", lambda: {})
    monkeypatch.setattr(runner, "run_sweep", lambda cfg, gpus, env, echo, bar: _fake_report())
    assert bench_cli.main(["--sizes", "14K", "--out", str(tmp_path)]) == 1  # the fake has a failed case of ours
    captured = capsys.readouterr()
    assert captured.out == report.format_report(_fake_report())
    assert {"bench.csv", "bench.json", "bench.txt"} <= set(os.listdir(tmp_path))
    assert f"wrote {tmp_path}" in captured.err
    # The PNG when matplotlib imports, else one line saying why not.
    assert ("bench.png" in os.listdir(tmp_path)) != ("plot skipped: matplotlib is not importable" in captured.err)


def test_bench_command_with_nothing_runnable(monkeypatch, capsys) -> None:
    monkeypatch.setattr(command, "unavailable_reason", lambda cfg: None)
    monkeypatch.setattr(environment, "host_environment", lambda: {})
    monkeypatch.setattr(backends, "skip_reason", lambda b, w, g: "NCCL refuses two ranks on one GPU")
    assert bench_cli.main(["--backends", "nccl", "--world", "2", "4"]) == 3
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == ("python -m bench: cannot run here: no requested backend can run here "
                    "(nccl: NCCL refuses two ranks on one GPU)")


def test_nccl_ll_is_the_tuned_nccl_row() -> None:
    from bench import backends

    assert backends.algos_for("nccl_ll", ("auto",)) == backends.algos_for("nccl", ("auto",)) == ("default",)
    assert backends.rank_env("nccl_ll", 8, 8) == {"NCCL_PROTO": "LL"}
    assert backends.rank_env("nccl", 8, 8) == {}
    assert "refuses two ranks on one GPU" in backends.skip_reason("nccl_ll", 8, 1)
    assert _config(["--backends", "nccl_ll"], gpu_count=8).backends == ("nccl_ll",)


def test_result_files_record_the_command_as_typed() -> None:
    from bench.environment import command_line

    assert command_line(["/any/checkout/bench/__main__.py", "--out", "a b"]) == "python -m bench --out 'a b'"
    assert command_line(["/usr/local/bin/pcie-allreduce", "tune"]) == "pcie-allreduce tune"


def test_rows_for_boxes_without_p2p_run_when_named() -> None:
    """ours_host (our kernels over pinned host memory) and nccl_shm (NCCL with P2P disabled) are
    the comparison for boxes without usable P2P: registered, off by default, and set up so."""
    from bench import backends, options
    from bench.backend_nccl import NcclSharedMemoryBackend
    from bench.backend_ours import OursBackend, OursHostBackend

    assert set(backends.OPT_IN) == {"ours_host", "nccl_shm", "ours_hier"} <= set(backends.BACKENDS)
    assert not set(backends.OPT_IN) & set(backends.DEFAULT_BACKENDS)
    assert options.BenchConfig(worlds=(2,), sizes=(1024,)).backends == backends.DEFAULT_BACKENDS
    assert backends.backend_class("ours_host") is OursHostBackend and OursHostBackend.transport == "host"
    assert OursBackend.transport is None  # the Communicator's default: auto
    assert backends.rank_env("nccl_shm", 2, 2)["NCCL_P2P_DISABLE"] == "1"
    assert backends.algos_for("ours_host", ["oneshot", "auto"]) == ("oneshot", "auto", "host_oneshot", "host_twoshot")


def test_graph_loop_parses_sizes_and_exits_3_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import graph_loop

    if ranks.skip_reason_no_gpu() is None:
        pytest.skip("a GPU is present: the no-GPU exit is not reachable here")
    assert graph_loop.main(["--world", "2", "--sizes", "14K", "56K", "--algos", "oneshot_full"]) == 3
    assert graph_loop.main(["--world", "2", "--transport", "host", "--algos", "host_oneshot"]) == 3
    assert "python -m bench.graph_loop:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        graph_loop.main(["--sizes", "fourteen"])
    assert graph_loop.main(["--fused", "--world", "2", "--fused-algos", "oneshot_full", "--chunks", "1", "7"]) == 3
    assert graph_loop.main(["--fused", "--world", "2", "--fused-algos", "oneshot_full", "--quads"]) == 3
    for bad in ("0", "two"):
        with pytest.raises(SystemExit):
            graph_loop.main(["--fused", "--chunks", bad])


def test_graph_loop_refuses_forced_shapes_without_a_kernel_to_force(capsys: pytest.CaptureFixture[str]) -> None:
    """--chunks / --quads force shapes of the data-as-flag kernels: without one of them among
    --fused-algos they would time nothing extra, so the command says so before any rank starts."""
    from bench import graph_loop

    for argv in (["--chunks", "2"], ["--quads"], ["--chunks", "2", "--quads"]):
        with pytest.raises(SystemExit):
            graph_loop.main(["--fused", "--world", "8", "--fused-algos", "auto", "unfused", "oneshot", *argv])
        assert "--fused-algos" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        graph_loop.main(["--fused", "--fused-algos", "oneshot_ll", "--quads"])
    assert "oneshot_full" in capsys.readouterr().err


def test_graph_loop_forces_the_chunk_counts_and_kernels_a_shape_allows() -> None:
    """The forced rows of the graph loop: each chunk count whose programs fit the block cap, and
    with ``--quads`` both kernels of the full payload (the quads only where rows are whole quads)."""
    import types

    import torch

    from bench import graph_loop

    comm = types.SimpleNamespace(world_size=2, block_cap=66)
    x = torch.empty(4, 7168, dtype=torch.bfloat16)
    labels = [label for label, _ in graph_loop._forced_variants(comm, "oneshot_full", x, [1, 7, 100], False)]
    assert labels == ["oneshot_full/c1", "oneshot_full/c7"]
    labels = [label for label, _ in graph_loop._forced_variants(comm, "oneshot_full", x, [1, 7, 100], True)]
    assert labels == ["oneshot_full/c1/quads", "oneshot_full/c1/words", "oneshot_full/c7/quads",
                      "oneshot_full/c7/words", "oneshot_full/quads", "oneshot_full/words"]
    assert [label for label, _ in graph_loop._forced_variants(comm, "oneshot_ll", x, [], True)] == []
    odd = torch.empty(4, 7166, dtype=torch.bfloat16)
    assert [label for label, _ in graph_loop._forced_variants(comm, "oneshot_full", odd, [], True)] == [
        "oneshot_full/words"]
    variants = dict(graph_loop._forced_variants(comm, "oneshot_full", x, [], True))
    assert variants["oneshot_full/quads"] == {"max_programs": 66, "quads": True}
    both = dict(graph_loop._forced_variants(comm, "oneshot_full", x, [2], True))
    assert list(both) == ["oneshot_full/c2/quads", "oneshot_full/c2/words", "oneshot_full/quads",
                          "oneshot_full/words"]
    assert both["oneshot_full/c2/quads"] == {"max_programs": 66, "chunks": 2, "quads": True}


def test_graph_loop_times_our_all_reduce_before_each_other_norm_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """``unfused+<kernel>`` rows: our all-reduce, then the other library's in-place add + RMSNorm on
    its output and a running residual that each repetition restores first (the kernel adds into it);
    none where no such kernel imports."""
    import types

    import torch

    from bench import graph_loop, norm_ops

    calls: list[str] = []

    def fake_kernel(y, residual, weight, eps):
        calls.append("norm")
        residual += y  # what an in-place add + RMSNorm does to the residual
        y.copy_(residual)

    def all_reduce(x, out):
        calls.append("all_reduce")
        out.copy_(2 * x)

    def time_in_graph(call, before_each, warm_replays):  # two repetitions of two calls, without a GPU
        calls.append(f"warm {warm_replays}")
        for _ in range(2):
            before_each()
            call()
            call()
        return 1.5

    gen = torch.Generator().manual_seed(5)
    x, residual = torch.randn(3, 40, generator=gen), torch.randn(3, 40, generator=gen)
    kept = residual.clone()
    comm = types.SimpleNamespace(all_reduce=all_reduce, check=lambda: calls.append("check"))
    monkeypatch.setattr(norm_ops, "in_place_kernels", lambda: ({"fi_addnorm": fake_kernel}, {}))
    monkeypatch.setattr(graph_loop, "time_in_graph", time_in_graph)
    monkeypatch.setattr(torch.distributed, "barrier", lambda group=None: calls.append("barrier"))
    out = torch.full_like(x, float("nan"))
    rows = graph_loop._other_pairs(comm, None, x, out, residual, torch.ones(40), 1e-6, 7)
    assert rows == [("unfused+fi_addnorm", 3, 1.5)]
    assert calls == ["warm 7"] + ["barrier", "all_reduce", "norm", "all_reduce", "norm"] * 2 + ["check"]
    assert torch.equal(residual, kept)  # the caller's residual is never written
    # the last repetition started from the residual's own values: two additions of 2x onto it
    assert torch.equal(out, (kept + 2 * x) + 2 * x)
    monkeypatch.setattr(norm_ops, "in_place_kernels", lambda: ({}, {"fi_addnorm": "ImportError: no"}))
    assert graph_loop._other_pairs(comm, None, x, out, residual, torch.ones(40), 1e-6, 0) == []
