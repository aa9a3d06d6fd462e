"""Run: `PYTHONPATH=$PWD python3 bench/notes/fused_shape_sweep.py W [CONFIGS]` on a GPU machine (a note, not part of the package).

Time the fused LL kernel at several launch shapes vs the plain all-reduce (graph replay, one GPU
under MPS), same graph/replay method as the bench: 16 calls per graph, slowest rank's median."""
import ast, math, os, sys, time
import torch
import torch.distributed as dist
import triton
import pcie_allreduce
from pcie_allreduce import testing, fused_oneshot_ll as ll

T, H, EPS, CALLS, REPLAYS = 4, 7168, 1e-6, 16, 60
# (chunks per row, warps[, poll back-off ns[, push tile words]]); C = 1 has no row-statistics exchange.
# Sessions 3-4 had a register cap (maxnreg) as the third field; the library dropped register caps
# in session 5 (one word per thread needs none), so their tuples no longer run as written.
CONFIGS = [(7, 16), (7, 8), (4, 32), (4, 16), (2, 32), (14, 8), (14, 4), (7, 16, 100), (4, 32, 100)]


if len(sys.argv) > 2:  # an explicit list of configurations, e.g. "[(4, 16, 0), (4, 8, 128)]"
    os.environ["FUSED_SWEEP_CONFIGS"] = sys.argv[2]  # the spawned ranks import this file without our argv
if "FUSED_SWEEP_CONFIGS" in os.environ:
    CONFIGS = ast.literal_eval(os.environ["FUSED_SWEEP_CONFIGS"])


def shape_for(C, warps):
    width = 2 * math.ceil(math.ceil(H / C) / 2)
    C = math.ceil(H / width)
    block_w = max(triton.next_power_of_2(width // 2), 32 * warps)
    return T * C, C, width, block_w, warps


def timed(ctx, fn):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn(); torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(CALLS):
                fn()
    torch.cuda.synchronize()
    dist.barrier(group=ctx.group)
    times = []
    for _ in range(REPLAYS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / CALLS)
    times.sort()
    med = torch.tensor([times[len(times) // 2]])
    dist.all_reduce(med, op=dist.ReduceOp.MAX, group=ctx.group)
    return float(med)


class _Progress(list):
    """Lines of the result, also printed as they come on rank 0 (a cut-off run still shows them)."""

    def __init__(self, loud: bool):
        super().__init__()
        self.loud = loud

    def append(self, line):
        super().append(line)
        if self.loud:
            print("   ", line, flush=True)


def body(ctx):
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=1 << 20, timeout_s=10)
    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(ctx.device)
    res = torch.randn(T, H, generator=torch.Generator().manual_seed(99)).to(torch.bfloat16).to(ctx.device)
    w = torch.rand(H, generator=torch.Generator().manual_seed(98)).to(torch.bfloat16).to(ctx.device)
    out, nr, normed = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
    lines = _Progress(ctx.rank == 0)
    ar = lambda: comm.all_reduce(x, out=out)
    want_nr = res + comm.all_reduce(x.clone())
    lines.append(f"AR {timed(ctx, ar):.2f}")
    orig, orig_launch, push_words = ll.launch_shape, ll.launch, ll.PUSH_WORDS
    for cfg in CONFIGS:
        shape = shape_for(*cfg[:2])
        if shape[0] > 64 or T * shape[1] * shape[1] > 1024:
            lines.append(f"{cfg} skip"); continue
        if shape[0] > comm.block_cap:  # programs sure to be resident: one per SM of the cap
            lines.append(f"{cfg} skip: {shape[0]} programs > {comm.block_cap} that are sure to be resident"); continue
        ll.launch_shape = lambda *a, _s=shape, **k: _s
        ll.PUSH_WORDS = cfg[3] if len(cfg) > 3 else push_words
        backoff = cfg[2] if len(cfg) > 2 else 0
        ll.launch = lambda *a, _b=backoff, **k: orig_launch(*a, backoff_ns=_b, **k)
        comm._fused_choices.clear()
        f = lambda: comm.all_reduce_rmsnorm(x, res, w, EPS, out=normed, residual_out=nr, algo="oneshot_ll")
        try:
            f(); torch.cuda.synchronize()
            ok = bool(torch.equal(nr, want_nr))
            lines.append(f"{cfg} shape={shape} fused {timed(ctx, f):.2f} correct={ok}")
        except Exception as exc:
            lines.append(f"{cfg} FAILED {str(exc)[:300]}"); break
    ll.launch_shape, ll.launch, ll.PUSH_WORDS = orig, orig_launch, push_words
    lines.append(f"AR {timed(ctx, ar):.2f}")
    comm.close()
    return lines


if __name__ == "__main__":
    world = int(sys.argv[1])
    t = time.time()
    try:
        res = testing.run_ranks(body, world, timeout_s=240)
        print(f"=== W={world}"); [print("  ", l) for l in res[0]]
    except Exception as exc:
        print(f"=== W={world} FAILED", str(exc)[:3000])
    print(f"  ({time.time() - t:.1f} s)", flush=True)
