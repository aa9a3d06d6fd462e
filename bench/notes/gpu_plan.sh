#!/bin/bash
# The first owed GPU runs of NEXT_GPU_RUNS.md as one short device call (one H200, ~2 min):
#   run(command="bash bench/notes/gpu_plan.sh", timeout_s=300)
# Each step has its own limit and leaves its log under $OUT/plan (packed at every step, so a
# cut-off run still returns what finished).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
t0=$(date +%s); R=/tmp/plan; mkdir -p $R
step() { echo; echo "=== $1 ($(( $(date +%s) - t0 )) s)"; }
pack() { tar czf $OUT/plan.tgz -C /tmp plan; }
PCIE_AR_CUDA_ARCHS=90 python3 setup.py build_ext --inplace > $R/build.log 2>&1 || { tail -30 $R/build.log; exit 1; }
step "W=8: 32-warp programs (one word per thread) vs the shipped 16-warp ones, alternated"
timeout 90 python3 bench/notes/fused_shape_sweep.py 8 "[(4, 16, 0), (4, 32, 0), (4, 16, 0), (4, 32, 0)]" > $R/sweep_w8.log 2>&1
grep -v "^\[" $R/sweep_w8.log | tail -8; pack
step "W=4: 16-warp programs vs the shipped 8-warp ones, alternated"
timeout 90 python3 bench/notes/fused_shape_sweep.py 4 "[(7, 8, 128), (7, 16, 0), (7, 8, 128), (7, 16, 0)]" > $R/sweep_w4.log 2>&1
grep -v "^\[" $R/sweep_w4.log | tail -8; pack
step "done"
