"""Reading an engine's installed source without importing it: the signatures the plugins rely on.

Some engine modules cannot be imported on every machine (SGLang's model layers need
transformers/torchvision; parts of vLLM need its compiled kernels). Each plugin's ``surface``
module checks the callables it relies on; where the module does not import, it reads the
parameters from the engine's installed source file with ``ast`` through :func:`source_parameters`.
"""

from __future__ import annotations

import ast
import importlib.util
import os


def package_root(package: str) -> str:
    """Directory of the installed top-level ``package`` (found without importing it)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"{package} is not installed", name=package)
    return list(spec.submodule_search_locations)[0]


def source_parameters(path: str) -> tuple[str, ...]:
    """Parameters of the function or method at dotted ``path`` (``vllm.a.b.Class.method``) read
    from the installed source of its top-level package with ``ast``.

    Walks ``<package>/<...>/module.py`` from the left until the rest names a function or a
    class's method; never imports the module. Raises LookupError when the definition is not
    there, ModuleNotFoundError when the package is not installed.
    """
    parts = path.split(".")
    root = os.path.dirname(package_root(parts[0]))
    for cut in range(len(parts) - 1, 0, -1):
        candidate = os.path.join(root, *parts[:cut]) + ".py"
        if os.path.isfile(candidate):
            return _find_def(candidate, parts[cut:], path)
    raise LookupError(f"no source file for {path} under {root}")


def _find_def(filename: str, names: list[str], path: str) -> tuple[str, ...]:
    with open(filename, encoding="utf-8") as f:
        body: list[ast.stmt] = ast.parse(f.read(), filename).body
    for i, name in enumerate(names):
        last = i == len(names) - 1
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef) if last else (ast.ClassDef,)
        found = [n for n in body if isinstance(n, kinds) and n.name == name]
        if not found:
            raise LookupError(f"{path}: no {'def' if last else 'class'} {name} in {filename}")
        node = found[-1]
        if last:
            args = node.args  # type: ignore[union-attr]
            return tuple(a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs))
        body = node.body  # type: ignore[union-attr]
    raise LookupError(path)
