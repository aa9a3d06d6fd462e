"""The import graph of the library, the engine plugins and the benchmark harness (CPU, no imports).

Every ``import`` statement of every module under pcie_allreduce/, sglang_plugin/ and bench/ is read
with ast, those inside functions and under ``if TYPE_CHECKING:`` included (a lazy import is still a
dependency, and a circle closed by a type-only import still ties its modules into one). Then:

- the library never imports the harness, and neither do the plugins;
- no modules of the library, the plugins or the harness import each other in a circle, within a
  package or across them;
- no module of the library or the plugins grows past 500 lines (those already longer may only
  shrink, to the limit), and none of the plan, the fabric or the tools past 400; no class of theirs
  past 300 (the same ratchet);
- the serving path (everything of the library but its tools, and the plugins) never imports the
  tools (tune, the spawner, the timer, the console script): by the import graph, and by importing
  it in a fresh interpreter and listing what got loaded.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from typing import Iterator

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("pcie_allreduce", "sglang_plugin", "vllm_plugin", "bench")


def _modules() -> dict[str, str]:
    """Dotted module name -> path, for every .py file of PACKAGES."""
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(REPO, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                    found[dotted.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _top_level_names(tree: ast.Module) -> set[str]:
    """Names a package's __init__ binds itself (anything else ``from pkg import X`` gets is a submodule)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


TREES = {name: ast.parse(open(path, encoding="utf-8").read(), path) for name, path in MODULES.items()}


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, at any depth (``if TYPE_CHECKING:`` blocks included)."""
    for child in ast.walk(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child


def imported(module: str) -> set[str]:
    """The modules (of PACKAGES, or their top-level names if unknown) ``module`` imports."""
    out = set()
    is_package = MODULES[module].endswith("__init__.py")
    for node in _import_nodes(TREES[module]):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
            continue
        if node.level:  # relative: resolve against this module's package
            base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            if sub in MODULES:
                out.add(sub)
            elif source in MODULES and MODULES[source].endswith("__init__.py") and \
                    alias.name not in _top_level_names(TREES[source]):
                continue  # a submodule we do not track (the compiled extension pcie_allreduce._C)
            else:
                out.add(source)
    out.discard(module)
    return out


GRAPH = {module: {m for m in imported(module) if m in MODULES} for module in MODULES}


def _cycles(nodes: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), within ``nodes``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v] & nodes:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return found


def test_every_package_is_found() -> None:
    for package in PACKAGES:
        assert package in MODULES
    assert "bench.backends" in MODULES and "pcie_allreduce.tools.tune.cli" in MODULES


@pytest.mark.parametrize("package", ["pcie_allreduce", "sglang_plugin", "vllm_plugin"])
def test_the_library_and_the_plugins_never_import_the_harness(package: str) -> None:
    offenders = {m: sorted(i for i in imported(m) if i == "bench" or i.startswith("bench."))
                 for m in MODULES if m == package or m.startswith(package + ".")}
    assert {m: i for m, i in offenders.items() if i} == {}


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package: str) -> None:
    nodes = {m for m in MODULES if m == package or m.startswith(package + ".")}
    assert _cycles(nodes) == []


def test_no_import_cycles_across_packages() -> None:
    assert _cycles(set(MODULES)) == []


MAX_LINES = 500
# Modules already longer than MAX_LINES, with their length today: each may only shrink.
OVER_THE_LIMIT: dict[str, int] = {}


@pytest.mark.parametrize("package", ["pcie_allreduce", "sglang_plugin", "vllm_plugin"])
def test_no_module_grows_past_500_lines(package: str) -> None:
    long = {}
    for module, path in MODULES.items():
        if module == package or module.startswith(package + "."):
            rel = os.path.relpath(path, REPO)
            with open(path, encoding="utf-8") as fh:
                lines = sum(1 for _ in fh)
            if lines > OVER_THE_LIMIT.get(rel, MAX_LINES):
                long[rel] = lines
    assert long == {}, f"modules over {MAX_LINES} lines (or longer than they were): {long}"


MAX_CLASS_LINES = 300
# Classes already longer than MAX_CLASS_LINES, with their length today: each may only shrink.
CLASSES_OVER_THE_LIMIT: dict[str, int] = {}


def _class_lengths(tree: ast.Module, module: str) -> dict[str, int]:
    """Dotted name -> lines (from ``class`` to its last line) of every class in ``tree``, nested ones included."""
    return {f"{module}.{node.name}": node.end_lineno - node.lineno + 1
            for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.end_lineno is not None}


@pytest.mark.parametrize("package", ["pcie_allreduce", "sglang_plugin", "vllm_plugin"])
def test_no_class_grows_past_300_lines(package: str) -> None:
    long = {}
    for module in MODULES:
        if module == package or module.startswith(package + "."):
            for name, lines in _class_lengths(TREES[module], module).items():
                if lines > CLASSES_OVER_THE_LIMIT.get(name, MAX_CLASS_LINES):
                    long[name] = lines
    assert long == {}, f"classes over {MAX_CLASS_LINES} lines (or longer than they were): {long}"


def test_a_long_class_is_found() -> None:
    """The check above can fail: a class of 302 lines is measured as such."""
    source = "class Long:\n" + "    x = 1\n" * 300 + "    y = 2\n"
    assert _class_lengths(ast.parse(source), "m") == {"m.Long": 302}


def test_a_cycle_is_found() -> None:
    GRAPH["bench.table"].add("bench.report")  # report imports table
    try:
        cycles = _cycles({m for m in MODULES if m.startswith("bench")})
        assert any({"bench.report", "bench.table"} <= set(c) for c in cycles)
    finally:
        GRAPH["bench.table"].discard("bench.report")


def test_type_checking_imports_count() -> None:
    """An import under ``if TYPE_CHECKING:`` is an edge of the graph (bench.backends names the
    spawner's RankContext only for its type hints)."""
    assert "pcie_allreduce.tools.ranks" in GRAPH["bench.backends"]


# ---- the serving path and the tools --------------------------------------------------------

TOOLS = "pcie_allreduce.tools"
# The console script's entry (``python -m pcie_allreduce``) is the tools' front door, not serving.
NOT_SERVING = ("pcie_allreduce.__main__",)
SERVING = sorted(m for m in MODULES if m.startswith(("pcie_allreduce", "sglang_plugin", "vllm_plugin"))
                 and not (m == TOOLS or m.startswith(TOOLS + ".")) and m not in NOT_SERVING)
# What a server imports, for the fresh interpreter: the communicators, the plan, the fused kernels,
# the fabric, the plugins' shared core and both engines' plugins as their entry points load them.
SERVED = ("pcie_allreduce", "pcie_allreduce.communicator", "pcie_allreduce.hierarchy", "pcie_allreduce.plan.cache",
          "pcie_allreduce.plan.dispatch", "pcie_allreduce.plan.fused_shapes", "pcie_allreduce.fused.path",
          "pcie_allreduce.fused.rmsnorm", "pcie_allreduce.fused.oneshot_ll", "pcie_allreduce.fused.oneshot_quads",
          "pcie_allreduce.fused.add_rmsnorm", "pcie_allreduce.fabric.topology",
          "pcie_allreduce.fabric.nodes", "pcie_allreduce.plugin_adapter", "pcie_allreduce.plugin_settings",
          "sglang_plugin.plugin", "sglang_plugin.adapter", "vllm_plugin.plugin", "vllm_plugin.adapter")


@pytest.mark.parametrize("module", SERVING)
def test_the_serving_path_never_imports_the_tools(module: str) -> None:
    reached = _reachable(module)
    assert sorted(m for m in reached if m == TOOLS or m.startswith(TOOLS + ".")) == []


def test_the_tools_are_found_where_they_are_imported() -> None:
    """The check above can fail: the same search finds the tools behind the console script."""
    assert "pcie_allreduce.tools.cli" in _reachable("pcie_allreduce.__main__")


def _loaded_after_importing(modules: tuple[str, ...]) -> list[str]:
    """The modules of pcie_allreduce loaded after importing ``modules`` in a fresh interpreter."""
    script = ("import importlib, sys\n"
              f"for name in {modules!r}:\n"
              "    importlib.import_module(name)\n"
              "print(' '.join(sorted(m for m in sys.modules if m.startswith('pcie_allreduce'))))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_a_server_loads_no_tool() -> None:
    """What a server imports (the library, the fused kernels, both plugins) loads no module of
    pcie_allreduce.tools; the list shows what it did load, and that the serving modules are among it."""
    loaded = _loaded_after_importing(SERVED)
    assert "pcie_allreduce.communicator" in loaded and "pcie_allreduce.plan.cache" in loaded
    assert [m for m in loaded if m == TOOLS or m.startswith(TOOLS + ".")] == [], loaded


def test_a_tool_is_seen_when_loaded() -> None:
    """The check above can fail: the console script's front door does load the tools."""
    assert "pcie_allreduce.tools.cli" in _loaded_after_importing(("pcie_allreduce.__main__",))


# Pure modules: choices and launch shapes, importable (and tested) where Triton is not.
TRITON_FREE = ("pcie_allreduce.plan", "pcie_allreduce.plan.fused_shapes")
# The kernel modules: what launches kernels (Triton's and the extension's).
KERNEL_MODULES = ("pcie_allreduce.fused.oneshot_ll", "pcie_allreduce.fused.oneshot_quads", "pcie_allreduce.fused.rmsnorm",
                  "pcie_allreduce.fused.add_rmsnorm", "pcie_allreduce.fused.protocol", "pcie_allreduce.fused.path", "pcie_allreduce.transport",
                  "pcie_allreduce.communicator")


def _reachable(module: str) -> set[str]:
    """Every module ``module`` imports, directly or through modules of PACKAGES (and itself)."""
    seen, todo = {module}, [module]
    while todo:
        for dep in GRAPH[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(TRITON_FREE)))
def test_the_plan_and_the_launch_shapes_import_no_triton_and_no_kernel_module(module: str) -> None:
    reached = _reachable(module)
    offenders = {m: sorted(i for i in imported(m) if i == "triton" or i.startswith("triton.")) for m in reached}
    assert {m: i for m, i in offenders.items() if i} == {}
    assert sorted(reached & set(KERNEL_MODULES)) == []


def test_triton_and_the_kernel_modules_are_found_where_they_are() -> None:
    """The check above can fail: the same search finds Triton where it is imported."""
    assert "triton" in imported("pcie_allreduce.fused.protocol")
    assert "pcie_allreduce.fused.protocol" in _reachable("pcie_allreduce.fused.oneshot_ll")


SMALL_PACKAGES = ("pcie_allreduce.plan", "pcie_allreduce.fabric", "pcie_allreduce.tools")


@pytest.mark.parametrize("package", SMALL_PACKAGES)
def test_the_plan_the_fabric_and_the_tools_stay_small(package: str) -> None:
    assert package in MODULES
    long = {}
    for module, path in MODULES.items():
        if module == package or module.startswith(package + "."):
            with open(path, encoding="utf-8") as fh:
                lines = sum(1 for _ in fh)
            if lines > 400:
                long[module] = lines
    assert long == {}
