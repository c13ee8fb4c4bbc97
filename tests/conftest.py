"""Shared fixtures.

Engine tests (``@pytest.mark.engine``) run real SGLang HTTP servers on CPU
(demo/engines.py). They need the per-version SGLang folders that
``make venv`` installs under ``.venv/sglang/<version>``; without them they are
*skipped with the reason*, never passed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def sglang_missing_reason(version: str) -> str | None:
    """Why SGLang ``version`` cannot run here, or None when it can."""
    d = REPO_ROOT / ".venv" / "sglang" / version
    if not (d / "sglang").is_dir():
        return f"SGLang {version} is not installed at {d} (run `make venv`)"
    return None


def skip_unless_sglang(*versions: str) -> None:
    """Skip the calling test, naming what is missing, unless every version is installed."""
    for v in versions:
        reason = sglang_missing_reason(v)
        if reason:
            pytest.skip(reason)


@pytest.fixture(autouse=True)
def findings_are_listed(monkeypatch):
    """Every finding the pipeline emits, in any test, must be a (kind, severity) that
    sidecar/finding_kinds.py lists for that pipeline's configuration: /metrics exports
    those at 0, so a missing entry would leave a dashboard with "no data"."""
    from kvguard.sidecar import finding_kinds
    from kvguard.sidecar.pipeline import Pipeline

    unlisted = []
    init = Pipeline.__init__

    def checked_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        emit = self.out.emit  # every component files its findings through the pipeline's outlet

        def checked_emit(findings):
            unlisted.extend((f.kind, f.severity) for f in findings if finding_kinds.unlisted(self, f))
            return emit(findings)

        self.out.emit = checked_emit

    monkeypatch.setattr(Pipeline, "__init__", checked_init)
    yield
    assert not unlisted, f"findings missing from sidecar/finding_kinds.py (or raised while switched off): {unlisted}"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny dummy-weight GPT-2 (context 2048) for SGLang, written once per session."""
    from kvguard.demo.model import write_tiny_gpt2

    return write_tiny_gpt2(tmp_path_factory.mktemp("models") / "tiny-gpt2-2048", n_positions=2048)


@pytest.fixture(scope="session")
def require_sglang():
    """``require_sglang("0.5.23")`` inside a test: skip (with the reason) unless installed."""
    return skip_unless_sglang


@pytest.fixture(scope="session")
def kvguard_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel an image build makes (``pip wheel --no-deps .``), built once per session
    from this checkout with the venv's setuptools (no network)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(REPO_ROOT),
        ],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = out.glob("kvguard-*.whl")
    return wheel


# ---------------------------------------------------------------- the shared 0.5.23 pair
SHARED_PD = "shared_pd"
_shared_pds: list = []  # the session's SharedPD, once started (stopped by the teardown hook below)


@pytest.fixture(scope="session")
def shared_pd(tmp_path_factory: pytest.TempPathFactory):
    """One SGLang 0.5.23 prefill/decode pair behind SGLang's router, watched by one sidecar,
    for the tests that need a healthy fixed pair (tests/support/shared_pd.py)."""
    skip_unless_sglang("0.5.23")
    from tests.support.shared_pd import SharedPD

    shared = SharedPD(tmp_path_factory.mktemp("shared-pd"))
    _shared_pds.append(shared)
    yield shared
    shared.stop()


# ---------------------------------------------------------------- two workers for the engine tier
# `make test` runs the engine tier on two pytest-xdist workers. Each worker is its own pytest
# session, so tests that share an engine (a session-, module- or class-scoped fixture) must run
# in one worker, or the engine starts twice. pytest-xdist's `--dist loadgroup` would do it from
# marks, but it renames items (`item._nodeid`), which pytest 9.2 no longer honours; so the
# scheduler below groups by node id alone (the controller sees nothing else).
SHARED_PD_MODULES = (  # every module with a test that takes the `shared_pd` fixture (checked below)
    "tests/integration/test_canary_engine.py",
    "tests/integration/test_incident_engine.py",
    "tests/integration/test_router_engine.py",
    "tests/tools/test_preflight_router.py",
)
# modules whose module-scoped engines are independent of each other: one group per test-name prefix
SPLIT_BY_PREFIX = {"tests/integration/test_soak_engine.py": ("test_unified_soak", "test_pd_soak")}
# modules with one engine process per SGLang version: one group per version in the test id
# (the value: the version of the tests that take none)
SPLIT_BY_VERSION = {"tests/integration/test_sglang_adapter_engine.py": "0.5.23"}


def engine_scope(nodeid: str) -> str:
    """The work unit a test goes to a worker in: the shared pair's modules together; a soak run;
    the adapter's engines of one SGLang version; a test class (class-scoped engines); else its
    module (module-scoped engines)."""
    module, _, rest = nodeid.partition("::")
    if module in SHARED_PD_MODULES:
        return SHARED_PD
    for prefix in SPLIT_BY_PREFIX.get(module, ()):
        if rest.startswith(prefix):
            return f"{module}::{prefix}"
    if module in SPLIT_BY_VERSION:
        version = re.search(r"\[(\d+\.\d+\.\d+)\]", rest)
        return f"{module}::{version.group(1) if version else SPLIT_BY_VERSION[module]}"
    cls, sep, _ = rest.partition("::")
    return f"{module}::{cls}" if sep and cls[:1].isupper() else module


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class EngineScopeScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return engine_scope(nodeid)

    return EngineScopeScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests that use the shared pair run one after the other, where the first of them
    was collected, so that it is stopped after the last instead of idling to the session's end.
    The modules engine_scope names by path must exist: a moved module would fall back to a
    work unit of its own without a word."""
    moved = [m for m in (*SHARED_PD_MODULES, *SPLIT_BY_PREFIX, *SPLIT_BY_VERSION) if not (REPO_ROOT / m).is_file()]
    if moved:
        raise pytest.UsageError(f"tests/conftest.py names modules that are not there: {moved}")
    users = [item for item in items if SHARED_PD in getattr(item, "fixturenames", ())]
    strays = sorted({item.nodeid.partition("::")[0] for item in users} - set(SHARED_PD_MODULES))
    if strays:
        raise pytest.UsageError(f"tests/conftest.py: add {strays} to SHARED_PD_MODULES (they use shared_pd)")
    if len(users) < 2:
        return
    first = items.index(users[0])
    rest = [item for item in items if item not in users]
    items[:] = rest[:first] + users + rest[first:]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield
    if SHARED_PD in getattr(item, "fixturenames", ()) and (
        nextitem is None or SHARED_PD not in getattr(nextitem, "fixturenames", ())
    ):
        for shared in _shared_pds:
            shared.stop()


VLLM_TEST_BLOCK = 32  # block size of the vLLM adapter's stand-in tests


@pytest.fixture
def vllm_captured():
    """The vLLM adapter's state reset, its probes writing records to a capture (blocks of
    ``VLLM_TEST_BLOCK`` tokens, HELLO taken as sent): its hooks on stand-ins, no vLLM needed."""
    from kvguard.engine_hooks import probes as probes_mod
    from kvguard.engine_hooks.probes import Probes
    from kvguard.engine_hooks.vllm import _runtime as rt
    from tests.support.recording_probes import CaptureWriter

    cap = CaptureWriter()
    probes_mod.reset_probes_for_tests(Probes(cap, page_size=VLLM_TEST_BLOCK))
    rt.State.reset()
    rt.State.page_size, rt.State.hello_done = VLLM_TEST_BLOCK, True
    yield cap
    probes_mod.reset_probes_for_tests(None)
    rt.State.reset()


@pytest.fixture(scope="session")
def redis_cluster_session(tmp_path_factory):
    """One real Redis Cluster (3 masters + 3 replicas, tests/support/redis_cluster.py) per test
    session (~2 s to start); tests take it through ``redis_cluster``."""
    from tests.support.redis_cluster import ClusterStartError, RedisCluster

    try:
        cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    except ClusterStartError as exc:
        pytest.fail(str(exc))
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster(redis_cluster_session):
    """The session's Redis Cluster, whole again: nodes an earlier test killed are restarted."""
    redis_cluster_session.heal()
    return redis_cluster_session


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server of its own (tests/support/redis_server.py), killed after the test."""
    from tests.support.redis_server import RedisServer

    server = RedisServer(tmp_path).start()
    yield server
    if server.proc.poll() is None:
        server.kill()


@pytest.fixture
def clean_otel_env(monkeypatch):
    """No OTEL_* variable of the machine running the tests (the OpenTelemetry SDK reads them)."""
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
