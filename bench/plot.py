"""PNG plot of a report: one panel per world size, one line per backend/algo.

- all-reduce sweep: p50 latency (us) vs message size (bytes), log-log;
- ``--fused``: p50 latency vs tokens, log-log;
- verify: horizontal bars of the pass time (ms) per (model, T, backend/algo).

matplotlib is optional (the ``bench`` extra: ``pip install -e .[bench]``): :func:`write_plot` returns
the reason it could not plot instead of raising. :func:`series` / :func:`bars` are pure and tested on CPU.
"""

from __future__ import annotations

from typing import Any

from bench.results import FUSED, VERIFY, Report, Result

Series = dict[int, dict[str, list[tuple[float, float]]]]  # world -> line label -> sorted (x, y) points


def _x(r: Result) -> float:
    return float(r.tokens if r.workload == FUSED else r.size_bytes)


def _label(r: Result) -> str:
    return f"{r.backend} {r.label}"


def series(report: Report) -> Series:
    """Line data: world -> "backend algo" -> [(size or tokens, p50 us)], ok rows only (where several
    rows share a label and x, the fastest)."""
    best: dict[tuple[int, str, float], float] = {}
    for r in report.results:
        if not r.ok or r.workload == VERIFY:
            continue
        key = (r.world, _label(r), _x(r))
        best[key] = min(best.get(key, float("inf")), float(r.p50_us))  # type: ignore[arg-type]
    out: Series = {}
    for (world, label, x), y in best.items():
        out.setdefault(world, {}).setdefault(label, []).append((x, y))
    for lines in out.values():
        for points in lines.values():
            points.sort()
    return out


def bars(report: Report) -> dict[int, list[tuple[str, float]]]:
    """verify: world -> [("model T=.. backend algo", pass ms)], in table order."""
    out: dict[int, list[tuple[str, float]]] = {}
    for r in report.results:
        if r.ok and r.workload == VERIFY:
            label = f"{r.model} T={r.tokens} {r.backend} {r.label}"
            out.setdefault(r.world, []).append((label, r.pass_ms))  # type: ignore[arg-type]
    return out


def pyplot() -> tuple[Any, str | None]:
    """(matplotlib.pyplot on the Agg backend, None), or (None, why it is not importable)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken backend: no plot either way
        return None, f"matplotlib is not importable ({type(exc).__name__}: {exc}); pip install matplotlib"
    return plt, None


def _title(report: Report, world: int) -> str:
    return f"W={world}: {report.placements.get(world, f'{world} ranks')}"


def write_plot(report: Report, path: str) -> str | None:
    """Write the PNG; None on success, else why nothing was written."""
    plt, problem = pyplot()
    if plt is None:
        return problem
    verify = str(report.config.get("workload")) == VERIFY
    data: dict[int, Any] = bars(report) if verify else series(report)
    if not data:
        return "no successful measurements to plot"
    worlds = sorted(data)
    if verify:
        heights = [max(3.0, 0.28 * len(data[w]) + 1.2) for w in worlds]
        fig, axes = plt.subplots(len(worlds), 1, figsize=(10, sum(heights)), squeeze=False,
                                 gridspec_kw={"height_ratios": heights})
    else:
        fig, axes = plt.subplots(1, len(worlds), figsize=(6.5 * len(worlds), 5), squeeze=False)
    try:
        for ax, world in zip(axes.flat, worlds):
            if verify:
                labels = [label for label, _ in data[world]]
                ax.barh(range(len(labels)), [ms for _, ms in data[world]])
                ax.set_yticks(range(len(labels)), labels, fontsize=7)
                ax.invert_yaxis()
                ax.set_xlabel("collectives per verify pass (ms)")
            else:
                for label, points in sorted(data[world].items()):
                    ax.plot([x for x, _ in points], [y for _, y in points], marker="o", markersize=3, label=label)
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                fused = str(report.config.get("workload")) == FUSED
                ax.set_xlabel("tokens" if fused else "message size (bytes)")
                ax.set_ylabel("p50 latency per call (us)")
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize=7)
            ax.set_title(_title(report, world), fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
    return None


def write_topo_png(data: dict[str, Any], path: str) -> str | None:
    """Heat maps per W; None on success, else why nothing was written (no matplotlib, no data)."""
    from bench.topo_files import measured_worlds

    measured = measured_worlds(data)
    if not measured:
        return "no measurements to plot (topo ran with --no-probe, or every W failed)"
    plt, problem = pyplot()
    if plt is None:
        return problem
    fig, axes = plt.subplots(len(measured), 2, figsize=(11, 4.6 * len(measured)), squeeze=False)
    try:
        for row, (world, m) in enumerate(measured):
            for col, (key, what, fmt) in enumerate((("rtt_us", "flag round trip (us)", "{:.2f}"),
                                                    ("write_gbps", "one-way write (GB/s)", "{:.0f}"))):
                ax = axes[row][col]
                grid = [[float("nan") if v is None else float(v) for v in line] for line in m.get(key) or []]
                image = ax.imshow(grid, cmap="viridis")
                fig.colorbar(image, ax=ax, fraction=0.046)
                for i, line in enumerate(grid):
                    for j, v in enumerate(line):
                        if v == v:  # not NaN (the diagonal)
                            ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=7, color="white")
                ax.set_xticks(range(world), [f"r{j}" for j in range(world)])
                ax.set_yticks(range(world), [f"r{i}" for i in range(world)])
                ax.set_xlabel("receiver")
                ax.set_ylabel("sender")
                ax.set_title(f"W={world} {what}\n{m.get('placement', '')}", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return None


# ---- ``python -m bench plot``: re-plot a saved run (e.g. on a machine that has matplotlib) ------


def add_arguments(parser: Any) -> None:
    parser.add_argument("json", metavar="JSON", help="a bench.json / fused.json / verify.json, or a "
                        "topo.json (then also its CSV)")
    parser.add_argument("--out", metavar="PNG", help="where to write the plot (default: next to JSON, .png)")
    parser.add_argument("--text", action="store_true", help="also print the report again from the JSON")


def run(args: Any, parser: Any) -> int:
    """Handler of ``python -m bench plot``."""
    import json
    import os
    import sys

    from bench import report
    from pcie_allreduce.errors import UnavailableError

    from bench import topo_files

    try:
        with open(args.json, encoding="utf-8") as fh:
            document = json.load(fh)
        if topo_files.is_topo_document(document):
            return _replot_topo(document, args)
        rep = report.from_json_obj(document)
    except (OSError, ValueError, TypeError) as exc:
        parser.error(f"cannot read {args.json}: {exc}")
    if args.text:
        sys.stdout.write(report.format_report(rep))
    path = args.out or os.path.splitext(args.json)[0] + ".png"
    problem = write_plot(rep, path)
    if problem is not None:
        raise UnavailableError(problem)
    print(f"wrote {path}", file=sys.stderr)
    return 0


def _replot_topo(document: dict[str, Any], args: Any) -> int:
    """``plot topo.json``: its CSV and PNG next to it (or the PNG at --out)."""
    import os
    import sys

    from bench import topo_files
    from pcie_allreduce.errors import UnavailableError

    stem = os.path.splitext(args.json)[0]
    with open(stem + ".csv", "w", encoding="utf-8") as fh:
        fh.write(topo_files.csv_text(document))
    print(f"wrote {stem}.csv", file=sys.stderr)
    path = args.out or stem + ".png"
    problem = write_topo_png(document, path)
    if problem is not None:
        raise UnavailableError(problem)
    print(f"wrote {path}", file=sys.stderr)
    return 0
