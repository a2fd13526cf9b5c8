"""`make install` hands uv where pip would take packages from (infra/uv_pip_args.py): read through pip's own
`pip config list`, from a config file and the environment, as a machine whose pip takes local wheels has them."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def uv_args(tmp_path: Path, pip_conf: str, **env: str) -> list[str]:
    (tmp_path / "pip.conf").write_text(pip_conf)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    # only this test's configuration: no user or machine-wide pip.conf
    clean |= {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "XDG_CONFIG_DIRS": str(tmp_path / "xdg"),
              "PIP_CONFIG_FILE": str(tmp_path / "pip.conf")} | env
    out = subprocess.run([sys.executable, str(REPO / "infra" / "uv_pip_args.py")], env=clean, capture_output=True,
                         text=True, check=True)
    return shlex.split(out.stdout)


def pairs(args: list[str]) -> list[tuple[str, str]]:
    return list(zip(args[::2], args[1::2], strict=True))


def test_find_links_indexes_and_constraints_reach_uv_as_its_own_flags(tmp_path):
    conf = ("[global]\nextra-index-url = file:///opt/a/simple file:///opt/b/simple\n"
            "constraint = /etc/caps.txt\n[install]\nfind-links = /opt/wheels\n")
    got = pairs(uv_args(tmp_path, conf, PIP_FIND_LINKS="/srv/more wheels"))
    assert ("--extra-index-url", "file:///opt/a/simple") in got and ("--extra-index-url", "file:///opt/b/simple") in got
    assert ("--constraint", "/etc/caps.txt") in got
    assert ("--find-links", "/opt/wheels") in got  # from the file's [install] section
    assert ("--find-links", "/srv/more") in got and ("--find-links", "wheels") in got  # pip splits the variable too
    assert got[-1] == ("--index-strategy", "unsafe-best-match")  # pip's rule: the best version on any index
    assert len([p for p in got if p == ("--find-links", "/opt/wheels")]) == 1


def test_a_plain_pip_gives_uv_nothing_to_change(tmp_path):
    assert uv_args(tmp_path, "[global]\ntimeout = 30\n") == []
