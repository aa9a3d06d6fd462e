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
import logging
import os
import sys
import sysconfig
from typing import Sequence

from sglang_plugin import import_watch

logger = logging.getLogger("sglang_plugin")

PTH_NAME = "sglang_plugin_import_hook.pth"
# One line, executed by site.py at every interpreter start: cheap when the plugin is off.
PTH_LINE = ("import os; os.environ.get('PCIE_AR_SGLANG_ENABLE', '0').strip().lower() in "
            "('1', 'true', 'yes', 'on') and __import__('sglang_plugin.import_hook').import_hook.activate()\n")


def activate() -> None:
    """Called by the ``.pth`` line when the plugin is enabled: start watching SGLang's imports
    (cheap: the plugin itself is imported only when a watched module loads)."""
    import_watch.watch(on_module_loaded)


def on_module_loaded(name: str) -> None:
    """What the finder runs after module ``name`` executed: the plugin attaches its hooks."""
    from sglang_plugin import plugin

    plugin.on_module_loaded(name)




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
