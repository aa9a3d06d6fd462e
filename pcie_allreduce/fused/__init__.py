"""The fused all-reduce + residual add + RMSNorm: the launch-shape arithmetic of its kernels
(:mod:`~pcie_allreduce.fused.shapes`, pure, no Triton), which the plan's fused choice and the
kernels' launches both read."""
