"""Both communicators implement :class:`pcie_allreduce.interface.AllReducer` with its exact
signatures (names, kinds, defaults, annotations), so the engine plugins hold either without
probing; and the CPU stand-in the plugins' tests use does too. The check is shown to fail on a
class with one parameter renamed."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

import pcie_allreduce
from pcie_allreduce.communicator import Communicator
from pcie_allreduce.hierarchy import HierarchicalCommunicator
from pcie_allreduce.inter_node import InterNodeLink
from pcie_allreduce.interface import AllReducer
from tests._standins import GlooCommunicator

METHODS = sorted(name for name, member in vars(AllReducer).items()
                 if inspect.isfunction(member) and not name.startswith("__"))
ATTRIBUTES = sorted(AllReducer.__annotations__)


def mismatches(cls: type, *, exact_annotations: bool = True) -> list[str]:
    """What ``cls`` lacks or spells differently of the protocol (empty: it implements it)."""
    problems = []
    for name in METHODS:
        member = inspect.getattr_static(cls, name, None)
        if not inspect.isfunction(member):
            problems.append(f"{cls.__name__}.{name}: missing")
            continue
        want, have = inspect.signature(getattr(AllReducer, name)), inspect.signature(member)
        if not exact_annotations:  # the stand-ins are untyped: names, kinds and defaults only
            want = want.replace(parameters=[p.replace(annotation=p.empty) for p in want.parameters.values()],
                                return_annotation=inspect.Signature.empty)
        if want != have:
            problems.append(f"{cls.__name__}.{name}{have} is not {name}{want}")
    source = inspect.getsource(cls)
    for name in ATTRIBUTES:  # a class attribute, a property, or set on self in the class's code
        if inspect.getattr_static(cls, name, None) is None and not re.search(rf"self\.{name}\b[^=\n]*=", source):
            problems.append(f"{cls.__name__}.{name}: missing attribute")
    return problems


def test_protocol_lists_the_plugins_calls():
    assert {"all_reduce", "all_reduce_rmsnorm", "check", "close", "serves_stream", "prepare_stream"} <= set(METHODS)
    assert {"handle", "wires", "transport", "max_bytes"} <= set(ATTRIBUTES)


@pytest.mark.parametrize("cls", [Communicator, HierarchicalCommunicator])
def test_communicators_implement_the_protocol_exactly(cls):
    assert mismatches(cls) == []


def test_standin_implements_the_protocol():
    assert mismatches(GlooCommunicator, exact_annotations=False) == []


def test_check_catches_a_renamed_parameter_and_a_missing_method():
    namespace = dict(vars(Communicator))
    renamed = namespace["all_reduce"]

    def all_reduce(self, x, output=None, algo="auto", *, wire=None):  # `out` renamed
        return renamed(self, x, output, algo, wire=wire)

    namespace["all_reduce"] = all_reduce
    del namespace["check"]
    bad = type("Renamed", (), namespace)
    bad.__module__, bad.__qualname__ = Communicator.__module__, "Communicator"  # its source is Communicator's
    problems = mismatches(bad)
    assert any(p.startswith("Renamed.all_reduce(") for p in problems), problems
    assert "Renamed.check: missing" in problems


def test_exported_lazily():
    assert "AllReducer" in pcie_allreduce.__all__
    assert pcie_allreduce.AllReducer is AllReducer


def test_the_public_surface_is_small_and_every_name_resolves():
    """The package exports the communicators, their errors, whether the kernels can run here and the
    FP8 wire's error helpers; nothing of the plan, the fused path or the workspaces."""
    from pcie_allreduce import fp8_wire

    assert set(pcie_allreduce.__all__) == {
        "AllReducer", "Communicator", "HierarchicalCommunicator", "CollectiveError", "CollectiveMismatch",
        "CollectiveTimeout", "InterNodeError", "UnavailableError", "is_available", "unavailable_reason",
        "fp8_error_bound", "fp8_all_reduce", "__version__"}
    assert all(getattr(pcie_allreduce, name) is not None for name in pcie_allreduce.__all__)
    assert pcie_allreduce.fp8_error_bound is fp8_wire.error_bound
    public = {n for n in dir(Communicator) if not n.startswith("_")}
    assert not public & {"workspace", "has_workspace", "raise_if_failed"}, public


def test_hierarchy_refuses_what_it_cannot_serve_with_a_value_error():
    comm = object.__new__(HierarchicalCommunicator)  # the refusals come before any collective
    comm._closed, comm._link = False, InterNodeLink(None, [], 0, 60.0, "gloo")
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="no compressed wire spans nodes"):
        comm.all_reduce(x, wire="fp8")
    with pytest.raises(ValueError, match="no compressed wire spans nodes"):
        comm.all_reduce_rmsnorm(x, x, torch.ones(64), 1e-6, wire="fp8")
    with pytest.raises(ValueError, match="no fused kernel spans nodes"):
        comm.all_reduce_rmsnorm(x, x, torch.ones(64), 1e-6, algo="oneshot_ll")
