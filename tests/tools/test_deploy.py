"""deploy/: Kubernetes manifests, generated monitoring objects and Dockerfiles.

The checks are deploy/check.py's (also `make deploy-check`); here each runs as its own
test, each check is shown to catch the mistake it exists for, a pod-shaped run starts
the real sidecar with the rendered manifest's command line and uids against a ring
written by a real engine-side probe, and the rendered Redis ledger's own command line
runs a real redis-server that the sidecars' rendered password settings log in to.

Tools: a real kustomize (`kubectl kustomize`, kustomize v5; on this project's machines
kubectl comes with the image) and kubernetes-validate (requirements/deploy.lock; installed
once into .kvguard-cache/deploy-tools when the venv lacks it, which needs PyPI). Missing
tools skip those tests with the reason, and fail them under CI=true. Nothing here builds
an image or talks to a cluster: there is neither a Docker engine nor a cluster here.
"""

from __future__ import annotations

import base64
import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import zipfile
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import httpx
import pytest
import yaml

from kvguard.demo.engine_env import free_port as _free_port

REPO = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


check = _load("kvguard_deploy_check", REPO / "deploy" / "check.py")
generate = check.generate


def _missing(exc: Exception):
    if os.environ.get("CI") == "true":
        pytest.fail(f"deploy tool missing under CI: {exc}")
    pytest.skip(str(exc))


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    try:
        return check.render_all()
    except check.ToolMissing as exc:
        _missing(exc)


@pytest.fixture(scope="module")
def validator():
    try:
        return check.kubernetes_validate()
    except check.ToolMissing as exc:
        _missing(exc)


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def containers(deployment: dict) -> dict[str, dict]:
    """Regular and init containers (the sidecar is a native sidecar: an init container) by name."""
    return check._containers(deployment["spec"]["template"]["spec"])


def watched(objs: list[dict]) -> list[dict]:
    return [o for o in objs if o["kind"] in check.WORKLOAD_KINDS and check._is_watched(o)]


# --------------------------------------------------------------------------- generated files
def test_generated_files_match_alerts_and_dashboards():
    assert generate.check(REPO) == []


def _fake_repo(tmp_path: Path, rules: str | None = None) -> Path:
    (tmp_path / "alerts").mkdir()
    (tmp_path / "alerts" / "kvguard.rules.yaml").write_text(
        rules or (REPO / "alerts" / "kvguard.rules.yaml").read_text()
    )
    return tmp_path


def test_generator_handles_a_missing_or_empty_dashboards_directory(tmp_path):
    repo = _fake_repo(tmp_path)
    files = generate.expected(repo)  # no dashboards/ at all
    assert set(files) == {generate.RULE_OUT, generate.DASHBOARDS_OUT / "kustomization.yaml"}
    assert yaml.safe_load(files[generate.DASHBOARDS_OUT / "kustomization.yaml"])["resources"] == []
    (repo / "dashboards").mkdir()  # empty
    assert generate.expected(repo) == files
    generate.write(repo)
    assert generate.check(repo) == []


def test_generator_deploys_dashboards_byte_for_byte_and_catches_drift(tmp_path):
    repo = _fake_repo(tmp_path)
    board = '{\n  "title": "kvguard / x",\n  "uid": "kvguard-x",\n  "panels": []\n}\n'
    (repo / "dashboards" / "generated").mkdir(parents=True)
    (repo / "dashboards" / "generated" / "kvguard-x.json").write_text(board)
    (repo / "dashboards" / "generated" / "settings.json").write_text('{"not": "a dashboard"}')
    generate.write(repo)
    out = repo / generate.DASHBOARDS_OUT / "kvguard-dashboard-x.yaml"
    cm = yaml.safe_load(out.read_text())
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"] == {"kvguard-x.json": board}
    assert yaml.safe_load((repo / generate.DASHBOARDS_OUT / "kustomization.yaml").read_text())["resources"] == [
        "kvguard-dashboard-x.yaml"
    ]
    assert any("settings.json" in w for w in generate.warnings(repo))
    assert generate.check(repo) == []

    (repo / "dashboards" / "generated" / "kvguard-x.json").write_text(board.replace("[]", "[{}]"))
    assert any("kvguard-dashboard-x.yaml: differs" in p for p in generate.check(repo))
    (repo / "dashboards" / "generated" / "kvguard-x.json").unlink()
    assert any("no longer exists" in p for p in generate.check(repo))
    generate.write(repo)
    assert not out.exists() and generate.check(repo) == []


def test_generator_refuses_what_grafana_or_kubernetes_would_not_take(tmp_path):
    repo = _fake_repo(tmp_path)
    d = repo / "dashboards"
    d.mkdir()
    (d / "a.json").write_text("{not json")
    with pytest.raises(generate.GenerateError, match="a.json: not JSON"):
        generate.expected(repo)
    (d / "a.json").write_text('{"uid": "same", "panels": []}')
    (d / "b.json").write_text('{"uid": "same", "panels": []}')
    with pytest.raises(generate.GenerateError, match="same uid"):
        generate.expected(repo)
    with pytest.raises(generate.GenerateError, match="not a Prometheus rule file"):
        generate.prometheus_rule("rules: []\n")


def test_prometheusrule_holds_the_rule_files_groups_unchanged():
    rule = yaml.safe_load((REPO / generate.RULE_OUT).read_text())
    source = yaml.safe_load((REPO / generate.RULES_SRC).read_text())
    assert rule["kind"] == "PrometheusRule" and rule["spec"]["groups"] == source["groups"]
    alerts = [r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert "KVGuardUnwrittenRead" in alerts and "KVGuardSidecarDown" in alerts


# --------------------------------------------------------------------------- rendering + schemas
ENGINE_KINDS = {"Deployment", "Service"}


@pytest.mark.parametrize(
    "target,kinds",
    [
        ("stock-sglang", ENGINE_KINDS),
        ("stock-vllm", ENGINE_KINDS),
        ("stock-lws", {"LeaderWorkerSet", "Service"}),
        ("base", ENGINE_KINDS),
        ("base-vllm", ENGINE_KINDS),
        ("common", {"Secret", "ConfigMap", "ServiceMonitor", "PrometheusRule", "NetworkPolicy"}),
        ("redis", {"Deployment", "Service", "NetworkPolicy"}),
        ("unified", ENGINE_KINDS),
        ("prefill", ENGINE_KINDS),
        ("decode", ENGINE_KINDS),
        ("sglang-pd", ENGINE_KINDS | {"PodDisruptionBudget"}),
        ("vllm-unified", ENGINE_KINDS),
        ("vllm-pd", ENGINE_KINDS),
        ("release", {"Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget"}),
    ],
)
def test_every_kustomization_builds(rendered, target, kinds):
    assert {o["kind"] for o in rendered[target]} == kinds
    # the Component's pod template is local configuration: never deployed
    assert not by_kind(rendered[target], "PodTemplate")


@pytest.mark.parametrize("target", list(check.TARGETS))
def test_rendered_objects_validate_strictly_against_the_kubernetes_schemas(rendered, validator, target):
    assert check.schema_problems(rendered[target]) == []


@pytest.mark.parametrize("target", [t for t in check.TARGETS if t not in ("common", "redis")])
def test_engine_pods_and_sidecar_fit_together(rendered, target):
    workloads = watched(rendered[target])
    assert workloads, target
    for w in workloads:
        assert check.pod_problems(w) == []
    assert check.component_problems(rendered[target]) == []
    assert check.image_problems(rendered[target], by_digest=target == check.RELEASE) == []


STOCK = {
    "stock-sglang": "sglang/deployment.yaml",
    "stock-vllm": "vllm/deployment.yaml",
    "stock-lws": "lws/leaderworkerset.yaml",
}


@pytest.mark.parametrize("target", list(STOCK))
def test_the_component_adds_a_native_sidecar_to_a_stock_engine(rendered, target):
    """deploy/examples: an upstream manifest plus one label; the Component adds the rest and
    keeps every container, volume and variable the manifest had."""
    stock = yaml.safe_load((check.DEPLOY / "examples" / STOCK[target]).read_text())
    (w,) = watched(rendered[target])
    templates = dict(check.pod_templates(w))
    assert len(templates) == len(check.pod_templates(stock))  # a LeaderWorkerSet's leader too
    for (name, before), tpl in zip(check.pod_templates(stock), templates.values()):
        pod, was = tpl["spec"], before["spec"]
        (side,) = pod["initContainers"]
        assert side["name"] == "kvguard" and side["restartPolicy"] == "Always", name
        assert [c["name"] for c in pod["containers"]] == [c["name"] for c in was["containers"]]
        engine, stock_engine = pod["containers"][0], was["containers"][0]
        assert engine["image"].startswith("registry.example.com/")  # the kvguard-enabled image
        assert engine["env"][: len(stock_engine.get("env", []))] == stock_engine.get("env", [])
        assert engine["env"][len(stock_engine.get("env", [])) :][0] == {"name": "KVGUARD_RING_DIR", "value": "/rings"}
        assert pod["volumes"][: len(was["volumes"])] == was["volumes"]
        assert [v["name"] for v in pod["volumes"][len(was["volumes"]) :]] == [
            "kvguard-rings",
            "kvguard-secrets",
            "kvguard-recordings",
            "kvguard-tmp",
        ]
        assert pod["automountServiceAccountToken"] is False and pod["securityContext"]["fsGroup"] == 10001
        assert tpl["metadata"]["labels"]["kvguard.io/watched"] == "true"
    (svc,) = by_kind(rendered[target], "Service")
    assert svc["spec"]["ports"][0]["targetPort"] == 9464  # by number (kubernetes/kubernetes#127958)


def _ledger_env(side: dict) -> dict:
    return {e["name"]: e for e in side.get("env", []) if e["name"].startswith("KVGUARD_")}


def test_the_four_deployments_set_the_engine_role_and_wire_the_pd_ledger(rendered):
    roles = {}
    for overlay in check.OVERLAYS:
        for d in watched(rendered[overlay]):
            pod = d["spec"]["template"]["spec"]
            role = check.engine_role(check._engine(pod))
            roles[d["metadata"]["name"]] = role
            env = _ledger_env(containers(d)["kvguard"])
            if role is None:
                assert "KVGUARD_LEDGER" not in env, d["metadata"]["name"]  # in-pod: the in-memory ledger
                continue
            assert env["KVGUARD_LEDGER"]["valueFrom"]["configMapKeyRef"]["key"] == "KVGUARD_LEDGER"
            assert env["KVGUARD_LEDGER_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
                "name": "kvguard",
                "key": "ledger-password",
            }
            assert env["KVGUARD_CLUSTER"]["value"] == overlay  # one name per deployment sharing the Redis
    assert roles == {
        "sglang-unified": None,
        "sglang-prefill": "prefill",
        "sglang-decode": "decode",
        "vllm-unified": None,
        "vllm-prefill": "prefill",
        "vllm-decode": "decode",
    }
    (router,) = [d for d in by_kind(rendered["sglang-pd"], "Deployment") if d["metadata"]["name"] == "sglang-router"]
    assert "kvguard" not in containers(router)  # holds no KV cache: not watched
    (pdb,) = by_kind(rendered["sglang-pd"], "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1 and router["spec"]["replicas"] == 2
    config = {o["metadata"]["name"]: o for o in by_kind(rendered["common"], "ConfigMap")}["kvguard-config"]
    assert config["data"]["KVGUARD_LEDGER"] == "redis://kvguard-redis:6379/0"
    assert {s["metadata"]["name"] for s in by_kind(rendered["redis"], "Service")} == {"kvguard-redis"}


def test_common_and_all_overlays_deploy_together(rendered):
    assert check.cross_problems(rendered["all"]) == []
    assert check.generated_problems(rendered["common"]) == []


def test_promtool_accepts_the_prometheusrule(rendered):
    problems = check.promtool_problems(rendered["common"])
    if problems is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`: run `make apt`)")
    assert problems == []


def test_deploy_lock_agrees_with_engine_lock():
    assert check.lock_problems() == []


# --------------------------------------------------------------------------- the checks catch mistakes
def _mutate(obj: dict, fn) -> dict:
    obj = copy.deepcopy(obj)
    fn(obj)
    return obj


def _pod(d):
    return d["spec"]["template"]["spec"]


def _c(d, name):
    return check._containers(_pod(d))[name]


def _vol(d, name):
    return next(v for v in _pod(d)["volumes"] if v["name"] == name)


def _env_of(d, container, name):
    return next(e for e in _c(d, container)["env"] if e["name"] == name)


def _as_regular_container(d):
    side = _c(d, "kvguard")
    _pod(d)["initContainers"].remove(side)
    side.pop("restartPolicy")
    _pod(d)["containers"].append(side)


def _drop_env(d, container, name):
    _c(d, container)["env"] = [e for e in _c(d, container)["env"] if e["name"] != name]


def _literal_password(d):
    env = _env_of(d, "kvguard", "KVGUARD_LEDGER_PASSWORD")
    env.pop("valueFrom")
    env["value"] = "hunter2"


POD_MUTATIONS = {
    "shareProcessNamespace is not needed": lambda d: _pod(d).update(shareProcessNamespace=True),
    "automountServiceAccountToken must be false": lambda d: _pod(d).pop("automountServiceAccountToken"),
    "readOnlyRootFilesystem": lambda d: _c(d, "kvguard")["securityContext"].update(readOnlyRootFilesystem=False),
    "drop ALL": lambda d: _c(d, "kvguard")["securityContext"]["capabilities"].update(drop=["NET_RAW"]),
    "RuntimeDefault": lambda d: (
        _c(d, "kvguard")["securityContext"].pop("seccompProfile"),
        _pod(d).pop("securityContext"),
    ),
    "KVGUARD_RING_DIR": lambda d: _env_of(d, "sglang", "KVGUARD_RING_DIR").update(value="/dev/shm/kvguard"),
    "does not parse": lambda d: _c(d, "kvguard")["args"].__setitem__(1, "--ring-dirr"),
    "without a shared group": lambda d: _pod(d)["securityContext"].pop("fsGroup"),
    "which the rings no longer need": lambda d: _c(d, "sglang")["securityContext"].update(runAsUser=10001),
    "sizeLimit": lambda d: _vol(d, "kvguard-rings")["emptyDir"].update(sizeLimit="64Mi"),
    "not on a Secret volume": lambda d: _c(d, "kvguard")["volumeMounts"].__setitem__(
        1, {"name": "kvguard-tmp", "mountPath": "/secrets"}
    ),
    "listens on 127.0.0.1": lambda d: _c(d, "kvguard")["args"].__setitem__(4, "127.0.0.1:9464"),
    "readinessProbe must GET /readyz": lambda d: _c(d, "kvguard")["readinessProbe"]["httpGet"].update(path="/healthz"),
    "livenessProbe does not use the --health-listen port": lambda d: _c(d, "kvguard")["livenessProbe"][
        "httpGet"
    ].update(port="metrics"),
    "port 'health' is 9466, --health-listen port is 9465": lambda d: _c(d, "kvguard")["ports"][1].update(
        containerPort=9466
    ),
    "--record-max-bytes": lambda d: _vol(d, "kvguard-recordings")["emptyDir"].update(sizeLimit="1Gi"),
    # the native sidecar
    "is a regular container: make it a native sidecar": _as_regular_container,
    "has no restartPolicy: Always": lambda d: _c(d, "kvguard").pop("restartPolicy"),
    "pod label kvguard.io/watched": lambda d: d["spec"]["template"]["metadata"]["labels"].pop("kvguard.io/watched"),
    # one paging path by default
    "pages PagerDuty directly as well": lambda d: _c(d, "kvguard")["args"].extend(
        ["--pagerduty-routing-key-file", "/secrets/pagerduty-routing-key"]
    ),
    # the prefill/decode ledger
    "a prefill engine's sidecar without a shared ledger": lambda d: _drop_env(d, "kvguard", "KVGUARD_LEDGER"),
    "a literal value puts the password in the pod spec": lambda d: _literal_password(d),
    "without KVGUARD_CLUSTER": lambda d: _drop_env(d, "kvguard", "KVGUARD_CLUSTER"),
}


@pytest.mark.parametrize("expect", list(POD_MUTATIONS))
def test_pod_contract_check_catches(rendered, expect):
    (d,) = by_kind(rendered["prefill"], "Deployment")
    problems = check.pod_problems(_mutate(d, POD_MUTATIONS[expect]))
    assert any(expect in p for p in problems), problems


def test_pod_contract_reads_vllm_and_leaderworkerset_engines(rendered):
    """A vLLM engine's role from --kv-transfer-config; an SGLang LeaderWorkerSet's rings per pod
    from --tp over --nnodes $(LWS_GROUP_SIZE): 8 of TP 16 on each of 2 pods."""
    decode = next(d for d in by_kind(rendered["vllm-pd"], "Deployment") if d["metadata"]["name"] == "vllm-decode")
    problems = check.pod_problems(_mutate(decode, lambda d: _drop_env(d, "kvguard", "KVGUARD_LEDGER")))
    assert any("a decode engine's sidecar without a shared ledger" in p for p in problems), problems
    (lws,) = by_kind(rendered["stock-lws"], "LeaderWorkerSet")
    assert [check.engine_rings(check._engine(t["spec"]), lws) for _, t in check.pod_templates(lws)] == [8, 8]
    one_node = _mutate(lws, lambda o: o["spec"]["leaderWorkerTemplate"].update(size=1))  # 16 rings > 256Mi
    problems = check.pod_problems(one_node)
    assert sum("sizeLimit 256Mi < 16 engine rings" in p for p in problems) == 2, problems
    (vllm,) = by_kind(rendered["stock-vllm"], "Deployment")  # `sh -c "vllm serve ..."`
    assert check._engine_kind(check._argv(check._engine(_pod(vllm)))) == "vllm"


def test_component_check_catches_a_piece_that_did_not_arrive(rendered):
    (lws,) = by_kind(rendered["stock-lws"], "LeaderWorkerSet")

    def leader(o):
        return o["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]

    no_rings = _mutate(lws, lambda o: leader(o).update(volumes=leader(o)["volumes"][:1]))
    problems = check.component_problems([no_rings])
    assert any("leaderTemplate: the kvguard Component's volumes[kvguard-rings]" in p for p in problems), problems
    unlabelled = _mutate(lws, lambda o: o["metadata"]["labels"].pop("kvguard.io/watched-leader"))
    assert any("kvguard.io/watched-leader" in p for p in check.component_problems([unlabelled]))
    (d,) = by_kind(rendered["stock-sglang"], "Deployment")
    no_env = _mutate(d, lambda o: _drop_env(o, "llama-31-8b-instruct-sglang", "KVGUARD_RING_BYTES"))
    assert any("containers[0].env[KVGUARD_RING_BYTES]" in p for p in check.component_problems([no_env]))
    changed = _mutate(d, lambda o: _c(o, "kvguard")["args"].pop())
    assert any("initContainers[kvguard]" in p for p in check.component_problems([changed]))
    fsgroup = _mutate(d, lambda o: _pod(o)["securityContext"].pop("fsGroup"))
    assert any("securityContext.fsGroup" in p for p in check.component_problems([fsgroup]))


def test_release_images_are_pinned_by_digest(rendered):
    objs = rendered[check.RELEASE]
    assert check.image_problems(objs, by_digest=True) == []
    assert check.image_problems(rendered["unified"], by_digest=True)  # tags: fine elsewhere, not in a release
    tagged = [
        _mutate(o, lambda d: _c(d, "kvguard").update(image="registry.example.com/kvguard-sidecar:0.1.0"))
        if o["metadata"]["name"] == "vllm-decode" and o["kind"] == "Deployment"
        else o
        for o in objs
    ]
    (problem,) = check.image_problems(tagged, by_digest=True)
    assert "vllm-decode: container kvguard image" in problem and "not pinned by digest" in problem


def test_schema_check_catches_unknown_fields_and_bad_values(rendered, validator):
    (d,) = by_kind(rendered["unified"], "Deployment")
    typo = _mutate(d, lambda o: _c(o, "kvguard")["securityContext"].update(runAsNonroot=True))
    assert any("runAsNonroot" in p for p in check.schema_problems([typo], versions=("1.33.0",)))
    (pr,) = by_kind(rendered["common"], "PrometheusRule")
    bad = _mutate(pr, lambda o: o["spec"]["groups"][0]["rules"][1].update(severity="critical", **{"for": "5 min"}))
    problems = check.schema_problems([bad])
    assert any("severity" in p for p in problems) and any("5 min" in p for p in problems), problems
    (sm,) = by_kind(rendered["common"], "ServiceMonitor")
    bad = _mutate(sm, lambda o: o["spec"]["endpoints"][0].update(scheme="tcp"))
    assert check.schema_problems([bad])
    unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    assert any("no Kubernetes" in p for p in check.schema_problems([unknown], versions=("1.33.0",)))
    (lws,) = by_kind(rendered["stock-lws"], "LeaderWorkerSet")
    bad = _mutate(lws, lambda o: o["spec"]["leaderWorkerTemplate"].update(sise=2))  # the LWS schema
    assert any("sise" in p for p in check.schema_problems([bad], versions=("1.33.0",)))
    bad = _mutate(  # its pod templates: the core PodTemplate schema
        lws,
        lambda o: o["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["initContainers"][0].update(
            restartPolicyy="Always"
        ),
    )
    assert any(
        "workerTemplate" in p and "restartPolicyy" in p for p in check.schema_problems([bad], versions=("1.33.0",))
    )


def test_cross_check_catches_wrong_job_missing_keys_and_dangling_selectors(rendered):
    objs = rendered["all"]

    def changed(kind, fn):
        return [_mutate(o, fn) if o["kind"] == kind else o for o in objs]

    no_job = changed("ServiceMonitor", lambda o: o["spec"].pop("jobLabel"))
    assert any("expects job=['kvguard']" in p for p in check.cross_problems(no_job))
    no_key = changed("Secret", lambda o: o["data"].pop("api-token"))
    assert any("no key 'api-token'" in p for p in check.cross_problems(no_key))
    stray = changed("Service", lambda o: o["spec"]["selector"].update({"app.kubernetes.io/name": "vllm"}))
    assert any("matches no pod template" in p for p in check.cross_problems(stray))
    no_cm = [o for o in objs if not (o["kind"] == "ConfigMap" and o["metadata"]["name"] == "kvguard-config")]
    assert any("needs configMap kvguard-config" in p for p in check.cross_problems(no_cm))
    stale = changed("PrometheusRule", lambda o: o["spec"]["groups"][0]["rules"].pop())
    assert any("differ from alerts/kvguard.rules.yaml" in p for p in check.generated_problems(stale))
    named = changed("Service", lambda o: [pt.update(targetPort="metrics") for pt in o["spec"]["ports"]])
    assert any("kubernetes/kubernetes#127958" in p for p in check.cross_problems(named))
    no_ledger_key = changed("Secret", lambda o: o["data"].pop("ledger-password"))
    assert any(
        "env KVGUARD_LEDGER_PASSWORD" in p and "no key 'ledger-password'" in p
        for p in check.cross_problems(no_ledger_key)
    )


def _changed(objs, kind, name, fn):
    return [_mutate(o, fn) if (o["kind"], o["metadata"]["name"]) == (kind, name) else o for o in objs]


def test_cross_check_catches_a_budget_that_blocks_drains_or_selects_nothing(rendered):
    objs = rendered["all"]
    blocking = _changed(objs, "PodDisruptionBudget", "sglang-router", lambda o: o["spec"].update(minAvailable=2))
    assert any("allows no eviction of its 2 pod(s)" in p for p in check.cross_problems(blocking))

    def max_unavailable_0(o):
        o["spec"].pop("minAvailable")
        o["spec"]["maxUnavailable"] = 0

    zero = _changed(objs, "PodDisruptionBudget", "sglang-router", max_unavailable_0)
    assert any("allows no eviction" in p for p in check.cross_problems(zero))
    stray = _changed(
        objs, "PodDisruptionBudget", "sglang-router", lambda o: o["spec"]["selector"]["matchLabels"].update(x="y")
    )
    assert any("PodDisruptionBudget/sglang-router: selector" in p for p in check.cross_problems(stray))


def test_cross_check_catches_a_ledger_the_sidecars_cannot_reach(rendered):
    objs = rendered["all"]
    moved = _changed(objs, "Service", "kvguard-redis", lambda o: o["metadata"].update(name="redis"))
    assert any("no Service 'kvguard-redis' here" in p for p in check.cross_problems(moved))
    port = _changed(objs, "Service", "kvguard-redis", lambda o: o["spec"]["ports"][0].update(port=6380))
    assert any("Service kvguard-redis has no port 6379" in p for p in check.cross_problems(port))
    shut = _changed(
        objs,
        "NetworkPolicy",
        "kvguard-redis",
        lambda o: o["spec"]["ingress"][0]["from"][0]["podSelector"].update(matchLabels={"app": "other"}),
    )
    assert any("no rule lets the sidecars" in p for p in check.cross_problems(shut))
    wide = _changed(objs, "NetworkPolicy", "kvguard-redis", lambda o: o["spec"]["ingress"][0].pop("from"))
    assert any("Redis port 6379 is open to everyone" in p for p in check.cross_problems(wide))


def test_cross_check_reads_the_routers_command_line_and_finds_its_workers(rendered):
    objs = rendered["all"]

    def router(fn):
        return _changed(objs, "Deployment", "sglang-router", lambda o: fn(_c(o, "router")["args"]))

    assert (
        check.router_problems(
            [o for o in objs if o["kind"] in check.WORKLOAD_KINDS],
            {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"},
        )
        == []
    )
    host = router(lambda a: a.__setitem__(a.index("http://sglang-prefill:30000"), "http://prefill:30000"))
    assert any("router prefill worker http://prefill:30000: no Service" in p for p in check.cross_problems(host))
    bootstrap = router(lambda a: a.__setitem__(a.index("8998"), "8999"))
    assert any("Service/sglang-prefill has no port 8999" in p for p in check.cross_problems(bootstrap))
    swapped = router(lambda a: a.__setitem__(a.index("http://sglang-decode:30000"), "http://sglang-unified:30000"))
    assert any("Service/sglang-unified selects no decode engine" in p for p in check.cross_problems(swapped))

    def gate(fn):
        return _changed(objs, "Deployment", "sglang-router", lambda o: fn(_c(o, "kv-preflight")["args"]))

    stray = gate(lambda a: a.__setitem__(a.index("http://sglang-decode:30000"), "http://decode:30000"))
    assert any("kv-preflight checks http://decode:30000: no Service" in p for p in check.cross_problems(stray))
    typo = gate(lambda a: a.__setitem__(a.index("--timeout"), "--timeoutt"))
    assert any("kv-preflight: `kvguard preflight --timeoutt" in p for p in check.cross_problems(typo))
    if importlib.util.find_spec("sglang_router") is not None:  # sglang-router's own parser
        typo = router(lambda a: a.__setitem__(0, "--pd-disagregation"))
        assert any("router command" in p and "does not parse" in p for p in check.cross_problems(typo))


def test_the_network_policy_closes_only_the_sidecars_port(rendered):
    objs = rendered["all"]
    assert (
        check.network_policy_problems(
            [o for o in objs if o["kind"] == "NetworkPolicy"], [o for o in objs if o["kind"] == "Deployment"]
        )
        == []
    )

    def changed(fn):
        return _changed(objs, "NetworkPolicy", "kvguard-sidecar", fn)

    wide = changed(lambda o: o["spec"]["ingress"][0].pop("from"))  # 9464 from anywhere
    assert any("opens the sidecar's port 9464 to everyone" in p for p in check.cross_problems(wide))
    cut = changed(lambda o: o["spec"]["ingress"][1]["ports"].pop(0))  # ports 1-9463: the engine's among them
    assert any("cuts sglang's port" in p for p in check.cross_problems(cut))
    closed = changed(lambda o: o["spec"]["ingress"].pop(0))
    assert any("lets Prometheus reach the sidecar's port" in p for p in check.cross_problems(closed))
    probes_open = changed(lambda o: o["spec"]["ingress"][1]["ports"][1].update(port=9465))  # 9465-65535
    assert any("opens the sidecar's port 9465 to everyone" in p for p in check.cross_problems(probes_open))


# --------------------------------------------------------------------------- Dockerfiles
@pytest.mark.parametrize("which", list(check.DOCKERFILES))
def test_dockerfile_static_checks(which):
    assert check.dockerfile_problems(which) == []


def test_sidecar_requirements_are_the_dependency_closure_of_kvguard_sidecar():
    pinned = check._pins(check.SIDECAR_REQUIREMENTS)
    closure = check.sidecar_closure()
    assert pinned == closure
    assert {"fastapi", "uvicorn", "prometheus-client", "numpy", "xxhash"} <= set(pinned)


def test_dockerfile_check_catches_latest_root_and_unpinned(tmp_path, monkeypatch):
    bad = tmp_path / "Dockerfile.sidecar"
    bad.write_text(
        'FROM python:latest\nRUN apt-get install -y gcc\nRUN pip install fastapi\nUSER root\nENTRYPOINT ["sh"]\n'
    )
    (tmp_path / "Dockerfile.sidecar.dockerignore").write_text("*\n")
    monkeypatch.setattr(check, "DOCKERFILES", {"sidecar": bad})
    monkeypatch.setattr(check, "REPO", tmp_path)
    monkeypatch.setattr(check, "sidecar_requirements_problems", lambda: [])
    problems = "\n".join(check.dockerfile_problems("sidecar"))
    for expect in (
        "latest",
        "build tools",
        "without --no-deps",
        "'fastapi' without an exact version",
        "non-root uid",
        "ENTRYPOINT",
    ):
        assert expect in problems, problems


# --------------------------------------------------------------------------- a pod-shaped run


def _python_for(uid: int, gid: int, env: dict) -> str | None:
    """An interpreter that uid can run with this venv's packages (the venv's may sit under /root)."""
    for py in (sys.executable, "/usr/bin/python3"):
        if not os.path.exists(py):
            continue
        probe = subprocess.run(
            [
                "setpriv",
                f"--reuid={uid}",
                f"--regid={gid}",
                "--clear-groups",
                py,
                "-c",
                "import sys, numpy, xxhash, fastapi, uvicorn, kvguard.sidecar.cli; print(sys.version_info[:2])",
            ],
            env=env,
            capture_output=True,
            text=True,
            cwd="/",
        )
        if probe.returncode == 0 and probe.stdout.strip() == str(sys.version_info[:2]):
            return py
    return None


# The engine side: a real probe and ring. A pool smaller than the context (HELLO), then
# acme writes pages 4-11 and ends; initech gets them, writes half, reads all (a leak).
ENGINE_CODE = """
import sys, time
import numpy as np
from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import RingWriter
p = Probes(RingWriter(sys.argv[1], 1 << 16))
p.hello("prefill", 0, 4, 64, 256, 2048, 2048, "sglang", "0.5.23", "tiny")
p.request_begin("r-acme", "acme", None, 8, 0, False)
p.pages_allocated(np.arange(4, 12))
p.rows_assigned("r-acme", 0, 8, 0, np.arange(4, 12))
p.forward(["r-acme"], [8], [np.arange(4, 12)], [np.arange(4, 12)])
p.request_end("r-acme", "stop", 1, 2, 1, "")
p.pages_freed(np.arange(4, 12))
p.request_begin("r-initech", "initech", None, 8, 0, False)
p.pages_allocated(np.arange(4, 12))
p.rows_assigned("r-initech", 0, 8, 0, np.arange(4, 12))
p.forward(["r-initech"], [8], [np.arange(4, 8)], [np.arange(4, 12)])
time.sleep(60)
"""


class _PagerDuty(BaseHTTPRequestHandler):
    events: list = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).events.append(json.loads(body))
        self.send_response(202)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"status": "success", "message": "Event processed", "dedup_key": "x"}')

    def log_message(self, *args):
        pass


@pytest.fixture
def pod_dir():
    """A directory other uids can reach (pytest's pod_dir sits under a 0700 directory)."""
    path = Path(tempfile.mkdtemp(prefix="kvguard-pod-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_pod_shaped_run_sidecar_ingests_the_engines_ring_with_the_manifests_uids(
    rendered, pod_dir, kvguard_wheel, request
):
    """The prefill pod as rendered: the (native) sidecar as the manifest's uid, the engine as another
    uid (its image's user: the manifest sets none) in a pid namespace of its own (the
    manifest shares none), both with the pod's fsGroup as a supplementary group and the
    rings volume group-owned by it (setgid), as Kubernetes sets them up; the sidecar started
    with the manifest's own command line (paths moved under pod_dir, --listen on loopback,
    PagerDuty pointed at a local stand-in). A real probe writes a HELLO and a leak into a
    ring in the shared directory: the sidecar attaches the ring, prints the finding, pages
    with the mounted routing key, and answers /v1 with the mounted API token. Not emulated:
    the read-only root filesystem, the dropped capabilities, seccomp, memory limits."""
    if os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("unshare"):
        pytest.skip("needs root, setpriv and unshare (util-linux) to run the two containers' uids and pid namespaces")
    (d,) = by_kind(rendered["prefill"], "Deployment")
    pod, c = _pod(d), containers(d)
    engine_sc, side_sc = c["sglang"]["securityContext"], c["kvguard"]["securityContext"]
    assert "runAsUser" not in engine_sc and "shareProcessNamespace" not in pod  # what the code no longer needs
    fs_group = pod["securityContext"]["fsGroup"]
    e_uid, e_gid = 4242, 4242  # an image's own user: neither the sidecar's uid nor its group
    s_uid, s_gid = side_sc["runAsUser"], side_sc["runAsGroup"]

    # kvguard as the image has it: the wheel, installed (here: unpacked where both uids read it)
    site = Path(tempfile.mkdtemp(prefix="kvg-wheel-"))
    request.addfinalizer(lambda: shutil.rmtree(site, ignore_errors=True))
    with zipfile.ZipFile(kvguard_wheel) as z:
        z.extractall(site)
    for d in [site, *(p for p in site.rglob("*") if p.is_dir())]:
        os.chmod(d, 0o755)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": "/nonexistent",
        "PYTHONPATH": os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]]),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    py = _python_for(s_uid, s_gid, env)
    if py is None:
        pytest.skip(f"no Python that uid {s_uid} can run with this venv's packages")

    # The pod's volumes as directories: emptyDir is 0777; secret files 0444 (defaultMode).
    vols = {}
    for v in pod["volumes"]:
        vols[v["name"]] = pod_dir / v["name"]
        vols[v["name"]].mkdir()
        os.chmod(vols[v["name"]], 0o777)
        if "secret" in v:
            for item in v["secret"]["items"]:
                f = vols[v["name"]] / item["path"]
                f.write_text(check.PLACEHOLDER_SECRETS[item["key"]])
                os.chmod(f, v["secret"].get("defaultMode", 0o644))
                os.chmod(vols[v["name"]], 0o755)
    mounts = {m["mountPath"]: vols[m["name"]] for m in c["kvguard"]["volumeMounts"]}

    def local(arg: str) -> str:
        for mp, path in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
            if arg == mp or arg.startswith(mp + "/"):
                return str(path) + arg[len(mp) :]
        return arg

    port = _free_port()
    args = [local(a) for a in c["kvguard"]["args"]]
    args[args.index("--listen") + 1] = f"127.0.0.1:{port}"
    args[args.index("--health-listen") + 1] = f"127.0.0.1:{_free_port()}"
    # direct PagerDuty is opt-in (the manifests page through Alertmanager): added as the comment says
    assert "--pagerduty-routing-key-file" not in args
    args += ["--pagerduty-routing-key-file", local("/secrets/pagerduty-routing-key")]
    _PagerDuty.events = []
    pd = HTTPServer(("127.0.0.1", 0), _PagerDuty)
    threading.Thread(target=pd.serve_forever, daemon=True).start()
    args += ["--pagerduty-url", f"http://127.0.0.1:{pd.server_address[1]}/v2/enqueue"]
    ring_dir = Path(local(check._env(c["sglang"])["KVGUARD_RING_DIR"]["value"]))

    # the rings volume as the kubelet sets up an fsGroup volume: group fsGroup, setgid, group-writable
    os.chown(vols["kvguard-rings"], 0, fs_group)
    os.chmod(vols["kvguard-rings"], 0o2770)

    def as_uid(uid, gid, argv, own_pid_namespace=False, **kw):
        drop = ["setpriv", f"--reuid={uid}", f"--regid={gid}", f"--groups={fs_group}", py, *argv]
        return subprocess.Popen(
            (["unshare", "--pid", "--fork"] if own_pid_namespace else []) + drop, env=env, cwd="/", **kw
        )

    sidecar = as_uid(
        s_uid, s_gid, ["-m", "kvguard.sidecar.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    engine = None
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert sidecar.poll() is None, sidecar.stderr.read()
            assert time.monotonic() < deadline, "sidecar not ready"
            time.sleep(0.1)
        engine = as_uid(e_uid, e_gid, ["-c", ENGINE_CODE, str(ring_dir)], own_pid_namespace=True)
        finding = json.loads(sidecar.stdout.readline())
        assert finding["kind"] in ("unwritten_read", "pool_smaller_than_context"), finding
        kinds = {finding["kind"], json.loads(sidecar.stdout.readline())["kind"]}
        assert kinds == {"unwritten_read", "pool_smaller_than_context"}

        health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).json()
        # ring_errors is not asserted: the sidecar can scan a ring file between the engine's
        # ftruncate and its header write and count one refusal (engine_hooks/ring.py creates
        # the file in place), a race of the ring code, not of the pod's shape.
        assert health["rings_attached"] == 1, health
        assert len(list(ring_dir.glob("*.ring"))) == 1  # still there: the engine is seen alive
        token = check.PLACEHOLDER_SECRETS["api-token"]
        incidents = httpx.get(
            f"http://127.0.0.1:{port}/v1/incidents", headers={"Authorization": f"Bearer {token}"}, timeout=2
        ).json()["incidents"]
        leaked = [i for i in incidents if i["kind"] == "unwritten_read"]
        assert leaked and leaked[0]["reader"]["tenant"] == "initech" and "acme" in leaked[0]["tenants_exposed"]
        deadline = time.monotonic() + 10
        while not any(e.get("event_action") == "trigger" for e in _PagerDuty.events):
            assert time.monotonic() < deadline, "no PagerDuty event with the mounted routing key"
            time.sleep(0.1)
        assert {e["routing_key"] for e in _PagerDuty.events} == {check.PLACEHOLDER_SECRETS["pagerduty-routing-key"]}
        assert list(vols["kvguard-recordings"].glob("kvguard-*.kvgrec*")), "nothing recorded under --record-dir"
        sidecar.terminate()  # closes the open segment
        sidecar.wait(timeout=15)

        # docs/operations.md: the notification list from a replay of the recordings
        replay = subprocess.run(
            [sys.executable, "-m", "kvguard.sidecar.cli", "replay", "--json", str(vols["kvguard-recordings"])],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert replay.returncode == 0, replay.stderr
        rows = set()
        for line in replay.stdout.splitlines():
            f = json.loads(line)
            if f.get("kind") and f["severity"] == "critical":
                rows |= {(e["tenant"], "exposed") for e in f["exposed"]}
                if f.get("reader"):
                    rows.add((f["reader"]["tenant"], "received"))
        assert rows == {("acme", "exposed"), ("initech", "received")}, replay.stdout
    finally:
        for proc in (engine, sidecar):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        pd.shutdown()


def _resolve(env: dict, objs: dict) -> str:
    """An env entry's value as the kubelet gives it: a literal, or a key of a rendered ConfigMap/Secret."""
    if "value" in env:
        return env["value"]
    ref = env["valueFrom"].get("configMapKeyRef") or env["valueFrom"]["secretKeyRef"]
    if "configMapKeyRef" in env["valueFrom"]:
        return objs[("ConfigMap", ref["name"])]["data"][ref["key"]]
    return base64.b64decode(objs[("Secret", ref["name"])]["data"][ref["key"]]).decode()


def test_the_rendered_redis_ledger_admits_the_sidecars_with_the_secrets_password(rendered, tmp_path, monkeypatch):
    """deploy/redis's own command line (`sh -c`, the password on redis-server's stdin) starts a
    real redis-server with the Secret's ledger-password in its environment (port and data
    directory moved); a decode sidecar's ledger settings, resolved from the rendered ConfigMap
    and Secret as the kubelet resolves them, log in through kvguard's own ping_ledger; a wrong
    or missing password does not; the password is on no command line."""
    if not shutil.which("redis-server"):
        _missing(RuntimeError("redis-server is not installed (make apt)"))
    from kvguard.sidecar.ledger.shared import ping_ledger

    objs = {(o["kind"], o["metadata"]["name"]): o for o in rendered["all"]}
    redis = objs[("Deployment", "kvguard-redis")]
    (c,) = redis["spec"]["template"]["spec"]["containers"]
    argv = c["command"] + c["args"]
    assert argv[:2] == ["sh", "-c"] and len(argv) == 3
    port = _free_port()
    script = argv[2].replace("--port 6379", f"--port {port}").replace("--dir /data", f"--dir {tmp_path}")
    assert f"--port {port}" in script and str(tmp_path) in script
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **{e["name"]: _resolve(e, objs) for e in c["env"]}}
    password = env["REDIS_PASSWORD"]
    assert password == check.PLACEHOLDER_SECRETS["ledger-password"]
    server = subprocess.Popen(["/bin/sh", "-c", script], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        side = containers(objs[("Deployment", "sglang-decode")])["kvguard"]
        side_env = {e["name"]: _resolve(e, objs) for e in side["env"] if e["name"].startswith("KVGUARD_")}
        url = side_env["KVGUARD_LEDGER"].replace("kvguard-redis:6379", f"127.0.0.1:{port}")
        assert url == f"redis://127.0.0.1:{port}/0"
        monkeypatch.setenv("KVGUARD_LEDGER_PASSWORD", side_env["KVGUARD_LEDGER_PASSWORD"])
        deadline = time.monotonic() + 10
        while (why := ping_ledger(url, timeout_s=1)) is not None:
            assert server.poll() is None, server.stderr.read().decode()
            assert time.monotonic() < deadline, why
            time.sleep(0.05)
        with open(f"/proc/{server.pid}/cmdline", "rb") as f:  # exec'd: redis-server itself, no password
            cmdline = f.read().decode()
        assert cmdline.startswith("redis-server") and password not in cmdline
        monkeypatch.setenv("KVGUARD_LEDGER_PASSWORD", "0" * 64)
        assert ping_ledger(url, timeout_s=2) is not None
        monkeypatch.delenv("KVGUARD_LEDGER_PASSWORD")
        assert ping_ledger(url, timeout_s=2) is not None
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert server.returncode == 0  # SIGTERM reached redis-server (exec'd), a clean stop


# --------------------------------------------------------------------------- docs
def test_operations_doc_covers_every_alert_with_its_runbook():
    doc = (REPO / "docs" / "operations.md").read_text()
    rules = yaml.safe_load((REPO / "alerts" / "kvguard.rules.yaml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    for alert in sorted(alerts):
        assert f"[{alert}](runbooks/{alert}.md)" in doc, alert
        assert (REPO / "docs" / "runbooks" / f"{alert}.md").exists(), alert


def test_documented_engine_snippet_matches_the_dockerfile():
    doc = (REPO / "docs" / "operations.md").read_text()
    dockerfile = check.DOCKERFILES["engine"].read_text()
    lines = [ln[1:].strip() for ln in dockerfile.splitlines() if ln.startswith("#   ")]
    start = lines.index("FROM lmsysorg/sglang:<tag>")
    snippet = lines[start : start + 3]
    assert snippet[1].startswith("COPY ") and snippet[2].startswith("RUN pip install --no-cache-dir --no-deps ")
    for line in snippet:
        assert line in doc, line
