"""Attach the hooks without SGLang's plugin framework: an env-gated import hook.

SGLang starts its scheduler processes with ``spawn``, so patching the launcher alone never
reaches the processes that run the model. A ``.pth`` file in site-packages runs one line at
every interpreter start; that line does nothing unless ``PCIE_AR_SGLANG_ENABLE=1`` and otherwise
adds a ``sys.meta_path`` finder that wraps each hook target right after its SGLang module has
executed. Install or remove the ``.pth`` with::

    python -m sglang_plugin.import_hook install     # or: uninstall, status

With ``PCIE_AR_SGLANG_ATTACH=auto`` (the default) the finder stands down where SGLang has its
plugin framework and the entry point is installed, so the two paths never both attach.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import logging
import os
import sys
import sysconfig
from types import ModuleType
from typing import Any, Sequence

logger = logging.getLogger("sglang_plugin")

PTH_NAME = "sglang_plugin_import_hook.pth"
# One line, executed by site.py at every interpreter start: cheap when the plugin is off.
PTH_LINE = ("import os; os.environ.get('PCIE_AR_SGLANG_ENABLE', '0').strip().lower() in "
            "('1', 'true', 'yes', 'on') and __import__('sglang_plugin.import_hook').import_hook.activate()\n")


def activate() -> None:
    """Called by the ``.pth`` line when the plugin is enabled: start watching SGLang's imports."""
    watch()


def watch() -> None:
    """Put the finder at the front of ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


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
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        on_module_loaded(module.__name__)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... of the real loader
        return getattr(self._inner, name)


def on_module_loaded(name: str) -> None:
    """Attach the hooks defined in module ``name`` (it has just executed)."""
    from sglang_plugin import plugin
    from sglang_plugin.registry import REGISTRY
    from sglang_plugin.settings import from_env

    state = REGISTRY.state
    if state is None:
        settings = from_env(os.environ)
        if not settings.enabled or settings.attach == "plugin" or (
                settings.attach == "auto" and plugin_framework_present()):
            return
        state = plugin.install(settings, attach="import")
    for target in watched_modules().get(name, []):
        if target.fused and not state.settings.fused:
            continue
        if state.attach == "import" or target.lazy:  # SGLang's HookRegistry attaches the others
            plugin.attach_target(state, target)


def plugin_framework_present() -> bool:
    """SGLang has ``sglang.srt.plugins`` and our entry point is installed: the plugin path runs."""
    import importlib.util
    from importlib.metadata import entry_points

    from sglang_plugin.plugin import ENTRY_POINT_GROUP, PLUGIN_NAME

    if importlib.util.find_spec("sglang.srt.plugins") is None:
        return False
    return any(ep.name == PLUGIN_NAME for ep in entry_points(group=ENTRY_POINT_GROUP))


_WATCHED_NAMES: frozenset[str] = frozenset({
    "sglang.srt.distributed.device_communicators.custom_all_reduce",
    "sglang.srt.layers.layer_boundary.residual.add_norm",
    "sglang.srt.layers.flashinfer_comm_fusion",
    "sglang.srt.model_executor.model_runner",
})  # the modules of hooks.TARGETS (a test keeps the two in step); a constant, never mutated


def pth_path(site_dir: str | None = None) -> str:
    """Where the ``.pth`` goes: this interpreter's purelib site-packages (or ``site_dir``)."""
    return os.path.join(site_dir or sysconfig.get_paths()["purelib"], PTH_NAME)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sglang_plugin.import_hook {install,uninstall,status} [--site-dir DIR]``."""
    parser = argparse.ArgumentParser(prog="python -m sglang_plugin.import_hook", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("install", "uninstall", "status"))
    parser.add_argument("--site-dir", help="site-packages directory (default: this interpreter's)")
    args = parser.parse_args(argv)
    path = pth_path(args.site_dir)
    if args.action == "install":
        with open(path, "w", encoding="utf-8") as f:
            f.write(PTH_LINE)
        print(f"wrote {path}; it acts only when PCIE_AR_SGLANG_ENABLE=1")
    elif args.action == "uninstall":
        if os.path.exists(path):
            os.remove(path)
            print(f"removed {path}")
        else:
            print(f"not installed ({path} does not exist)")
    else:
        print(f"{'installed' if os.path.exists(path) else 'not installed'}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
