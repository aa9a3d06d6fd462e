"""The fused all-reduce + residual add + RMSNorm: the call's path from validated arguments to the
launch (:mod:`~pcie_allreduce.fused.path`), the launch shapes and signatures of its kernels
(:mod:`~pcie_allreduce.plan.fused_shapes`, pure, no Triton), the Triton kernels
(:mod:`~pcie_allreduce.fused.rmsnorm`, :mod:`~pcie_allreduce.fused.oneshot_ll`,
:mod:`~pcie_allreduce.fused.oneshot_quads`, :mod:`~pcie_allreduce.fused.add_rmsnorm`) and the protocol's primitives in Triton
(:mod:`~pcie_allreduce.fused.protocol`)."""
