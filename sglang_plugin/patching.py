"""Attach and detach AROUND hooks on dotted targets, the way SGLang's HookRegistry does.

Used directly by the import hook (SGLang versions without a plugin framework) and by
:func:`sglang_plugin.plugin.unregister` to put originals back. A hook has the signature
``hook(original, *args, **kwargs)``, which is HookRegistry's AROUND form.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import sys
import types
from typing import Any, Callable

AroundHook = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class Patch:
    """One attached hook: ``owner.attr`` was ``original`` and is now ``wrapped``."""

    target: str
    owner: Any
    attr: str
    original: Any
    wrapped: Any


def resolve(target: str) -> tuple[Any, str, Any]:
    """``(owner, attr, current value)`` for ``"pkg.module.Class.attr"`` (imports the module).

    Unlike ``pkgutil.resolve_name``, an import that fails inside the module raises its own
    ImportError (naming the missing package) instead of an AttributeError on the parent.
    """
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:cut])
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # ``name`` is an attribute of a module, not a module: go up
                continue
            raise
        if spec is None:
            continue
        owner: Any = importlib.import_module(name)
        for attr in parts[cut:-1]:
            owner = getattr(owner, attr)
        return owner, parts[-1], getattr(owner, parts[-1])
    raise ModuleNotFoundError(f"no module in {target!r}", name=parts[0])


def around(original: Callable[..., Any], hook: AroundHook) -> Callable[..., Any]:
    """``hook(original, ...)`` dressed as ``original`` (name, docstring, ``__wrapped__``)."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return hook(original, *args, **kwargs)

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def attach(target: str, hook: AroundHook) -> Patch:
    """Wrap ``target`` with ``hook``; rebinds stale ``from module import name`` copies too."""
    owner, attr, original = resolve(target)
    wrapped = around(original, hook)
    setattr(owner, attr, wrapped)
    rebind(original, wrapped, skip=owner)
    return Patch(target, owner, attr, original, wrapped)


def detach(patch: Patch) -> None:
    """Undo :func:`attach` (or HookRegistry's wrapping recorded as a Patch), rebinding copies."""
    current = getattr(patch.owner, patch.attr)
    setattr(patch.owner, patch.attr, patch.original)
    rebind(current, patch.original, skip=patch.owner)
    if current is not patch.wrapped:
        rebind(patch.wrapped, patch.original, skip=patch.owner)


def rebind(old: Any, new: Any, *, skip: Any = None) -> int:
    """Point every module attribute that is ``old`` at ``new``; returns how many were changed.

    ``from m import f`` copies the reference at import time, so patching ``m.f`` alone would
    leave importers calling the original (HookRegistry handles this the same way).
    """
    changed = 0
    for module in list(sys.modules.values()):
        if module is skip or not isinstance(module, types.ModuleType):
            continue
        try:
            items = list(vars(module).items())
        except TypeError:
            continue
        for name, value in items:
            if value is old:
                try:
                    setattr(module, name, new)
                    changed += 1
                except (AttributeError, TypeError):
                    pass
    return changed
