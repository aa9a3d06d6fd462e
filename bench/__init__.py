"""The benchmark harness of pcie_allreduce, run from a checkout's root: ``python -m bench --help``.

Side-by-side all-reduce timings of several backends in one run (also ``--fused`` and ``verify``),
the machine's topology (``topo``), a correctness soak (``soak``) and plots of saved runs (``plot``). It imports the library;
the library never imports it, and it is not part of the wheel. It reuses the library's tools: the
rank spawner (``pcie_allreduce.tools.ranks``), the replay timer and its statistics
(``pcie_allreduce.tools.timing``) and the size parser (``pcie_allreduce.sizes``).

Modules, one idea each (parent side first, then what runs inside the ranks):

- ``options``      argparse options and the validated :class:`~.options.BenchConfig` (pure)
- ``results``      the result-row data model, bandwidths and speed-ups (pure)
- ``report``       table / summary / CSV / JSON formatting and writing (pure)
- ``plan``         the picklable job a backend run hands to its ranks (pure)
- ``progress``     JSON-lines log the ranks append to and the parent reads back
- ``environment``  GPU / driver / software facts and the placement label
- ``backends``     the backend registry (name -> "module:Class") and what a backend class declares
- ``runner``       parent: the cases of a backend, one isolated ``run_ranks`` per (world, backend), retries,
  partial results
- ``command``      the default benchmark and ``verify`` end to end
- ``outcome``      per-rank case outcomes merged into one logged row (pure)
- ``verify_options`` ``verify``'s options and model presets (pure)
- ``table``, ``report_fused``, ``report_verify``, ``plot`` (also topo's heat maps), ``progress_bar``: output
- ``topo``         peer-access matrix, PCI bus ids, NUMA nodes, and ``topo_probe`` /
  ``probe_kernels``: latency and bandwidth measured between ranks
- ``rank``, ``checks``, ``norm_ops``, ``timing``, ``pattern``, ``watchdog``, ``backend_*``: rank side
- ``soak``         ``soak``: random collectives for a number of calls and minutes, every result
  checked (command, rank loop, report); ``soak_schedule``: its calls from a seed (pure)
- ``wheels``       trimmed copies of third-party wheels for an offline GPU machine
- ``fabric_model`` estimated all-reduce times on a PCIe fabric from its description, calibrated on
  published figures (pure; ``python -m bench.fabric_model``)
"""
