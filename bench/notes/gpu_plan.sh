#!/bin/bash
# The owed GPU runs of NEXT_GPU_RUNS.md as one time-boxed device call (one H200, ~9 min):
#   run(command="bash bench/notes/gpu_plan.sh", timeout_s=600)
# Each step has its own limit and leaves its log under $OUT/plan (packed as one file at every
# step, so a cut-off run still returns what finished). Steps that need two GPUs are skipped on one.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
t0=$(date +%s); R=/tmp/plan; mkdir -p $R
step() { echo; echo "=== $1 ($(( $(date +%s) - t0 )) s)"; }
pack() { tar czf $OUT/plan.tgz -C /tmp plan; }
PCIE_AR_CUDA_ARCHS=90 python3 setup.py build_ext --inplace > $R/build.log 2>&1 || { tail -30 $R/build.log; exit 1; }
step "fused suite W=4 (graph test with the 1024-column shape)"
PCIE_AR_TEST_WORLDS=4 timeout 150 python3 -m pytest -q -rs tests/test_fused_gpu.py > $R/fused_w4.log 2>&1; tail -3 $R/fused_w4.log; pack
step "fused shape sweep W=4 (incl. C = 1, 2)"
timeout 150 python3 bench/notes/fused_shape_sweep.py 4 > $R/sweep_w4.log 2>&1; grep -v "^\[" $R/sweep_w4.log | tail -20; pack
step "fused shape sweep W=8"
timeout 180 python3 bench/notes/fused_shape_sweep.py 8 > $R/sweep_w8.log 2>&1; grep -v "^\[" $R/sweep_w8.log | tail -20; pack
step "host cost with the torch reference row"
timeout 60 python3 -m pytest -q tests/test_host_overhead.py --benchmark-columns=min,median,mean \
  --benchmark-json=$R/host.json > $R/host.log 2>&1; grep -E "test_host|passed|failed" $R/host.log; pack
step "done"
