"""bench.kernel_variant and the graph loop's ``--against``: another checkout's fused Triton modules
loaded as a set of their own, swapped in only while asked, this checkout's left as they were."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

pytest.importorskip("triton")

from bench import graph_loop, kernel_variant  # noqa: E402
from pcie_allreduce.fused import path  # noqa: E402

FUSED = os.path.dirname(path.__file__)


def _other_checkout(tmp_path, marker: str) -> str:
    """A copy of this checkout's fused modules under tmp_path/pcie_allreduce/fused, each marked."""
    folder = tmp_path / "pcie_allreduce" / "fused"
    folder.mkdir(parents=True)
    for name in kernel_variant.MODULES:
        shutil.copy(os.path.join(FUSED, f"{name}.py"), folder / f"{name}.py")
        with open(folder / f"{name}.py", "a") as f:
            f.write(f"\nVARIANT_MARKER = {marker!r}\n")
    return str(tmp_path)


def test_a_variant_is_its_own_module_set_and_this_checkout_is_left_as_it_was(tmp_path) -> None:
    import pcie_allreduce.fused as package
    from pcie_allreduce.fused import oneshot_ll, oneshot_quads

    before = {name: sys.modules.get(f"pcie_allreduce.fused.{name}") for name in kernel_variant.MODULES}
    path_before = list(package.__path__)
    variant = kernel_variant.load(_other_checkout(tmp_path, "B"))
    assert set(variant) == set(kernel_variant.MODULES)
    for name, module in variant.items():
        assert module.__file__.startswith(str(tmp_path)), name
        assert module.VARIANT_MARKER == "B"
        assert module is not before[name]
    # the variant's modules import each other, never this checkout's
    assert variant["oneshot_quads"].row_sum_of_squares is variant["oneshot_ll"].row_sum_of_squares
    assert variant["oneshot_quads"].row_sum_of_squares is not oneshot_ll.row_sum_of_squares
    # this checkout's modules, package path and attributes are back
    assert {name: sys.modules.get(f"pcie_allreduce.fused.{name}") for name in kernel_variant.MODULES} == before
    assert list(package.__path__) == path_before
    assert package.oneshot_quads is oneshot_quads and not hasattr(oneshot_quads, "VARIANT_MARKER")


def test_a_folder_without_the_modules_is_refused_by_name(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"no .*oneshot_quads\.py.* \(expected a checkout of pcie_allreduce\)"):
        kernel_variant.load(str(tmp_path))


def test_the_path_launches_the_variant_only_while_swapped(tmp_path) -> None:
    variant = kernel_variant.load(_other_checkout(tmp_path, "B"))
    side = path._triton()  # noqa: SLF001
    own = side.oneshot_quads
    with kernel_variant.swapped(variant):
        assert path._triton().oneshot_quads is variant["oneshot_quads"]  # noqa: SLF001
    assert side.oneshot_quads is own
    with pytest.raises(RuntimeError), kernel_variant.swapped(variant):
        raise RuntimeError("a timing that failed")
    assert side.oneshot_quads is own and side.add_rmsnorm.__file__.startswith(FUSED)


def test_rows_alternate_a_and_b_and_b_compiles_first(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    variant = kernel_variant.load(_other_checkout(tmp_path, "B"))
    log: list[str] = []

    def time_call(comm, call, group, warm, reset=lambda: None):
        marked = getattr(path._triton().oneshot_quads, "VARIANT_MARKER", "A")  # noqa: SLF001
        log.append(f"time {marked} warm {warm}")
        return float(len(log))

    monkeypatch.setattr(graph_loop, "_time_call", time_call)
    monkeypatch.setattr(torch.distributed, "barrier", lambda group=None: log.append("barrier"))
    rows = graph_loop._alternated(None, None, "auto:oneshot_full", 4, lambda: None, variant,
                                  lambda: log.append("compile " + getattr(path._triton().oneshot_quads,  # noqa: SLF001
                                                                          "VARIANT_MARKER", "A")), 9, 2)
    assert [label for label, _, _ in rows] == ["auto:oneshot_full A1", "auto:oneshot_full B1",
                                               "auto:oneshot_full A2", "auto:oneshot_full B2"]
    assert all(tokens == 4 for _, tokens, _ in rows)
    assert log == ["time A warm 9", "compile B", "time B warm 9", "time A warm 9", "time B warm 9"]


def test_a_kernel_is_compiled_in_the_launch_it_is_timed_with_then_the_ranks_meet(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """B's kernel (and each forced one) is compiled, launching nothing, with the communicator's PDL
    setting and the call's shape arguments, and only then do the ranks meet."""
    import types

    import torch

    from pcie_allreduce.layout import WorkspaceView

    log: list[object] = []
    monkeypatch.setattr(WorkspaceView, "of", staticmethod(lambda workspace: f"view of {workspace}"))
    monkeypatch.setattr(path, "launch", lambda view, algo, *tensors, **kwargs: log.append((view, algo, len(tensors),
                                                                                         kwargs)))
    monkeypatch.setattr(torch.distributed, "barrier", lambda group=None: log.append(("barrier", group)))
    comm = types.SimpleNamespace(_workspace=lambda: "ws", dependent_launch=True)
    graph_loop._compile_on_every_rank(comm, "group", "oneshot_full", "x", "r", "w", 1e-6, "n", "nr", max_programs=15)
    assert log == [("view of ws", "oneshot_full", 6, dict(compile_only=True, dependent=True, max_programs=15)),
                   ("barrier", "group")]


def test_against_is_checked_before_any_rank_starts(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        graph_loop.main(["--against", _other_checkout(tmp_path, "B")])
    assert "--against swaps the fused Triton kernels: it needs --fused" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        graph_loop.main(["--fused", "--against", str(tmp_path / "nowhere")])
    assert "--against: " in capsys.readouterr().err
