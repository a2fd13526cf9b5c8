"""Print, as `uv pip install` flags, where this machine's pip configuration says packages come from.

    uv pip install $(python infra/uv_pip_args.py) -r requirements-ci.txt ...

`make install` installs with uv (a fresh clone's install: ~22 s against pip's ~81 s on the 2-core machine),
but uv reads none of pip's configuration (pip.conf files, PIP_* variables). A machine whose pip is set up
to take local wheels (`find-links`, extra indexes: where the local CPU build of torch lies) or a constraints
file would otherwise get other files from uv than from pip. Each setting pip reports (`pip config list`,
files and environment alike) becomes the flag uv spells the same way; several indexes are weighed as pip
weighs them (`--index-strategy unsafe-best-match`: the best version on any index, not the first index's).
Run by the interpreter of the venv being installed, so its pip reads the configuration.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

# pip's setting -> uv's flag; pip lists each as `<section>.<name>='value'` (section global, install, :env:)
FLAGS = {"find-links": "--find-links", "extra-index-url": "--extra-index-url", "index-url": "--index-url",
         "constraint": "--constraint"}


def pip_settings() -> dict[str, list[str]]:
    """Every value pip's configuration gives each setting in FLAGS (values are space-separated lists)."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    settings: dict[str, list[str]] = {}
    for line in listed.stdout.splitlines():
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if name in FLAGS:
            for item in shlex.split(value.strip("'\"")):
                if item not in settings.setdefault(name, []):
                    settings[name].append(item)
    return settings


def uv_flags(settings: dict[str, list[str]]) -> list[str]:
    flags = [part for name, values in settings.items() for value in values for part in (FLAGS[name], value)]
    if settings.get("extra-index-url") or settings.get("find-links"):
        flags += ["--index-strategy", "unsafe-best-match"]
    return flags


if __name__ == "__main__":
    print(shlex.join(uv_flags(pip_settings())))
