"""``python -m sglang_plugin.launch_server <sglang args>``: SGLang's launcher with the plugin on.

Sets ``PCIE_AR_SGLANG_ENABLE=1`` (unless the environment already says otherwise), makes sure an
``SGLANG_PLUGINS`` allow-list, if one is set, names this plugin, checks the settings before
anything starts, then runs ``python -m sglang.launch_server`` with the same arguments. The
scheduler processes SGLang spawns inherit the environment and load the plugin themselves.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Sequence

from sglang_plugin import settings as settings_mod

PLUGINS_ENV = "SGLANG_PLUGINS"


def prepare_environment(environ: "os._Environ[str] | dict[str, str]") -> settings_mod.Settings:
    """Turn the plugin on in ``environ`` (in place) and return the parsed settings.

    Raises:
        SettingsError: a ``PCIE_AR_SGLANG_*`` value is malformed.
    """
    from sglang_plugin.plugin import PLUGIN_NAME

    environ.setdefault(settings_mod.ENABLE, "1")
    listed = environ.get(PLUGINS_ENV, "")
    names = [n.strip() for n in listed.split(",") if n.strip()]
    if names and PLUGIN_NAME not in names:
        environ[PLUGINS_ENV] = ",".join([*names, PLUGIN_NAME])
    return settings_mod.from_env(environ)


def main(argv: Sequence[str] | None = None) -> None:
    """Run SGLang's launcher with the plugin enabled; ``argv`` are SGLang's arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    missing = sglang_missing()
    if missing:
        sys.exit(f"sglang_plugin.launch_server: {missing}")
    try:
        settings = prepare_environment(os.environ)
    except settings_mod.SettingsError as exc:
        sys.exit(f"sglang_plugin.launch_server: {exc}")
    if not settings.enabled:
        print(f"sglang_plugin.launch_server: {settings_mod.ENABLE}=0 in the environment; starting SGLang "
              "without the plugin", file=sys.stderr)
    elif not _attaches(settings):
        sys.exit("sglang_plugin.launch_server: this SGLang has no plugin framework (sglang.srt.plugins) and the "
                 "import hook is not installed; run `python -m sglang_plugin.import_hook install` once")
    sys.argv = ["sglang.launch_server", *args]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


def sglang_missing() -> str | None:
    """Why SGLang's launcher cannot start here (SGLang not installed), or None."""
    import importlib.util

    from sglang_plugin import surface

    if importlib.util.find_spec("sglang") is not None:
        return None
    tested = ", ".join(surface.SUPPORTED_SGLANG_VERSIONS)
    return (f"SGLang is not installed in this Python ({sys.executable}); this plugin is tested with SGLang {tested}: "
            f"pip install 'sglang=={surface.SUPPORTED_SGLANG_VERSIONS[-1]}'")


def _attaches(settings: settings_mod.Settings) -> bool:
    """Whether the hooks will reach SGLang's processes with these settings."""
    from sglang_plugin import import_hook, plugin

    if settings.attach != "import" and plugin.plugin_framework_present():
        return True
    return os.path.exists(import_hook.pth_path())


if __name__ == "__main__":
    main()
