"""The one piece of process-wide state: what the plugin installed in this process.

SGLang calls our hooks as plain functions (HookRegistry or the import hook put them in place of
SGLang's own), so they cannot be handed an object; they read :data:`REGISTRY` instead. It is
written by :func:`sglang_plugin.plugin.install` / ``unregister`` and by nothing else, and holds
no per-call state: the settings, the patches to undo, the adapters created (weakly, for the
fused-path gate and for logging), and two seams tests use to run SGLang's real
``GroupCoordinator`` on a CPU (a stand-in for *our* communicator and for the GPU facts).
"""

from __future__ import annotations

import dataclasses
import threading

from pcie_allreduce import plugin_adapter
from sglang_plugin.patching import Patch


@dataclasses.dataclass(kw_only=True)
class PluginState(plugin_adapter.PluginState):
    """What :func:`sglang_plugin.plugin.install` set up: the shared state, and how the hooks were
    attached.

    Attributes:
        attach: "plugin" (SGLang's HookRegistry applied the hooks) or "import" (we did).
        targets: dotted targets hooked, with the patch to undo (filled when applied).
    """

    attach: str
    targets: dict[str, Patch | None] = dataclasses.field(default_factory=dict)


class Registry:
    """Holder of the current :class:`PluginState` (None: the plugin is not installed)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: PluginState | None = None

    @property
    def state(self) -> PluginState | None:
        """The installed state, or None."""
        return self._state

    def set(self, state: PluginState | None) -> PluginState | None:
        """Replace the state; returns the previous one."""
        with self._lock:
            previous, self._state = self._state, state
            return previous

    def serving(self) -> bool:
        """True when at least one adapter in this process is serving."""
        state = self._state
        return state is not None and any(not a.disabled for a in list(state.adapters))


REGISTRY = Registry()
"""Process-wide registry read by the hooks (see the module docstring for why it exists)."""
