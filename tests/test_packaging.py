"""One import namespace: everything installs and imports as ``kvguard.*``.

The folders stay at the top of the repository (``sidecar/``, ``engine_hooks/``,
``demo/``) and are mapped in pyproject.toml. A top-level ``sidecar`` would collide
with another project on PyPI and, from a checkout, load a second copy of every module;
the demo, its test models and the CPU shims stay out of the engine image's wheel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from conftest import REPO_ROOT

MAPPED = {
    "kvguard": "kvguard",
    "kvguard.engine_hooks": "engine_hooks",
    "kvguard.sidecar": "sidecar",
    "kvguard.dashboards": "dashboards/generated",  # the generated JSON, package data
}


def _packages_on_disk(prefix: str, folder: Path) -> set[str]:
    return {
        ".".join([prefix, *p.parent.relative_to(folder).parts])
        for p in folder.rglob("__init__.py")
        if "__pycache__" not in p.parts
    }


def test_pyproject_lists_every_package_folder():
    cfg = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"] == MAPPED
    on_disk = set().union(
        *(_packages_on_disk(name, REPO_ROOT / folder) for name, folder in MAPPED.items() if name != "kvguard"),
        {"kvguard"},
    )
    assert set(cfg["packages"]) == on_disk
    demo = tomllib.loads((REPO_ROOT / "demo" / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert demo["packages"] == ["kvguard.demo"] and demo["package-dir"] == {"kvguard.demo": "."}


def test_wheel_holds_only_the_kvguard_namespace(kvguard_wheel):
    with zipfile.ZipFile(kvguard_wheel) as z:
        names = z.namelist()
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"kvguard", "kvguard-0.1.0.dist-info"}, tops
    assert "kvguard/sidecar/cli.py" in names and "kvguard/engine_hooks/sglang/plugin.py" in names
    assert "kvguard/engine_hooks/native/head_streams.c" in names  # package data: the digest routine's source
    assert "kvguard/dashboards/kvguard-integrity.json" in names  # package data: `kvguard dashboards push`
    # the demo, its models and the CPU shims are kvguard-demo's, never the engine image's
    assert not [n for n in names if n.startswith("kvguard/demo/") or "cpu_compat" in n or "sitecustomize" in n]
    assert "kvguard = kvguard.sidecar.cli:main" in entry_points
    assert "[sglang.srt.plugins]\nkvguard = kvguard.engine_hooks.sglang.plugin:load" in entry_points


def _venv_python(code: str, cwd: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, env={**os.environ, **env}, timeout=120
    )


@pytest.mark.parametrize("cwd", [REPO_ROOT, Path("/")], ids=["checkout", "elsewhere"])
def test_top_level_names_do_not_import(cwd):
    for name in ("sidecar", "engine_hooks", "demo"):
        got = _venv_python(f"import {name}", cwd)
        assert got.returncode != 0, f"import {name} worked from {cwd}"
        assert "Error" in got.stderr
    ok = _venv_python(
        "import kvguard.sidecar, kvguard.engine_hooks, kvguard.demo, kvguard.sidecar.cli; print('ok')", cwd
    )
    assert ok.returncode == 0 and ok.stdout.strip() == "ok", ok.stderr


def test_installed_wheel_runs_without_the_demo(kvguard_wheel, tmp_path):
    """The wheel alone (no editable finders: ``python -S``): the sidecar's CLI works and
    ``kvguard demo`` says which package it needs."""
    with zipfile.ZipFile(kvguard_wheel) as z:
        z.extractall(tmp_path / "site")
    import sysconfig

    path = os.pathsep.join([str(tmp_path / "site"), sysconfig.get_paths()["purelib"]])

    def wheel_python(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-S", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": path},
            timeout=120,
        )

    where = wheel_python("-c", "import kvguard.sidecar.cli as c; print(c.__file__)")
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(tmp_path / "site"))
    helped = wheel_python("-m", "kvguard.sidecar.cli", "--help")
    assert helped.returncode == 0 and "sidecar" in helped.stdout, helped.stderr
    demo = wheel_python("-m", "kvguard.sidecar.cli", "demo")
    assert demo.returncode == 1 and "kvguard-demo" in demo.stderr, demo.stderr
    # the dashboards are in the wheel: push finds them with no checkout
    listed = wheel_python("-m", "kvguard.sidecar.cli", "dashboards", "push", "--dry-run")
    assert listed.returncode == 0, listed.stderr
    assert f"would upload 2 dashboard(s) from {tmp_path / 'site'}" in listed.stdout
    assert "(uid kvguard-integrity)" in listed.stdout and "(uid kvguard-pages)" in listed.stdout


# SGLang's own loader finding the entry point: tests/test_sglang_adapter.py test_real_targets_resolve
