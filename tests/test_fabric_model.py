"""CPU tests of bench/fabric_model.py: the calibration on FlashInfer's published TP8 figures, and
the invariants any sensible version of the model keeps (more bytes never faster, a better fabric
never slower, staging pays only where all-to-all writes collapse)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench import fabric_model as fm
from bench import fabric_phases as fp
from pcie_allreduce.plan import algorithms

KIB = 1024
SIZES = [1 * KIB, 4 * KIB, 14 * KIB, 56 * KIB, 128 * KIB, 448 * KIB, 1024 * KIB]


@pytest.mark.parametrize("nbytes", sorted(fm.FLASHINFER_PUBLISHED_US))
def test_flashinfer_figures_within_20_percent(nbytes: int) -> None:
    name, published, got, err = fm.calibration_errors()[nbytes]
    assert abs(err) <= 0.20, (name, published, got)


def test_default_policy_variants() -> None:
    """The calibration uses FlashInfer's seed policy: unstaged below 32 KiB at TP8, staged ring above."""
    variants = {n: v for n, (v, *_rest) in fm.calibration_errors().items()}
    assert variants == {12 * KIB: "fi_UNSTAGED", 96 * KIB: "fi_STAGED_RING", 384 * KIB: "fi_STAGED_RING"}
    assert fp.flashinfer_default_blocks(8, 96 * KIB) == ("STAGED_RING", 1, 256)
    assert fp.flashinfer_default_blocks(8, 1024 * KIB) == ("STAGED_RING", 4, 256)


def test_fitted_values_are_a_local_optimum() -> None:
    """FITTED is what the least-squares fit gives: no neighbour on its grid fits better."""
    base = fm.FLASHINFER_BOX
    loss = fm._calibration_loss(base)
    for da, dit in ((0.002, 0), (-0.002, 0), (0, 0.001), (0, -0.001)):
        other = replace(base, a2a_fraction=base.a2a_fraction + da, block_iter_us=base.block_iter_us + dit)
        assert fm._calibration_loss(other) >= loss


def test_only_two_values_are_fitted() -> None:
    fitted = [k for k, v in fm.SOURCES.items() if v.startswith("FITTED")]
    assert sorted(fitted) == sorted(fm.FITTED) == ["a2a_fraction", "block_iter_us"]
    for key in ("link_gbps", "hop_us", "cross_gbps", "read_gbps"):
        assert fm.SOURCES[key].startswith("published")


def test_flashinfer_crossover_near_its_policy() -> None:
    """Not fitted: the model's unstaged / staged-ring crossover lands near the 32 KiB FlashInfer switches at."""
    assert 32 * KIB <= fm.flashinfer_crossover() <= 64 * KIB


@pytest.mark.parametrize("fabric", [fm.SEED_BOX, replace(fm.SEED_BOX, a2a_fraction=fm.MILD_A2A)])
def test_more_bytes_never_faster(fabric: fm.Fabric) -> None:
    for algo in fm.all_algorithms(fabric):
        times = [fm.predict_us(fabric, algo, n) for n in SIZES]
        assert times == sorted(times), algo.name
        assert times[0] > fabric.fixed_us


@pytest.mark.parametrize("change", [
    {"link_gbps": 60.0}, {"a2a_fraction": 0.5}, {"cross_gbps": 40.0}, {"read_gbps": 60.0},
    {"hop_us": 0.2}, {"flag_us": 0.5}, {"fixed_us": 1.0}, {"block_iter_us": 0.1},
])
def test_a_better_fabric_is_never_slower(change: dict) -> None:
    better = replace(fm.SEED_BOX, **change)
    for algo in fm.all_algorithms(fm.SEED_BOX):
        for n in SIZES:
            assert fm.predict_us(better, algo, n) <= fm.predict_us(fm.SEED_BOX, algo, n) + 1e-12, (algo.name, n)


def _ours(fabric: fm.Fabric, name: str, blocks: int | None = None) -> fm.Algorithm:
    algo = next(a for a in fp.ours(fabric) if a.name == name)
    return algo if blocks is None else replace(algo, blocks=lambda n: blocks)


@pytest.mark.parametrize("blocks", [1, 4, 16])
def test_staging_never_pays_without_collapse(blocks: int) -> None:
    """With no all-to-all collapse, one peer at a time moves the same bytes no faster."""
    flat = replace(fm.SEED_BOX, a2a_fraction=1.0)
    for n in SIZES:
        staged = fm.predict_us(flat, _ours(flat, "staged", blocks), n)
        assert staged >= fm.predict_us(flat, _ours(flat, "oneshot", blocks), n)


def test_staging_pays_where_all_to_all_collapses() -> None:
    for n in (56 * KIB, 448 * KIB):
        assert fm.predict_us(fm.SEED_BOX, _ours(fm.SEED_BOX, "staged"), n) < \
            fm.predict_us(fm.SEED_BOX, _ours(fm.SEED_BOX, "oneshot"), n)


def test_lines_never_beat_full_payload() -> None:
    for fabric in (fm.SEED_BOX, replace(fm.SEED_BOX, a2a_fraction=1.0)):
        for n in SIZES[:-1]:
            assert fm.predict_us(fabric, _ours(fabric, "oneshot_ll"), n) >= \
                fm.predict_us(fabric, _ours(fabric, "oneshot_full"), n)


def test_more_blocks_never_slower_without_headers() -> None:
    """Wider launches only lift the copy-loop cap; per-block headers and flags are bytes, so the
    invariant is for the forms without them."""
    algos = [a for a in fm.all_algorithms(fm.SEED_BOX)
             if all(ph.header_bytes == 0 for ph in a.phases)]
    assert {"oneshot_ll", "island_flagless_bf16", "fi_STAGED_RING"} <= {a.name for a in algos}
    for algo in algos:
        for n in SIZES:
            times = [fm.predict_us(fm.SEED_BOX, replace(algo, blocks=lambda _n, b=b: b), n) for b in (1, 2, 4, 8, 32)]
            assert times == sorted(times, reverse=True), (algo.name, n)


def test_fp32_partials_never_faster_than_bf16() -> None:
    algos = {a.name: a for a in fp.planned(fm.SEED_BOX)}
    for n in SIZES:
        for form in ("flagless", "staged"):
            assert fm.predict_us(fm.SEED_BOX, algos[f"island_{form}_fp32"], n) >= \
                fm.predict_us(fm.SEED_BOX, algos[f"island_{form}_bf16"], n)


def test_one_island_has_no_island_forms_and_no_boundary() -> None:
    one = replace(fm.SEED_BOX, islands=1, cross_gbps=0.001)
    assert fp.planned(one) == [] and fm.flashinfer(one) == []
    for algo in fp.ours(one):
        assert fm.predict_us(one, algo, 56 * KIB) < 1e3  # the tiny cross rate is never used


def test_cli_prints_every_algorithm_and_the_verify_pass(capsys: pytest.CaptureFixture[str]) -> None:
    assert fm.main(["--sizes", "14K", "56K"]) == 0
    out = capsys.readouterr().out
    assert "ESTIMATES" in out and "Verify pass: 122" in out
    for algo in fm.all_algorithms(fm.SEED_BOX):
        assert algo.name in out


# ---- the island table (pcie_allreduce.plan.tables.island_fabric_table) against the model ----------

ISLAND_SIZES = [256, 1 * KIB, 4 * KIB, 14 * KIB, 56 * KIB, 128 * KIB, 448 * KIB, 1024 * KIB, 4096 * KIB]
CAPPED = ("oneshot_ll", "oneshot_full", "twoshot_full")


def _island_boxes(world: int) -> list[fm.Fabric]:
    """The seed box's fabric at ``world`` ranks in two islands, at the fitted all-to-all fraction
    and at the milder measured one: the table must hold up under either."""
    return [replace(fm.SEED_BOX, world=world, islands=2, a2a_fraction=a) for a in (fm.FITTED["a2a_fraction"],
                                                                                  fm.MILD_A2A)]


# What the built-in tables may name: the island and pull forms are chosen by tune on the box only
# (the seed box's peer read rate and its island chain are not measured).
TUNED_ONLY = algorithms.ISLAND_ALGORITHMS + algorithms.PULL_ALGORITHMS


def _times(fab: fm.Fabric, nbytes: int) -> dict[str, float]:
    return {a.name: fm.predict_us(fab, a, nbytes) for a in fp.ours(fab)
            if not (a.name in CAPPED and nbytes > 496 * KIB) and a.name not in TUNED_ONLY}


@pytest.mark.parametrize("world", [4, 6, 8])
def test_the_island_table_picks_near_the_safest_built_in_algorithm(world: int) -> None:
    """Per size, each algorithm's worst ratio to the best under the two fractions; the table's
    pick is within 1.10x of the algorithm whose worst ratio is smallest."""
    boxes = _island_boxes(world)
    for n in ISLAND_SIZES:
        times = [_times(fab, n) for fab in boxes]
        worst = {name: max(t[name] / min(t.values()) for t in times) for name in times[0]}
        pick = fm.our_default(boxes[0], n).name
        assert worst[pick] <= 1.10 * min(worst.values()), (world, n, pick, worst)


@pytest.mark.parametrize("a2a", [fm.FITTED["a2a_fraction"], fm.MILD_A2A])
def test_across_islands_the_island_table_is_never_slower_than_the_flat_one(a2a: float) -> None:
    fab = replace(fm.SEED_BOX, a2a_fraction=a2a)
    flat = fp.default_table()
    by_name = {a.name: a for a in fp.ours(fab)}
    for n in ISLAND_SIZES[:-2]:
        island_us = fm.predict_us(fab, fm.our_default(fab, n), n)
        flat_us = fm.predict_us(fab, by_name[flat.select(n, 8, "bfloat16", ll_capacity=512 * KIB).algo], n)
        assert island_us <= flat_us * 1.001, (n, island_us, flat_us)
        if a2a == fm.FITTED["a2a_fraction"] and n >= 4 * KIB:  # where all-to-all writes collapse
            assert island_us <= flat_us / 2, (n, island_us, flat_us)
