"""The import watch: a ``sys.meta_path`` finder that calls back right after each SGLang module
holding a hook target has executed (the import-hook path, and lazy targets on the plugin path).

It knows nothing of what the callback does: the plugin (sglang_plugin.plugin) passes its own.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Callable, Sequence


def watch(on_loaded: Callable[[str], None]) -> None:
    """Put the finder at the front of ``sys.meta_path``: ``on_loaded(name)`` runs right after each
    watched module has executed (idempotent: a finder already there keeps its callback)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(on_loaded))


def unwatch() -> None:
    """Remove the finder."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]


def watched_modules() -> dict[str, list[Any]]:
    """Module name -> the hook targets defined in it."""
    from sglang_plugin.hooks import TARGETS

    modules: dict[str, list[Any]] = {}
    for target in TARGETS:
        modules.setdefault(target.module, []).append(target)
    return modules


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched module it asks the other finders, then wraps the
    loader so the hooks attach right after the module's code has run."""

    def __init__(self, on_loaded: Callable[[str], None]) -> None:
        self._on_loaded = on_loaded

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _WATCHED_NAMES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, self._on_loaded)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, on_loaded: Callable[[str], None]) -> None:
        self._inner = inner
        self._on_loaded = on_loaded

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._on_loaded(module.__name__)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... of the real loader
        return getattr(self._inner, name)


_WATCHED_NAMES: frozenset[str] = frozenset({
    "sglang.srt.distributed.device_communicators.custom_all_reduce",
    "sglang.srt.layers.layer_boundary.residual.add_norm",
    "sglang.srt.layers.flashinfer_comm_fusion",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.distributed.parallel_state",
})  # the modules of hooks.TARGETS (a test keeps the two in step); a constant, never mutated
