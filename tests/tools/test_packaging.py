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

from tests.conftest import REPO_ROOT

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


def _linked_dependencies(tmp_path: Path) -> Path:
    """A directory of links to this venv's installed distributions, kvguard's own left out
    (and the editable finders): the packages kvguard[sidecar] depends on, as pip will see them."""
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    deps = tmp_path / "deps"
    deps.mkdir()
    for entry in site.iterdir():
        if entry.name.startswith(("kvguard", "__editable__")) or entry.suffix == ".pth":
            continue
        (deps / entry.name).symlink_to(entry)
    return deps


def test_pip_installs_the_wheel_into_an_empty_venv_and_it_runs_without_a_checkout(kvguard_wheel, tmp_path):
    """`pip install kvguard-*.whl[sidecar]` into a new, empty venv, offline: pip resolves the
    [sidecar] extra and writes the `kvguard` console script; run from elsewhere, it finds its
    dashboards (package data) with no checkout, and `kvguard demo` names the package it needs.

    Offline means pip must find every dependency without an index: the venv gets one .pth
    line to a directory of links to this venv's installed distributions (kvguard's own left
    out), which pip counts as installed; with --no-index it installs the wheel alone from
    --find-links and fails if the extra names anything missing or at a conflicting version.
    The machine's local mirror holds older releases than requirements-sidecar.txt pins, so
    it cannot stand in for PyPI here."""
    venv = tmp_path / "venv"
    made = subprocess.run(
        [sys._base_executable, "-m", "venv", "--without-pip", str(venv)], capture_output=True, text=True, timeout=60
    )
    assert made.returncode == 0, made.stderr
    py = venv / "bin" / "python"
    purelib = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    (Path(purelib) / "kvguard-test-deps.pth").write_text(f"{_linked_dependencies(tmp_path)}\n")
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    spec = f"kvguard[sidecar] @ {kvguard_wheel.as_uri()}"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-index", spec],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert "Successfully installed kvguard-0.1.0" in installed.stdout, installed.stdout
    kvguard = venv / "bin" / "kvguard"  # the console script pip wrote from the entry point

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([kvguard, *args], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)

    where = subprocess.run(
        [py, "-c", "import kvguard.sidecar.cli as c; print(c.__file__)"], cwd=tmp_path, capture_output=True, text=True
    )
    assert where.stdout.strip().startswith(purelib), where.stdout + where.stderr
    helped = run("--help")
    assert helped.returncode == 0 and "sidecar" in helped.stdout, helped.stderr
    demo = run("demo")
    assert demo.returncode == 1 and "kvguard-demo" in demo.stderr, demo.stderr
    # the dashboards are in the wheel: push finds them with no checkout
    listed = run("dashboards", "push", "--dry-run")
    assert listed.returncode == 0, listed.stderr
    assert f"would upload 3 dashboard(s) from {purelib}/kvguard/dashboards" in listed.stdout, listed.stdout
    for uid in ("kvguard-fleet", "kvguard-integrity", "kvguard-pages"):
        assert f"(uid {uid})" in listed.stdout, listed.stdout


# SGLang's own loader finding the entry point: tests/engine_side/test_sglang_adapter.py test_real_targets_resolve
