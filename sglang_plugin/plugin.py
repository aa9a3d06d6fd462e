"""Registration with SGLang: the entry point, and the matching unregister.

SGLang (0.5.23+) calls :func:`register` from ``load_plugins()`` in every process it starts (the
launcher and each scheduler), for every entry point of the group ``sglang.srt.plugins`` (or
only those named in ``SGLANG_PLUGINS``), then applies the hooks registered with its
``HookRegistry``. The plugin stays inert unless ``PCIE_AR_SGLANG_ENABLE=1``.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable

from sglang_plugin import import_watch, patching, settings as settings_mod, surface
from sglang_plugin.hooks import TARGETS, HookTarget
from sglang_plugin.registry import REGISTRY, PluginState
from sglang_plugin.settings import Settings

logger = logging.getLogger("sglang_plugin")

PLUGIN_NAME = "pcie_allreduce"
ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT = "sglang_plugin.plugin:register"


def register() -> None:
    """Entry point of group ``sglang.srt.plugins``: install the hooks when enabled.

    Raises:
        SettingsError: a ``PCIE_AR_SGLANG_*`` variable is malformed (SGLang logs it; nothing is hooked).
        RuntimeError: SGLang no longer has the function the plugin must hook (version mismatch).
    """
    settings = settings_mod.from_env(os.environ)
    if not settings.enabled:
        logger.debug("pcie_allreduce[sglang]: installed but off (%s=1 turns it on)", settings_mod.ENABLE)
        return
    if settings.attach == "import":
        logger.info("pcie_allreduce[sglang]: %s=import, the import hook attaches instead", settings_mod.ATTACH)
        return
    install(settings, attach="plugin")


def install(settings: Settings, *, attach: str, apply: bool = False,
            communicator_factory: Callable[..., Any] | None = None,
            facts_fn: Callable[..., Any] | None = None) -> PluginState:
    """Install the hooks once per process; returns the (possibly existing) state.

    Args:
        settings: parsed settings (``enabled`` is not consulted here).
        attach: "plugin" registers AROUND hooks with SGLang's HookRegistry (applied by
            ``load_plugins()``, or now with ``apply=True``); "import" wraps the targets of
            modules already imported and leaves the rest to the import hook.
        communicator_factory, facts_fn: test seams, see :class:`~sglang_plugin.registry.PluginState`.
    """
    if REGISTRY.state is not None:
        return REGISTRY.state
    _warn_if_unsupported_version()
    state = PluginState(settings=settings, attach=attach, communicator_factory=communicator_factory,
                        facts_fn=facts_fn)
    REGISTRY.set(state)
    try:
        for target in TARGETS:
            if target.fused and not settings.fused:
                continue
            if attach == "plugin" and not target.lazy:
                _register_with_hook_registry(state, target)
            elif target.module in sys.modules:
                attach_target(state, target)
        if attach == "import" or any(t.lazy and t.target not in state.targets for t in TARGETS):
            import_watch.watch(on_module_loaded)  # attaches the rest as their modules are imported
        if attach == "plugin" and apply:
            from sglang.srt.plugins.hook_registry import HookRegistry

            HookRegistry.apply_hooks()
    except BaseException:
        unregister()
        raise
    return state


def attach_target(state: PluginState, target: HookTarget) -> bool:
    """Wrap one target ourselves (import-hook path); False, with a log line, if it does not fit."""
    if target.target in state.targets:
        return True
    hook, problem = surface.fitting_hook(target.target, target.hooks)
    if hook is None:
        _report_problem(target, problem or "no hook fits")
        return False
    state.targets[target.target] = patching.attach(target.target, hook)
    return True


def unregister() -> bool:
    """Remove every hook this process installed and forget the settings; False if none were.

    Adapters already serving a ``GroupCoordinator`` stay (closing them is collective; SGLang's
    group teardown drops them); groups created afterwards get SGLang's own communicator.
    """
    state = REGISTRY.set(None)
    if state is None:
        return False
    ours = {hook for t in TARGETS for hook in t.hooks}
    reapply = False
    for target, patch in state.targets.items():
        if patch is not None and patch.wrapped is not None:  # attached by us (import hook, lazy targets)
            patching.detach(patch)
        elif state.attach == "plugin":
            reapply |= _forget_in_hook_registry(target, patch, ours)
    if reapply:
        from sglang.srt.plugins.hook_registry import HookRegistry

        HookRegistry.apply_hooks()  # other plugins' hooks on the same targets, on the originals
    import_watch.unwatch()
    return True


# ---- the import-hook path --------------------------------------------------------------------


def on_module_loaded(name: str) -> None:
    """Attach the hooks defined in module ``name`` (it has just executed)."""
    state = REGISTRY.state
    if state is None:
        settings = settings_mod.from_env(os.environ)
        if not settings.enabled or settings.attach == "plugin" or (
                settings.attach == "auto" and plugin_framework_present()):
            return
        state = install(settings, attach="import")
    for target in import_watch.watched_modules().get(name, []):
        if target.fused and not state.settings.fused:
            continue
        if state.attach == "import" or target.lazy:  # SGLang's HookRegistry attaches the others
            attach_target(state, target)


def plugin_framework_present() -> bool:
    """SGLang has ``sglang.srt.plugins`` and our entry point is installed: the plugin path runs."""
    import importlib.util
    from importlib.metadata import entry_points

    if importlib.util.find_spec("sglang.srt.plugins") is None:
        return False
    return any(ep.name == PLUGIN_NAME for ep in entry_points(group=ENTRY_POINT_GROUP))


# ---- HookRegistry bookkeeping ---------------------------------------------------------------


def _register_with_hook_registry(state: PluginState, target: HookTarget) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hook, problem = surface.fitting_hook(target.target, target.hooks)
    if hook is None:
        _report_problem(target, problem or "no hook fits")
        return
    owner, attr, current = patching.resolve(target.target)
    HookRegistry.register(target.target, hook, HookType.AROUND)
    # Remember what was there before HookRegistry wraps it, for unregister().
    state.targets[target.target] = patching.Patch(target.target, owner, attr, current, None)


def _forget_in_hook_registry(target: str, patch: patching.Patch | None, ours: set[Any]) -> bool:
    """Drop our entries for ``target``; restore its original if HookRegistry had applied them.
    Returns True when other hooks remain on it (they must be re-applied)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    remaining = [entry for entry in HookRegistry._hooks.get(target, []) if entry[1] not in ours]
    if remaining:
        HookRegistry._hooks[target] = remaining
    else:
        HookRegistry._hooks.pop(target, None)
    if target in HookRegistry._patched and patch is not None:
        current = getattr(patch.owner, patch.attr)
        patching.detach(patching.Patch(target, patch.owner, patch.attr, patch.original, current))
        HookRegistry._patched.discard(target)
    return bool(remaining)


def _report_problem(target: HookTarget, problem: str) -> None:
    if target.lazy:
        logger.warning("pcie_allreduce[sglang]: %s is not hooked (%s): a failed collective inside a CUDA graph "
                       "surfaces at the next eager collective instead of at the next forward step", target.target,
                       problem)
        return
    if not target.fused:
        raise RuntimeError(f"pcie_allreduce[sglang]: this SGLang does not fit the plugin: {problem}. "
                           f"Supported SGLang versions: {', '.join(surface.SUPPORTED_SGLANG_VERSIONS)}")
    logger.warning("pcie_allreduce[sglang]: fused path stays SGLang's: %s", problem)


def _warn_if_unsupported_version() -> None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("sglang")
    except PackageNotFoundError:
        return
    if found not in surface.SUPPORTED_SGLANG_VERSIONS:
        logger.warning("pcie_allreduce[sglang]: SGLang %s is not a tested version (%s); the hook targets are "
                       "checked, but behaviour is only verified on the tested ones", found,
                       ", ".join(surface.SUPPORTED_SGLANG_VERSIONS))
