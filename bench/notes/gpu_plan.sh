#!/bin/bash
# The first owed GPU run of NEXT_GPU_RUNS.md (§1) as one short device call (one H200, ~2 min):
#   run(command="bash bench/notes/gpu_plan.sh", carry=[".whl"], timeout_s=300)
# Each step has its own limit and leaves its log under $OUT/plan (packed at every step, so a
# cut-off run still returns what finished).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
t0=$(date +%s); R=/tmp/plan; mkdir -p $R
step() { echo; echo "=== $1 ($(( $(date +%s) - t0 )) s)"; }
pack() { tar czf $OUT/plan.tgz -C /tmp plan; }
PCIE_AR_CUDA_ARCHS=90 python3 setup.py build_ext --inplace > $R/build.log 2>&1 || { tail -30 $R/build.log; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > $R/pip.log 2>&1
step "small sizes: ours vs FlashInfer pcie_ipc, W=2 4 8, two interleaved rounds"
PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pcie_allreduce bench --world 2 4 8 --sizes 1K 14K 56K 256K \
  --backends ours flashinfer --time-budget 0.2 --rounds 2 --out $R/fi > $R/fi.log 2>&1
grep -E "^#   size|^ +[0-9]+ +[248] " $R/fi.log | tail -16; pack
step "done"
