"""``pcie-allreduce tune``: measure our algorithms at every block count, at the sizes and W you serve,
and cache the algorithm table every Communicator on this machine then adopts.

Measurement (:mod:`.measure`, in W ranks started by :func:`pcie_allreduce.tools.ranks.run_ranks`,
under MPS when they share a GPU): one Communicator; per size, every (algorithm, block count) is
the workspace's raw launch at that forced block count, bypassing the algorithm table. Each shape
must first return the exact sum of the ranks' small-integer inputs (exact in any reduction
order), then is timed as CUDA-graph replays of ``calls_per_graph`` launches
(:mod:`pcie_allreduce.tools.timing`); a replay's time is the slowest rank's. Shapes over the block
cap (ranks sharing a GPU: every rank's blocks must be co-resident) or the low-latency capacity are
skipped identically on every rank.

Derivation (:mod:`.derive`, pure: :func:`~.derive.pick_shapes` and :func:`~.derive.derive_table`):
for every (W, size) the winner is the fastest shape, except that a shape within ``tolerance`` of
the fastest wins if it uses fewer blocks (fewer SMs taken from the model's compute, and the
difference is noise). Then per W, in size order, one rule per measured size::

    Rule(algo, max_bytes=size, world=(W,), bytes_per_block=size // blocks, max_blocks=blocks)

which launches exactly ``blocks`` at the measured size and proportionally fewer below it; the
last rule of a W has no size bound, and a rule the next one already reproduces is dropped. The
default table follows, for the other world sizes. Sizes between two measured ones get the larger
one's rule: measure the sizes you serve.

Fused (``--fused-tokens`` with ``--hidden``; :func:`~.measure.measure_fused_rank`, then
:func:`~.derive.pick_fused` and :func:`~.derive.with_fused_rules`): per W, a second run of the
ranks with the plain table just derived times ``all_reduce_rmsnorm`` at each token count, the
unfused pair and every fused kernel that takes the shape, each first checked on poisoned outputs
(the new residual bitwise ``residual + all_reduce(x)``, the normed rows an fp32 RMSNorm of it to
within a bf16 unit). A kernel is picked where it beats the pair by more than ``tolerance``, else
the pair; per W, one fused rule per run of equal picks in token order, the last unbounded, ahead
of the built-in fused rules.

The report (:mod:`.report`) prints the measurements and the picks against the default table, and
writes the table into the tune cache (:mod:`.cache` writes, :mod:`pcie_allreduce.plan.cache`
names and reads), keyed by GPU model, W and topology fingerprint, where every Communicator created
on the same placement finds it. :mod:`.cli` is the command: its options and the run over world
sizes.
"""
