"""The fake result set and the option parsing the CPU tests of ``python -m bench`` share
(tests/test_bench_cli_options_and_formats.py, tests/test_bench_cli_command.py,
tests/test_bench_output.py): ``_config`` parses a command line as the bench does, ``_row`` makes one
result row and ``_fake_report`` a sweep of three worlds with failed, wrong and not-run rows and notes.
"""

from __future__ import annotations

from pcie_allreduce.tools.ranks import placement_label

from bench import __main__ as bench_cli
from bench import options
from bench.results import FAILED, NOT_RUN, OK, WRONG, Note, Report, Result, add_speedups


def _config(argv: list[str], gpu_count: int = 1) -> options.BenchConfig:
    parser = bench_cli.build_parser()
    args = parser.parse_args(argv)
    return options.config_from_args(args, args.parser, gpu_count)


def _row(world: int, backend: str, algo: str, size: int, p50: float | None, status: str = OK, **kw) -> Result:
    return Result(world=world, backend=backend, algo=algo, size_bytes=size, count=size // 2, dtype="bfloat16",
                  status=status, p50_us=p50, p99_us=None if p50 is None else p50 * 1.5,
                  rank0_p50_us=p50, replays=100 if p50 else 0, calls_per_graph=16, **kw)


def _fake_report() -> Report:
    rows = [
        _row(4, "ours", "oneshot", 14336, 4.0),
        _row(4, "ours", "auto", 14336, 4.2, resolved_algo="oneshot"),
        _row(4, "ours", "twoshot", 14336, None, status=FAILED, error="rank 1: CollectiveTimeout: boom"),
        _row(4, "torch_symm", "one_shot", 14336, 6.0),
        _row(4, "torch_symm", "two_shot", 14336, 8.0),
        _row(4, "ours", "oneshot", 57344, 5.0),
        _row(4, "torch_symm", "one_shot", 57344, 7.5),
        _row(4, "torch_symm", "two_shot", 57344, None, status=WRONG, error="rank 0: 3 of 28672 elements wrong"),
        _row(2, "ours", "oneshot", 14336, 2.0),
        _row(2, "nccl", "default", 14336, 20.0),
        _row(2, "torch_symm", "one_shot", 14336, 4.0),
        _row(8, "ours", "oneshot", 14336, 6.0),
        _row(8, "torch_symm", "one_shot", 14336, None, status=NOT_RUN, error="not run: hung: rank 3 ..."),
    ]
    notes = [Note(4, "nccl", "skipped", "NCCL refuses two ranks on one GPU (4 ranks on 1 GPU)"),
             Note(8, "torch_symm", "failed", "hung: rank 3 ...", detail="stacks ...")]
    env = {"gpus": ["NVIDIA H200"], "driver": "580.1", "torch": "2.11.0", "cuda_runtime": "13.0",
           "date": "2026-11-29T00:00:00+00:00", "command": "python -m bench"}
    placements = {2: "2 ranks on 2 GPUs", 4: placement_label(4, 1, True),
                  8: placement_label(8, 1, True)}
    return Report(env, options.BenchConfig(worlds=(2, 4, 8), sizes=(14336, 57344)).to_dict(), placements,
                  add_speedups(rows), notes)
