"""Time every (algorithm, block count) for a few sizes, to set the default algorithm table.

    python bench/sweep_launch_shapes.py --world 2 4 8 --sizes 14K 56K 448K 4M

Drives the extension's raw launch (``Workspace.all_reduce``) so one communicator serves every
launch shape; times CUDA-graph replays of CALLS back-to-back calls with CUDA events, all ranks
starting together, and prints the median per-call time of rank 0.
"""

from __future__ import annotations

import argparse
import statistics

import torch

CALLS = 32
REPLAYS = 30


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def _rank(ctx, sizes: list[int], blocks: list[int]) -> list[tuple]:
    import torch.distributed as dist

    import pcie_allreduce
    from pcie_allreduce.algo import ALGO_IDS

    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=max(sizes))
    rows = []
    for nbytes in sizes:
        x = torch.randn(nbytes // 2, device=ctx.device).to(torch.bfloat16)
        out = torch.empty_like(x)
        for algo in ("oneshot", "staged", "twoshot"):
            for b in blocks:
                if b > comm.block_cap:
                    continue
                stream = torch.cuda.Stream(ctx.device)
                with torch.cuda.stream(stream):
                    ws = comm.workspace()
                    handle = stream.cuda_stream

                    def call() -> None:
                        ws.all_reduce(ALGO_IDS[algo], x.data_ptr(), out.data_ptr(), nbytes, 2, b, handle)

                    for _ in range(3):
                        call()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, stream=stream):
                        for _ in range(CALLS):
                            call()
                times = []
                for _ in range(REPLAYS):
                    torch.cuda.synchronize()
                    dist.barrier(group=ctx.group)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    graph.replay()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) * 1e3 / CALLS)
                comm.check()
                rows.append((nbytes, algo, b, statistics.median(times)))
    comm.close()
    return rows


def main() -> None:
    from pcie_allreduce import testing

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--sizes", nargs="+", default=["14K", "56K", "448K", "4M"])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    args = parser.parse_args()
    sizes = [_parse_size(s) for s in args.sizes]
    for world in args.world:
        rows = testing.run_ranks(_rank, world, sizes, args.blocks, timeout_s=600)[0]
        print(f"\n# W={world} bf16, per-call us (median of {REPLAYS} graph replays of {CALLS} calls), rank 0")
        print(f"{'bytes':>10} {'algo':>8} " + " ".join(f"{'b=' + str(b):>8}" for b in args.blocks))
        for nbytes in sizes:
            for algo in ("oneshot", "staged", "twoshot"):
                cells = {b: t for n, a, b, t in rows if n == nbytes and a == algo}
                print(f"{nbytes:>10} {algo:>8} " + " ".join(f"{cells[b]:8.2f}" if b in cells else f"{'-':>8}"
                                                        for b in args.blocks))


if __name__ == "__main__":
    main()
