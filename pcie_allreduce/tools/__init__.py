"""What runs beside a server, never inside one: ``pcie-allreduce tune`` and its cache writer
(:mod:`.tune`), the console script and its ``env`` report (:mod:`.cli`, :mod:`.environment`), the
rank spawner with its MPS policy (:mod:`.ranks`, :mod:`.rank_child`, :mod:`.rank_supervisor`,
:mod:`.mps`), and the replay timer ``tune`` and the benchmark share (:mod:`.timing`).

The serving path (the communicators, the plan, the fabric, the plugins) imports nothing from here.
"""
