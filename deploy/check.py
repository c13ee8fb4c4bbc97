#!/usr/bin/env python3
"""`make deploy-check`: everything about deploy/ that can be checked without a cluster
or a Docker engine. tests/tools/test_deploy.py runs the same functions under pytest.

    python3 deploy/check.py            all checks; exit 1 on any problem
    python3 deploy/check.py --render unified   print one rendered target

1. Generated files match their sources (deploy/generate.py --check): the PrometheusRule
   and alerts/kvguard.rules.yaml, the dashboard ConfigMaps and dashboards/.
2. Every kustomization renders with a real kustomize (`kustomize build`, else
   `kubectl kustomize`; kustomize v5 needed), in a scratch copy of deploy/ with
   placeholder secret files (the real ones are never committed): the kvguard Component
   on stock SGLang and vLLM Deployments and a stock LeaderWorkerSet (deploy/examples),
   the bases, the overlays, the four reference deployments and the release overlay.
3. Every rendered object validates offline, strictly (unknown fields fail), against
   the Kubernetes schemas of kubernetes-validate for several Kubernetes versions;
   ServiceMonitor, PrometheusRule and LeaderWorkerSet (no core schema) against
   deploy/schemas/ (a LeaderWorkerSet's pod templates against the core PodTemplate
   schema); any other kind fails: nothing is skipped silently.
4. What the schemas cannot see: references (volumes, ports, Secrets, ConfigMaps and
   their keys, selectors, the ledger's Redis, the router's workers), the sidecar's
   command line parsed by kvguard's own CLI parser (the router's by sglang-router's),
   the native sidecar, every piece of the Component arriving in each watched pod, the
   ring directory shared by engine and sidecar, the sidecar's security context, probes
   and resources, the ledger wiring of prefill/decode pods, one paging path, the job
   label the alert rules expect, PodDisruptionBudgets, images by digest in the release;
   `promtool check rules` on the PrometheusRule's groups when promtool is installed.
5. The Dockerfiles, statically: pinned base images (no `latest`), numeric non-root
   USER, exact pins (the sidecar's list equals kvguard[sidecar]'s dependency closure),
   build contexts that admit what is copied.

kubernetes-validate comes from requirements/deploy.lock: imported if installed, else
installed once (pip --no-deps --target) into .kvguard-cache/deploy-tools.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from contextlib import contextmanager
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parent
REPO = DEPLOY.parent


def _load_generate():
    """deploy/generate.py, under a name no other module has."""
    import importlib.util

    if "kvguard_deploy_generate" in sys.modules:
        return sys.modules["kvguard_deploy_generate"]
    spec = importlib.util.spec_from_file_location("kvguard_deploy_generate", DEPLOY / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


generate = _load_generate()

# The kustomizations, by name (paths relative to deploy/). "all" is assembled here:
# common + the release overlay (the four reference deployments and the Redis ledger) in
# one namespace, to check names and references across them.
TARGETS = {
    "stock-sglang": "examples/sglang",  # the Component on a stock SGLang Deployment
    "stock-vllm": "examples/vllm",  # ... on a stock vLLM Deployment
    "stock-lws": "examples/lws",  # ... on a stock SGLang LeaderWorkerSet
    "base": "base",
    "base-vllm": "base-vllm",
    "common": "common",
    "redis": "redis",
    "unified": "overlays/unified",
    "prefill": "overlays/prefill",
    "decode": "overlays/decode",
    "sglang-pd": "overlays/sglang-pd",
    "vllm-unified": "overlays/vllm-unified",
    "vllm-pd": "overlays/vllm-pd",
    "release": "overlays/release",
}
# The four reference deployments (all in the release overlay).
OVERLAYS = ("unified", "sglang-pd", "vllm-unified", "vllm-pd")
RELEASE = "release"  # every image by digest
# Kubernetes versions to validate against: the oldest still commonly run, a middle
# one, and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.29.0", "1.33.0", "1.37.0")
CRD_SCHEMAS = DEPLOY / "schemas" / "monitoring.coreos.com_v1.json"
LWS_SCHEMAS = DEPLOY / "schemas" / "leaderworkerset.x-k8s.io_v1.json"
COMPONENT = DEPLOY / "components" / "kvguard"
DEPLOY_LOCK = REPO / "requirements" / "deploy.lock"
ENGINE_LOCK = REPO / "requirements" / "engine.lock"
TOOLS_DIR = REPO / ".kvguard-cache" / "deploy-tools"
SIDECAR = "kvguard"  # the sidecar's container name (a native sidecar: an init container)
WATCHED = "kvguard.io/watched"  # the label of the pods the Component adds the sidecar to
PLACEHOLDER_SECRETS = {"api-token": "0" * 64, "pagerduty-routing-key": "0" * 32, "ledger-password": "1" * 64}
DOCKERFILES = {
    "sidecar": DEPLOY / "docker" / "Dockerfile.sidecar",
    "engine": DEPLOY / "docker" / "Dockerfile.engine",
}
SIDECAR_REQUIREMENTS = DEPLOY / "docker" / "requirements-sidecar.txt"


class ToolMissing(Exception):
    """A tool the check needs is not installed; the message says how to get it."""


# --------------------------------------------------------------------------- tools
def kustomize_command() -> list[str]:
    """`kustomize build` if installed, else `kubectl kustomize` (kustomize v5 required)."""
    if shutil.which("kustomize"):
        out = subprocess.run(["kustomize", "version"], capture_output=True, text=True).stdout
        cmd = ["kustomize", "build"]
    elif shutil.which("kubectl"):
        out = subprocess.run(["kubectl", "version", "--client"], capture_output=True, text=True).stdout
        cmd = ["kubectl", "kustomize"]
    else:
        raise ToolMissing(
            "neither kustomize nor kubectl is installed (kubectl >= 1.27 embeds kustomize v5; "
            "Debian bookworm's kubernetes-client 1.20 is too old)"
        )
    m = re.search(r"v?(\d+)\.(\d+)\.(\d+)", out.split("Kustomize Version:")[-1])
    if not m or int(m.group(1)) < 5:
        raise ToolMissing(
            f"{' '.join(cmd)}: kustomize v5 or newer needed (labels/includeSelectors, patches); "
            f"found: {out.strip() or 'no version'}"
        )
    return cmd


def tool_versions() -> dict[str, str]:
    """For the report: which tools ran, at which versions."""
    v = {"python": sys.version.split()[0], "PyYAML": yaml.__version__}
    try:
        cmd = kustomize_command()
        probe = ["kustomize", "version"] if cmd[0] == "kustomize" else ["kubectl", "version", "--client"]
        v[" ".join(cmd)] = " ".join(subprocess.run(probe, capture_output=True, text=True).stdout.split())
    except ToolMissing as exc:
        v["kustomize"] = f"missing: {exc}"
    try:
        kv = kubernetes_validate()
        v["kubernetes-validate"] = f"{kv.version.__version__} ({Path(kv.__file__).parent})"
    except ToolMissing as exc:
        v["kubernetes-validate"] = f"missing: {exc}"
    from importlib.metadata import version

    v["jsonschema"] = version("jsonschema")
    if shutil.which("promtool"):
        out = subprocess.run(["promtool", "--version"], capture_output=True, text=True)
        v["promtool"] = (out.stdout or out.stderr).splitlines()[0]
    return v


def _pins(path: Path) -> dict[str, str]:
    """name (normalised) -> version of every `name==version` line."""
    pins = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, ver = line.partition("==")
            if not sep:
                raise ValueError(f"{path.name}: {line!r} is not pinned with ==")
            pins[_norm(name)] = ver.strip()
    return pins


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower().strip()


def kubernetes_validate():
    """The kubernetes_validate module: installed, or installed once from requirements/deploy.lock."""
    try:
        import kubernetes_validate as kv
        import kubernetes_validate.version

        return kv
    except ImportError:
        pass
    from importlib.metadata import PackageNotFoundError, version

    lock_hash = hashlib.sha256(DEPLOY_LOCK.read_bytes()).hexdigest()[:16]
    target = TOOLS_DIR / lock_hash
    if not (target / ".complete").exists():
        missing = []
        for name, ver in _pins(DEPLOY_LOCK).items():
            try:
                if version(name) == ver:
                    continue  # already in this interpreter at the same version (engine.lock)
            except PackageNotFoundError:
                pass
            missing.append(f"{name}=={ver}")
        TOOLS_DIR.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=TOOLS_DIR))  # same filesystem: rename is atomic
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--target",
            str(tmp),
            *missing,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ToolMissing(
                f"kubernetes-validate is not installed and `{' '.join(cmd[2:])}` failed "
                f"(needs PyPI): {proc.stderr.strip()[-500:]}"
            )
        (tmp / ".complete").write_text(" ".join(missing) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    sys.path.insert(0, str(target))
    import kubernetes_validate as kv
    import kubernetes_validate.version

    return kv


# --------------------------------------------------------------------------- rendering
@contextmanager
def scratch_deploy():
    """A scratch copy of deploy/ with placeholder secret files and an `all` kustomization."""
    with tempfile.TemporaryDirectory(prefix="kvguard-deploy-") as tmp:
        root = Path(tmp) / "deploy"
        shutil.copytree(DEPLOY, root, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        secrets = root / "common" / "secrets"
        for name, value in PLACEHOLDER_SECRETS.items():
            (secrets / name).write_text(value)
        (root / "all").mkdir()
        (root / "all" / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "resources": ["../common", f"../{TARGETS[RELEASE]}"],
                }
            )
        )
        yield root


def render_all() -> dict[str, list[dict]]:
    """Every target (and "all") rendered by kustomize: name -> objects. Raises on a failed build."""
    cmd = kustomize_command()
    out = {}
    with scratch_deploy() as root:
        for name, rel in {**TARGETS, "all": "all"}.items():
            proc = subprocess.run([*cmd, str(root / rel)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} deploy/{rel} failed:\n{proc.stderr.strip()}")
            out[name] = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return out


def kn(obj: dict) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


# --------------------------------------------------------------------------- schemas
def schema_problems(objs: list[dict], versions=K8S_VERSIONS) -> list[str]:
    """Strict schema validation of every object, for every Kubernetes version."""
    import jsonschema

    kv = kubernetes_validate()
    crd_docs = {
        "monitoring.coreos.com/v1": (CRD_SCHEMAS, json.loads(CRD_SCHEMAS.read_text())),
        "leaderworkerset.x-k8s.io/v1": (LWS_SCHEMAS, json.loads(LWS_SCHEMAS.read_text())),
    }
    problems = []
    for obj in objs:
        api, kind = obj.get("apiVersion", ""), obj.get("kind", "")
        if api in crd_docs:
            path_, crd_doc = crd_docs[api]
            if kind not in crd_doc["kinds"]:
                problems.append(f"{kn(obj)}: no offline schema for {api} {kind} (add one to {path_.name})")
                continue
            schema = dict(crd_doc, **{"$ref": f"#/kinds/{kind}"})
            validator = jsonschema.Draft202012Validator(schema)
            for err in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path)):
                path = "/".join(str(p) for p in err.absolute_path)
                problems.append(f"{kn(obj)}: {path}: {err.message[:300]}")
            # A LeaderWorkerSet's pod templates: the core PodTemplate schema of each version.
            for where, tpl in _lws_templates(obj):
                wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": tpl}
                for version in versions:
                    try:
                        kv.validate(wrapped, version, strict=True)
                    except kv.ValidationError as exc:
                        path = "/".join(str(p) for p in exc.path)
                        problems.append(f"{kn(obj)} {where} (Kubernetes {version}): {path}: {exc.message[:300]}")
            continue
        for version in versions:
            try:
                kv.validate(obj, version, strict=True)
            except kv.SchemaNotFoundError as exc:
                problems.append(f"{kn(obj)}: no Kubernetes {version} schema for {api} {kind}: {exc.message}")
                break
            except kv.ValidationError as exc:
                path = "/".join(str(p) for p in exc.path)
                problems.append(f"{kn(obj)} (Kubernetes {version}): {path}: {exc.message[:300]}")
    return problems


# --------------------------------------------------------------------------- semantics
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "LeaderWorkerSet")


def _lws_templates(obj: dict) -> list[tuple[str, dict]]:
    lwt = obj.get("spec", {}).get("leaderWorkerTemplate", {})
    return [(k, lwt[k]) for k in ("leaderTemplate", "workerTemplate") if isinstance(lwt.get(k), dict)]


def pod_templates(obj: dict) -> list[tuple[str, dict]]:
    """(name, pod template) of each pod shape a workload runs: a LeaderWorkerSet has two."""
    if obj.get("kind") == "LeaderWorkerSet":
        return [(f"{kn(obj)} {where}", tpl) for where, tpl in _lws_templates(obj)]
    if obj.get("kind") in WORKLOAD_KINDS:
        return [(kn(obj), obj["spec"]["template"])]
    return []


def _all_containers(pod: dict) -> list[dict]:
    """The regular containers, then the init containers (a native sidecar is one)."""
    return list(pod.get("containers", [])) + list(pod.get("initContainers", []))


def _containers(pod: dict) -> dict[str, dict]:
    return {c["name"]: c for c in _all_containers(pod)}


def _engine(pod: dict) -> dict | None:
    """The engine: the pod's first regular container (the Component's convention)."""
    return next((c for c in pod.get("containers", []) if c["name"] != SIDECAR), None)


_SHELLS = ("sh", "/bin/sh", "bash", "/bin/bash")


def _argv(container: dict) -> list[str]:
    """The container's command line; `sh -c "..."` (vLLM's own example) split as the shell would."""
    argv = [str(a) for a in container.get("command", []) + container.get("args", [])]
    if len(argv) >= 3 and argv[0] in _SHELLS and argv[1] == "-c":
        return shlex.split(argv[2])
    return argv


def _engine_kind(argv: list[str]) -> str:
    return "vllm" if any(a == "vllm" or a.startswith("vllm.") for a in argv[:3]) else "sglang"


def _int_flag(argv: list[str], *names: str, default: int = 1, lws: dict | None = None) -> int:
    for name in names:
        v = _flag(argv, name)
        if v is None:
            continue
        if v.isdigit():
            return int(v)
        if v == "$(LWS_GROUP_SIZE)" and lws is not None:  # LeaderWorkerSet's own variable
            return int(lws["spec"]["leaderWorkerTemplate"].get("size", 1))
    return default


def engine_rings(engine: dict, obj: dict | None = None) -> int:
    """Rings the engine writes in this pod: one per SGLang scheduler process (TP x DP over
    --nnodes pods); two per vLLM engine (its EngineCore's and rank 0 Worker's) per DP rank."""
    argv = _argv(engine)
    lws = obj if obj is not None and obj.get("kind") == "LeaderWorkerSet" else None
    if _engine_kind(argv) == "vllm":
        return 2 * _int_flag(argv, "--data-parallel-size", "-dp")
    tp = _int_flag(argv, "--tp-size", "--tp")
    dp = _int_flag(argv, "--dp-size", "--dp")
    nnodes = _int_flag(argv, "--nnodes", lws=lws)
    return max(1, -(-tp * dp // nnodes))


def engine_role(engine: dict) -> str | None:
    """prefill / decode (or both) for a prefill/decode engine, else None."""
    argv = _argv(engine)
    if _engine_kind(argv) == "vllm":
        cfg = _flag(argv, "--kv-transfer-config")
        try:
            role = json.loads(cfg).get("kv_role") if cfg else None
        except ValueError:
            return None
        return {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}.get(role)
    mode = _flag(argv, "--disaggregation-mode")
    return mode if mode in ("prefill", "decode") else None


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _quantity(q) -> float:
    """Bytes (or cores) of a Kubernetes quantity."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", str(q))
    if not m:
        raise ValueError(f"not a quantity: {q!r}")
    units = {
        "": 1,
        "m": 1e-3,
        "k": 1e3,
        "M": 1e6,
        "G": 1e9,
        "T": 1e12,
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
    }
    return float(m.group(1)) * units[m.group(2)]


def _flag(args: list[str], name: str):
    """Value of --name / --name=value in an argument list, else None."""
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def sidecar_args(container: dict):
    """The sidecar's command line parsed by kvguard's own parser (kvguard.sidecar.cli)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from kvguard.sidecar.cli import build_parser

    args = list(container.get("command", [])[1:] if container.get("command") else []) + list(container.get("args", []))
    parser = build_parser()
    try:
        return parser.parse_args(args)
    except SystemExit as exc:
        raise ValueError(f"`kvguard {' '.join(args)}` does not parse (exit {exc.code})") from None


def _mount_for(container: dict, path: str) -> dict | None:
    """The volumeMount whose mountPath holds ``path`` (longest prefix)."""
    best = None
    for m in container.get("volumeMounts", []):
        mp = m["mountPath"].rstrip("/")
        if path == mp or path.startswith(mp + "/"):
            if best is None or len(mp) > len(best["mountPath"]):
                best = m
    return best


def pod_problems(obj: dict) -> list[str]:
    """One workload's pods (a LeaderWorkerSet's leader and worker templates each): references
    inside each, and the engine + sidecar contract."""
    p = []
    if obj["kind"] != "LeaderWorkerSet":
        labels = obj["spec"]["template"].get("metadata", {}).get("labels", {})
        for k, v in obj["spec"].get("selector", {}).get("matchLabels", {}).items():
            if labels.get(k) != v:
                p.append(f"{kn(obj)}: selector {k}={v} does not match the pod template's labels")
    for name, tpl in pod_templates(obj):
        p += _pod_problems(name, tpl, obj)
    return p


def _pod_problems(name: str, tpl: dict, obj: dict) -> list[str]:
    p = []
    pod = tpl["spec"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    containers = _containers(pod)
    for c in containers.values():
        ports = {pt.get("name") for pt in c.get("ports", [])}
        for m in c.get("volumeMounts", []):
            if m["name"] not in volumes:
                p.append(f"{name}: container {c['name']} mounts volume {m['name']!r}, which the pod does not have")
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            port = c.get(probe, {}).get("httpGet", {}).get("port")
            if isinstance(port, str) and port not in ports:
                p.append(f"{name}: container {c['name']} {probe} uses port {port!r}, not one of its ports")
        for e in c.get("env", []):
            if "value" in e and "valueFrom" in e:
                p.append(f"{name}: container {c['name']} env {e['name']} has both value and valueFrom")
    if SIDECAR not in containers:
        return p + [f"{name}: no {SIDECAR!r} container"]
    eng = _engine(pod)
    if eng is None:
        return p + [f"{name}: no engine container (the pod's first container)"]
    side = containers[SIDECAR]

    # A native sidecar: started before the engine, stopped after it (so the engine's last
    # records are drained), restarted on exit; Kubernetes >= 1.29.
    if any(c["name"] == SIDECAR for c in pod.get("containers", [])):
        p.append(
            f"{name}: the {SIDECAR} sidecar is a regular container: make it a native sidecar (an "
            f"initContainers entry with restartPolicy: Always, as deploy/components/kvguard adds it), "
            f"so that it starts before the engine and drains its last records after it stops"
        )
    elif side.get("restartPolicy") != "Always":
        p.append(
            f"{name}: the {SIDECAR} init container has no restartPolicy: Always: a plain init container "
            f"must exit before the engine starts (it never would), and is not restarted"
        )
    if tpl.get("metadata", {}).get("labels", {}).get(WATCHED) != "true":
        p.append(f'{name}: pod label {WATCHED}: "true" missing: the NetworkPolicy and the metrics Service select it')

    if pod.get("automountServiceAccountToken") is not False:
        p.append(
            f"{name}: automountServiceAccountToken must be false (neither container uses the Kubernetes API; a "
            f"mounted token is a credential for whoever gets into either)"
        )
    # No shared pid namespace: the sidecar tells a live engine by the lock on its ring file.
    if pod.get("shareProcessNamespace") is True:
        p.append(
            f"{name}: shareProcessNamespace is not needed (the sidecar tells a live engine by the lock on its "
            f"ring file) and lets each container see and signal the other's processes: remove it"
        )

    # The sidecar's command line, as kvguard parses it.
    try:
        a = sidecar_args(side)
    except ValueError as exc:
        return p + [f"{name}: sidecar command: {exc}"]
    if a.command != "sidecar":
        p.append(f"{name}: the {SIDECAR} container runs `kvguard {a.command}`, not `kvguard sidecar`")
        return p
    if not a.json:
        p.append(f"{name}: sidecar without --json: findings (who was exposed) would not reach the logs")
    host, port = a.listen
    if host not in ("0.0.0.0", "::"):
        p.append(f"{name}: sidecar listens on {host}: probes and Prometheus cannot reach it")
    metrics_ports = {pt.get("name"): pt["containerPort"] for pt in side.get("ports", [])}
    if metrics_ports.get("metrics") != port:
        p.append(f"{name}: sidecar port 'metrics' is {metrics_ports.get('metrics')}, --listen port is {port}")
    if a.health_listen is not None:  # the probes' own listener: the probes must use it
        health_host, health_port = a.health_listen
        if health_host not in ("0.0.0.0", "::"):
            p.append(f"{name}: sidecar --health-listen on {health_host}: the kubelet cannot reach it")
        if metrics_ports.get("health") != health_port:
            p.append(
                f"{name}: sidecar port 'health' is {metrics_ports.get('health')}, --health-listen port is {health_port}"
            )
        for probe in ("readinessProbe", "livenessProbe"):
            if side.get(probe, {}).get("httpGet", {}).get("port") not in ("health", health_port):
                p.append(f"{name}: sidecar {probe} does not use the --health-listen port: a flood of 9464 fails it")

    # One paging path by default: the PrometheusRule's alerts through Alertmanager.
    if getattr(a, "pagerduty_routing_key_file", None):
        p.append(
            f"{name}: sidecar --pagerduty-routing-key-file: it pages PagerDuty directly as well as through "
            f"the PrometheusRule's alerts (Alertmanager): two pages per finding. Direct paging is opt-in "
            f"(docs/operations.md), not the manifests' default"
        )

    # Prefill/decode: the shared ledger, its password from a Secret, a cluster name.
    role = engine_role(eng)
    if role is not None:
        senv = _env(side)
        ledger = _flag(side.get("args", []), "--ledger")
        led = senv.get("KVGUARD_LEDGER", {})
        if ledger is None and "valueFrom" not in led and led.get("value", "memory") == "memory":
            p.append(
                f"{name}: a {role} engine's sidecar without a shared ledger (KVGUARD_LEDGER or --ledger "
                f"redis://...): transfers across pods are never paired, the 2026 leak goes undetected on decode"
            )
        elif "@" in str(led.get("value", ledger or "")):
            p.append(f"{name}: the ledger URL carries a password: give it as KVGUARD_LEDGER_PASSWORD from a Secret")
        pw = senv.get("KVGUARD_LEDGER_PASSWORD", {})
        if not pw.get("valueFrom", {}).get("secretKeyRef"):
            p.append(
                f"{name}: a {role} engine's sidecar needs KVGUARD_LEDGER_PASSWORD from a Secret (secretKeyRef)"
                + (": a literal value puts the password in the pod spec" if "value" in pw else "")
            )
        if not senv.get("KVGUARD_CLUSTER", {}).get("value") and not _flag(side.get("args", []), "--ledger-cluster"):
            p.append(
                f"{name}: a {role} engine's sidecar without KVGUARD_CLUSTER: every deployment sharing the "
                f"Redis would be 'default' and pair each other's transfers"
            )

    # The ring directory: one in-memory volume, mounted at the same path in both.
    ring_env = _env(eng).get("KVGUARD_RING_DIR", {}).get("value")
    if ring_env != a.ring_dir:
        p.append(f"{name}: engine KVGUARD_RING_DIR={ring_env!r} but sidecar --ring-dir {a.ring_dir!r}")
    m_side, m_eng = _mount_for(side, a.ring_dir), _mount_for(eng, a.ring_dir)
    if not m_side or not m_eng or m_side["name"] != m_eng["name"]:
        p.append(f"{name}: {a.ring_dir} is not on one volume mounted in both containers")
    else:
        vol = volumes.get(m_side["name"], {})
        ed = vol.get("emptyDir")
        if not ed or ed.get("medium") != "Memory" or not ed.get("sizeLimit"):
            p.append(f"{name}: ring volume {m_side['name']!r} must be emptyDir medium Memory with a sizeLimit")
        else:
            ring_bytes = int(_env(eng).get("KVGUARD_RING_BYTES", {}).get("value", 16 << 20))
            rings = engine_rings(eng, obj)
            need = rings * (ring_bytes + 4096)
            if _quantity(ed["sizeLimit"]) < need:
                p.append(f"{name}: ring volume sizeLimit {ed['sizeLimit']} < {rings} engine rings x {ring_bytes} B")
        if m_side.get("readOnly") or m_eng.get("readOnly"):
            p.append(
                f"{name}: the ring volume must be writable in both containers (the sidecar writes its "
                f"read position into each ring)"
            )

    # Files the sidecar reads or writes: on mounts (the root filesystem is read-only).
    secret_items = {}
    for v in volumes.values():
        if "secret" in v:
            secret_items[v["name"]] = {i["path"]: i["key"] for i in v["secret"].get("items", [])} or None
    for flag, path in (
        ("--api-token-file", a.api_token_file),
        ("--pagerduty-routing-key-file", getattr(a, "pagerduty_routing_key_file", None)),
    ):
        if path is None:
            if flag == "--api-token-file":
                p.append(f"{name}: sidecar without --api-token-file: /v1 (incidents, exposed tenants) answers 403")
            continue
        m = _mount_for(side, path)
        if not m or m["name"] not in secret_items:
            p.append(f"{name}: sidecar {flag} {path} is not on a Secret volume")
            continue
        items = secret_items[m["name"]]
        rel = path[len(m["mountPath"].rstrip("/")) + 1 :]
        if items is not None and rel not in items:
            p.append(f"{name}: sidecar {flag} {path}: the Secret volume has no item at {rel!r}")
    if a.record_dir:
        m = _mount_for(side, a.record_dir)
        if not m or m.get("readOnly"):
            p.append(f"{name}: sidecar --record-dir {a.record_dir} is not on a writable volume")
        elif "emptyDir" in volumes.get(m["name"], {}):
            limit = volumes[m["name"]]["emptyDir"].get("sizeLimit")
            if limit and _quantity(limit) < a.record_max_bytes:
                p.append(f"{name}: recordings volume sizeLimit {limit} < --record-max-bytes {a.record_max_bytes}")

    # Security context of the sidecar (container level, pod level as fallback for seccomp/user).
    sc, psc = side.get("securityContext", {}), pod.get("securityContext", {})
    want = {"runAsNonRoot": True, "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False}
    for k, v in want.items():
        if sc.get(k, psc.get(k) if k == "runAsNonRoot" else None) is not v:
            p.append(f"{name}: sidecar securityContext.{k} must be {v}")
    if "ALL" not in sc.get("capabilities", {}).get("drop", []) or sc.get("capabilities", {}).get("add"):
        p.append(f"{name}: sidecar must drop ALL capabilities and add none")
    if (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
        p.append(f"{name}: sidecar seccompProfile must be RuntimeDefault")
    side_uid = sc.get("runAsUser", psc.get("runAsUser"))
    if not side_uid:
        p.append(f"{name}: sidecar runAsUser must be a non-zero uid")
    # Rings are created 0660 by the engine and opened read-write by the sidecar: a shared group
    # (the pod's fsGroup, which owns the rings volume and every container has), or one uid.
    eng_uid = eng.get("securityContext", {}).get("runAsUser", psc.get("runAsUser"))
    if psc.get("fsGroup") is None and eng_uid != side_uid:
        p.append(
            f"{name}: no pod securityContext.fsGroup and the engine's uid ({eng_uid or 'the image user'}) is not "
            f"the sidecar's ({side_uid}): the sidecar cannot open the engine's rings (created 0660, opened "
            f"read-write) without a shared group"
        )
    if eng_uid is not None and eng_uid == side_uid and psc.get("fsGroup") is not None:
        p.append(
            f"{name}: the engine runs as the sidecar's uid {side_uid}, which the rings no longer need (the pod's "
            f"fsGroup shares them): let the engine run as its image's user"
        )

    # Probes and resources.
    if side.get("readinessProbe", {}).get("httpGet", {}).get("path") != "/readyz":
        p.append(f"{name}: sidecar readinessProbe must GET /readyz")
    if side.get("livenessProbe", {}).get("httpGet", {}).get("path") != "/healthz":
        p.append(f"{name}: sidecar livenessProbe must GET /healthz")
    res = side.get("resources", {})
    for part in ("requests", "limits"):
        for r in ("cpu", "memory"):
            if r not in res.get(part, {}):
                p.append(f"{name}: sidecar resources.{part}.{r} missing")
    if "memory" in res.get("limits", {}):
        history = a.history_events * 40
        if _quantity(res["limits"]["memory"]) < history + 160 * 2**20:
            p.append(
                f"{name}: sidecar memory limit {res['limits']['memory']} is below its history "
                f"({history >> 20} MiB) + ~160 MiB"
            )
    return p


def _is_watched(w: dict) -> bool:
    """A workload whose pods carry the kvguard sidecar (every pod template the Component touched)."""
    return any(
        t.get("metadata", {}).get("labels", {}).get(WATCHED) == "true" or SIDECAR in _containers(t["spec"])
        for _, t in pod_templates(w)
    )


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def alert_job_names() -> set[str]:
    """The scrape job names alerts/kvguard.rules.yaml selects on (job="...")."""
    rules = yaml.safe_load((REPO / generate.RULES_SRC).read_text())
    exprs = " ".join(str(r.get("expr", "")) for g in rules["groups"] for r in g.get("rules", []))
    return set(re.findall(r'\bjob\s*=\s*"([^"]+)"', exprs))


def cross_problems(objs: list[dict]) -> list[str]:
    """Across objects of one rendered set: names, references, selectors, monitoring."""
    p = []
    seen = {}
    for o in objs:
        key = (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])
        if key in seen:
            p.append(f"{kn(o)}: defined twice")
        seen[key] = o
    by_kind: dict[str, dict[str, dict]] = {}
    for o in objs:
        by_kind.setdefault(o["kind"], {})[o["metadata"]["name"]] = o
    secrets, configmaps = by_kind.get("Secret", {}), by_kind.get("ConfigMap", {})

    def keys(o):
        return set(o.get("data", {})) | set(o.get("stringData", {}))

    workloads = [o for o in objs if o["kind"] in WORKLOAD_KINDS]
    for w, tpl in [(o, t) for o in workloads for _, t in pod_templates(o)]:
        pod = tpl["spec"]
        for v in pod.get("volumes", []):
            if "secret" in v:
                s = secrets.get(v["secret"]["secretName"])
                if s is None:
                    p.append(f"{kn(w)}: volume {v['name']} needs Secret {v['secret']['secretName']}, not deployed")
                else:
                    for item in v["secret"].get("items", []):
                        if item["key"] not in keys(s):
                            p.append(f"{kn(w)}: Secret {kn(s)} has no key {item['key']!r}")
            if "configMap" in v and v["configMap"]["name"] not in configmaps:
                p.append(f"{kn(w)}: volume {v['name']} needs ConfigMap {v['configMap']['name']}, not deployed")
        for c in _all_containers(pod):
            for e in c.get("env", []):
                for ref_kind, pool in (("configMapKeyRef", configmaps), ("secretKeyRef", secrets)):
                    ref = e.get("valueFrom", {}).get(ref_kind)
                    if ref and not ref.get("optional"):
                        o = pool.get(ref["name"])
                        if o is None:
                            p.append(f"{kn(w)}: {c['name']} env {e['name']} needs {ref_kind[:-6]} {ref['name']}")
                        elif ref["key"] not in keys(o):
                            p.append(f"{kn(w)}: {c['name']} env {e['name']}: {kn(o)} has no key {ref['key']!r}")
    templates = [(name, tpl) for w in workloads for name, tpl in pod_templates(w)]
    for s in by_kind.get("Service", {}).values():
        sel = s["spec"].get("selector", {})
        pods = [(n, t) for n, t in templates if _selects(sel, t.get("metadata", {}).get("labels", {}))]
        if not pods:
            p.append(f"{kn(s)}: selector {sel} matches no pod template")
        for n, t in pods:
            names = {pt.get("name") for c in t["spec"]["containers"] for pt in c.get("ports", [])}
            init_names = {pt.get("name") for c in t["spec"].get("initContainers", []) for pt in c.get("ports", [])}
            for port in s["spec"].get("ports", []):
                tp = port.get("targetPort")
                if isinstance(tp, str) and tp in init_names - names:
                    p.append(
                        f"{kn(s)}: targetPort {tp!r} names a port of an init container (the native sidecar) in {n}: "
                        f"Kubernetes before 1.32 leaves it out of the endpoints (kubernetes/kubernetes#127958); "
                        f"use the port number"
                    )
                elif isinstance(tp, str) and tp not in names:
                    p.append(f"{kn(s)}: targetPort {tp!r} is not a port of {n}")
    p += network_policy_problems(by_kind.get("NetworkPolicy", {}).values(), workloads)
    p += disruption_budget_problems(by_kind.get("PodDisruptionBudget", {}).values(), workloads)
    p += ledger_problems(configmaps.get("kvguard-config"), by_kind, workloads)
    p += router_problems(workloads, by_kind.get("Service", {}))
    jobs = alert_job_names()
    for sm in by_kind.get("ServiceMonitor", {}).values():
        sel = sm["spec"]["selector"].get("matchLabels", {})
        services = [s for s in by_kind.get("Service", {}).values() if _selects(sel, s["metadata"].get("labels", {}))]
        if not services and workloads:
            p.append(f"{kn(sm)}: selects no Service")
        for s in services:
            ports = {pt.get("name") for pt in s["spec"].get("ports", [])}
            for ep in sm["spec"]["endpoints"]:
                if ep.get("port") and ep["port"] not in ports:
                    p.append(f"{kn(sm)}: endpoint port {ep['port']!r} is not a port of {kn(s)}")
            job = s["metadata"].get("labels", {}).get(sm["spec"].get("jobLabel", ""), s["metadata"]["name"])
            if jobs and job not in jobs:
                p.append(
                    f"{kn(sm)}: scrapes {kn(s)} as job={job!r}; alerts/kvguard.rules.yaml expects job={sorted(jobs)}"
                )
            if not s["spec"].get("publishNotReadyAddresses"):
                p.append(
                    f"{kn(s)}: publishNotReadyAddresses should be true (an unready sidecar must still be "
                    f"scraped, not vanish from the targets)"
                )
    return p


def _allows(rule: dict, port: int, protocol: str = "TCP") -> bool:
    ports = rule.get("ports")
    if not ports:
        return True  # a rule without ports allows every port
    for pt in ports:
        if pt.get("protocol", "TCP") != protocol:
            continue
        if "port" not in pt:
            return True
        if isinstance(pt["port"], int) and pt["port"] <= port <= pt.get("endPort", pt["port"]):
            return True
    return False


def network_policy_problems(policies, workloads) -> list[str]:
    """The NetworkPolicy selecting the watched pods: the sidecar's port is not open to
    everyone, and every port the engine container declares still is (a policy that selects
    a pod is an allow-list for all its ports: forgetting one cuts the engine off)."""
    p = []
    for name, tmpl in ((name, t) for w in workloads for name, t in pod_templates(w)):
        labels = tmpl["metadata"].get("labels", {})
        if labels.get(WATCHED) != "true":
            continue  # other pods' policies (the ledger's Redis): ledger_problems
        selecting = [
            np_
            for np_ in policies
            if _selects(np_["spec"]["podSelector"].get("matchLabels", {}), labels)
            and "Ingress" in np_["spec"].get("policyTypes", ["Ingress"])
        ]
        if not selecting:
            continue
        rules = [r for np_ in selecting for r in np_["spec"].get("ingress", [])]
        open_rules = [r for r in rules if not r.get("from")]
        for c in _all_containers(tmpl["spec"]):
            for pt in c.get("ports", []):
                port, proto = pt["containerPort"], pt.get("protocol", "TCP")
                anyone = any(_allows(r, port, proto) for r in open_rules)
                if c["name"] == SIDECAR and anyone:
                    p.append(f"{name}: a NetworkPolicy opens the sidecar's port {port} to everyone")
                elif c["name"] == SIDECAR and pt.get("name") == "health":
                    continue  # the probes' port: the node's kubelet reaches it whatever the policy says
                elif c["name"] == SIDECAR and not any(_allows(r, port, proto) for r in rules):
                    p.append(f"{name}: no NetworkPolicy rule lets Prometheus reach the sidecar's port {port}")
                elif c["name"] != SIDECAR and not anyone:
                    p.append(f"{name}: the NetworkPolicy cuts {c['name']}'s port {port} off")
    return p


def _replicas(w: dict) -> int:
    return int(w["spec"].get("replicas", 1))


def disruption_budget_problems(pdbs, workloads) -> list[str]:
    """Each PodDisruptionBudget selects pods, and lets a node drain evict at least one of them."""
    p = []
    for pdb in pdbs:
        sel = pdb["spec"].get("selector", {}).get("matchLabels", {})
        chosen = [
            w for w in workloads for _, t in pod_templates(w) if _selects(sel, t.get("metadata", {}).get("labels", {}))
        ]
        if not sel or not chosen:
            p.append(f"{kn(pdb)}: selector {sel} matches no pod template")
            continue
        replicas = sum(_replicas(w) for w in chosen)
        min_avail, max_unavail = pdb["spec"].get("minAvailable"), pdb["spec"].get("maxUnavailable")
        if (isinstance(min_avail, int) and min_avail >= replicas) or max_unavail in (0, "0%"):
            p.append(
                f"{kn(pdb)}: allows no eviction of its {replicas} pod(s) ({', '.join(kn(w) for w in chosen)}): "
                f"every node drain stops there until someone deletes a pod by hand"
            )
    return p


def _redis_host(url: str) -> tuple[str, int] | None:
    m = re.fullmatch(r"rediss?://(?:[^@/]*@)?([^:/]+)(?::(\d+))?(?:/.*)?", url or "")
    return (m.group(1), int(m.group(2) or 6379)) if m else None


def ledger_problems(config: dict | None, by_kind: dict, workloads: list[dict]) -> list[str]:
    """The Redis ledger KVGUARD_LEDGER names, when it is in this namespace (a bare Service name):
    the Service exists with that port, selects a pod, and the sidecars may reach it."""
    url = (config or {}).get("data", {}).get("KVGUARD_LEDGER", "memory")
    hp = _redis_host(url)
    if hp is None or "." in hp[0]:
        return []  # the in-memory ledger, or a Redis outside this namespace: the operator's
    host, port = hp
    svc = by_kind.get("Service", {}).get(host)
    if svc is None:
        return [f"kvguard-config KVGUARD_LEDGER={url}: no Service {host!r} here (deploy/redis, or an external URL)"]
    sp = next((pt for pt in svc["spec"].get("ports", []) if pt["port"] == port), None)
    if sp is None:
        return [f"kvguard-config KVGUARD_LEDGER={url}: Service {host} has no port {port}"]
    p = []
    targets = [
        t
        for w in workloads
        for _, t in pod_templates(w)
        if _selects(svc["spec"].get("selector", {}), t.get("metadata", {}).get("labels", {}))
    ]
    for t in targets:
        labels = t["metadata"].get("labels", {})
        tp = sp.get("targetPort", port)
        cport = next(
            (
                pt["containerPort"]
                for c in t["spec"]["containers"]
                for pt in c.get("ports", [])
                if tp in (pt.get("name"), pt["containerPort"])
            ),
            None,
        )
        policies = [
            np_
            for np_ in by_kind.get("NetworkPolicy", {}).values()
            if _selects(np_["spec"]["podSelector"].get("matchLabels", {}), labels)
            and "Ingress" in np_["spec"].get("policyTypes", ["Ingress"])
        ]
        if cport is None or not policies:
            continue
        rules = [r for np_ in policies for r in np_["spec"].get("ingress", [])]

        def from_sidecars(rule):
            return not rule.get("from") or any(
                "namespaceSelector" not in f
                and _selects(f.get("podSelector", {}).get("matchLabels", {}), {WATCHED: "true"})
                for f in rule["from"]
            )

        if not any(from_sidecars(r) and _allows(r, cport) for r in rules):
            p.append(f"NetworkPolicy: no rule lets the sidecars ({WATCHED}) reach the ledger's Redis port {cport}")
        if any(not r.get("from") and _allows(r, cport) for r in rules):
            p.append(f"NetworkPolicy: the ledger's Redis port {cport} is open to everyone (the sidecars alone need it)")
    return p


def _router_args(argv: list[str]):
    """sglang-router's own parser when installed; else --prefill URL [PORT] / --decode URL by hand."""
    try:
        from sglang_router.launch_router import parse_router_args
    except ImportError:
        prefill, decode = [], []
        for i, a in enumerate(argv):
            if a == "--prefill":
                port = argv[i + 2] if i + 2 < len(argv) and argv[i + 2].isdigit() else None
                prefill.append((argv[i + 1], int(port) if port else None))
            elif a == "--decode":
                decode.append(argv[i + 1])
        return prefill, decode
    import contextlib
    import io

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            a = parse_router_args(argv)
    except SystemExit as exc:
        raise ValueError(f"`{' '.join(argv)}` does not parse (exit {exc.code})") from None
    return list(a.prefill_urls), list(a.decode_urls)


def router_problems(workloads: list[dict], services: dict[str, dict]) -> list[str]:
    """SGLang's router: its command line parses (sglang-router's parser), and each worker URL is a
    Service here with that port, in front of an engine of that role; the prefill's bootstrap port
    too. Its `kvguard preflight` init container (kvguard's parser): each --url a Service here."""
    p = []
    for w in workloads:
        for name, tpl in pod_templates(w):
            for c in tpl["spec"].get("initContainers", []):  # the deploy gate: `kvguard preflight`
                if c.get("args", [None])[0] != "preflight":
                    continue
                try:
                    urls = sidecar_args(c).url or []
                except ValueError as exc:
                    p.append(f"{name}: {c['name']}: {exc}")
                    continue
                for url in urls:
                    m = re.fullmatch(r"https?://([^:/]+)(?::(\d+))?/?", url)
                    svc = services.get(m.group(1)) if m else None
                    if svc is None or int(m.group(2) or 80) not in {pt["port"] for pt in svc["spec"].get("ports", [])}:
                        p.append(f"{name}: {c['name']} checks {url}: no Service here with that name and port")
            for c in tpl["spec"]["containers"]:
                argv = _argv(c)
                if "sglang_router.launch_router" not in argv:
                    continue
                try:
                    prefill, decode = _router_args(argv[argv.index("sglang_router.launch_router") + 1 :])
                except ValueError as exc:
                    p.append(f"{name}: router command: {exc}")
                    continue
                for role, url, bootstrap in [("prefill", u, b) for u, b in prefill] + [
                    ("decode", u, None) for u in decode
                ]:
                    m = re.fullmatch(r"https?://([^:/]+)(?::(\d+))?/?", url)
                    svc = services.get(m.group(1)) if m else None
                    if svc is None:
                        p.append(f"{name}: router {role} worker {url}: no Service of that name here")
                        continue
                    ports = {pt["port"] for pt in svc["spec"].get("ports", [])}
                    for want in (int(m.group(2) or 80), bootstrap):
                        if want is not None and want not in ports:
                            p.append(f"{name}: router {role} worker {url}: Service {kn(svc)} has no port {want}")
                    engines = [
                        _engine(t["spec"])
                        for o in workloads
                        for _, t in pod_templates(o)
                        if _selects(svc["spec"].get("selector", {}), t.get("metadata", {}).get("labels", {}))
                    ]
                    if not any(e is not None and engine_role(e) == role for e in engines):
                        p.append(f"{name}: router {role} worker {url}: {kn(svc)} selects no {role} engine")
    return p


def generated_problems(objs: list[dict]) -> list[str]:
    """The rendered PrometheusRule and dashboard ConfigMaps against alerts/ and dashboards/ (semantically)."""
    p = []
    rules = yaml.safe_load((REPO / generate.RULES_SRC).read_text())
    prs = [o for o in objs if o["kind"] == "PrometheusRule"]
    if len(prs) != 1:
        p.append(f"expected one PrometheusRule, found {len(prs)}")
    for pr in prs:
        if pr["spec"]["groups"] != rules["groups"]:
            p.append(f"{kn(pr)}: spec.groups differ from {generate.RULES_SRC}: run python3 deploy/generate.py")
    dash_dir = REPO / generate.DASHBOARDS_SRC
    want = {}
    for rel in generate.dashboard_sources(dash_dir):
        text = (dash_dir / rel).read_text(encoding="utf-8")
        if generate.is_dashboard(json.loads(text)):
            want[f"{generate.DASHBOARDS_SRC}/{rel.as_posix()}"] = text
    got = {}
    for o in objs:
        if o["kind"] == "ConfigMap" and o["metadata"].get("labels", {}).get("grafana_dashboard") is not None:
            if o["metadata"]["labels"]["grafana_dashboard"] != "1":
                p.append(f'{kn(o)}: label grafana_dashboard must be "1"')
            src = o["metadata"].get("annotations", {}).get("kvguard.io/generated-from")
            (data,) = o["data"].values() if len(o.get("data", {})) == 1 else (None,)
            got[src] = data
    for src in sorted(set(want) | set(got)):
        if src not in got:
            p.append(f"{src}: no dashboard ConfigMap deployed for it: run python3 deploy/generate.py")
        elif src not in want:
            p.append(f"dashboard ConfigMap from {src}: that dashboard does not exist: run python3 deploy/generate.py")
        elif got[src] != want[src]:
            p.append(f"dashboard ConfigMap from {src}: content differs from the file: run python3 deploy/generate.py")
    return p


def promtool_problems(objs: list[dict]) -> list[str] | None:
    """`promtool check rules` on each PrometheusRule's groups; None when promtool is missing."""
    if not shutil.which("promtool"):
        return None
    p = []
    for pr in (o for o in objs if o["kind"] == "PrometheusRule"):
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            yaml.safe_dump({"groups": pr["spec"]["groups"]}, f, sort_keys=False)
        try:
            proc = subprocess.run(["promtool", "check", "rules", f.name], capture_output=True, text=True)
        finally:
            os.unlink(f.name)
        if proc.returncode != 0:
            p.append(f"{kn(pr)}: promtool check rules: {(proc.stdout + proc.stderr).strip()[-800:]}")
    return p


def image_problems(objs: list[dict], by_digest: bool = False) -> list[str]:
    """Every container's image pinned: a tag other than latest, or a digest; by_digest (the
    release overlay): a digest, which no push can move."""
    p = []
    for o in objs:
        for name, tpl in pod_templates(o):
            for c in _all_containers(tpl["spec"]):
                ref = c.get("image", "")
                if by_digest and not re.search(r"@sha256:[0-9a-f]{64}$", ref):
                    p.append(f"{name}: container {c['name']} image {ref!r} is not pinned by digest (@sha256:...)")
                elif not _image_pinned(ref):
                    p.append(
                        f"{name}: container {c['name']} image {ref!r} is not pinned (a tag other than latest, or a digest)"
                    )
    return p


def component_pieces() -> dict:
    """What the kvguard Component adds: its sidecar.yaml (the local-config pod template) and the
    pod-level settings of its Deployment patch."""
    doc = yaml.safe_load((COMPONENT / "sidecar.yaml").read_text())
    spec = doc["template"]["spec"]
    (engine,) = spec["containers"]
    kust = yaml.safe_load((COMPONENT / "kustomization.yaml").read_text())
    (deployment_patch,) = [p for p in kust["patches"] if p["target"]["kind"] == "Deployment"]
    pod = yaml.safe_load(deployment_patch["patch"])["spec"]["template"]
    return {
        "labels": pod["metadata"]["labels"],
        "pod": {k: v for k, v in pod["spec"].items() if k != "securityContext"},
        "securityContext": pod["spec"]["securityContext"],
        "initContainers": {c["name"]: c for c in spec["initContainers"]},
        "volumes": {v["name"]: v for v in spec["volumes"]},
        "env": {e["name"]: e for e in engine["env"]},
        "volumeMounts": {m["name"]: m for m in engine["volumeMounts"]},
    }


def component_problems(objs: list[dict]) -> list[str]:
    """In every pod the Component selects (a workload labelled kvguard.io/watched, a
    LeaderWorkerSet's leader when also kvguard.io/watched-leader), every piece of its
    sidecar.yaml and of its pod-level patch arrived as written (the sidecar's image and env
    may be set on top)."""
    want = component_pieces()
    p = []
    for o in objs:
        labels = o["metadata"].get("labels", {})
        if o["kind"] not in ("Deployment", "LeaderWorkerSet") or labels.get(WATCHED) != "true":
            continue
        for name, tpl in pod_templates(o):
            if name.endswith("leaderTemplate") and labels.get("kvguard.io/watched-leader") != "true":
                p.append(f'{name}: not watched: label the LeaderWorkerSet kvguard.io/watched-leader: "true" too')
                continue
            pod, missing = tpl["spec"], []
            for k, v in want["labels"].items():
                if tpl.get("metadata", {}).get("labels", {}).get(k) != v:
                    missing.append(f"label {k}")
            for k, v in want["pod"].items():
                if pod.get(k) != v:
                    missing.append(k)
            for k, v in want["securityContext"].items():
                if pod.get("securityContext", {}).get(k) != v:
                    missing.append(f"securityContext.{k}")
            inits = {c["name"]: c for c in pod.get("initContainers", [])}
            for n, c in want["initContainers"].items():
                got = inits.get(n, {})
                same = {k: v for k, v in got.items() if k not in ("image", "env")} == {
                    k: v for k, v in c.items() if k not in ("image", "env")
                }
                if not same or not all(e in got.get("env", []) for e in c.get("env", [])):
                    missing.append(f"initContainers[{n}]")
            vols = {v["name"]: v for v in pod.get("volumes", [])}
            missing += [f"volumes[{n}]" for n, v in want["volumes"].items() if vols.get(n) != v]
            eng = (pod.get("containers") or [{}])[0]
            env = {e["name"]: e for e in eng.get("env", [])}
            missing += [f"containers[0].env[{n}]" for n, e in want["env"].items() if env.get(n) != e]
            mounts = {m["name"]: m for m in eng.get("volumeMounts", [])}
            missing += [
                f"containers[0].volumeMounts[{n}]" for n, m in want["volumeMounts"].items() if mounts.get(n) != m
            ]
            if missing:
                p.append(f"{name}: the kvguard Component's {', '.join(missing)} did not arrive as written")
    return p


# --------------------------------------------------------------------------- Dockerfiles
def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, buf = [], ""
    for line in path.read_text(encoding="utf-8").splitlines():
        s = line.strip()
        if not buf and (not s or s.startswith("#")):
            continue
        if buf and s.startswith("#"):
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        buf += s
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def _shell_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line, as token lists (split at &&, ||, ;, |)."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    cmds, cur = [], []
    for tok in lex:
        if tok in ("&&", "||", ";", "|", "&"):
            cmds.append(cur)
            cur = []
        else:
            cur.append(tok)
    return [c for c in cmds + [cur] if c]


def _image_pinned(ref: str) -> bool:
    if "@sha256:" in ref:
        return True
    last = ref.rsplit("/", 1)[-1]
    return ":" in last and last.rsplit(":", 1)[1] not in ("", "latest")


def dockerfile_problems(which: str) -> list[str]:
    path = DOCKERFILES[which]
    rel = path.relative_to(REPO)
    if not path.exists():
        return [f"{rel}: missing"]
    p = []
    ins = dockerfile_instructions(path)
    args: dict[str, str | None] = {}
    stages = []
    for word, rest in ins:
        if word == "ARG" and not stages:
            k, sep, v = rest.partition("=")
            args[k.strip()] = v.strip() if sep else None
        elif word == "FROM":
            stages.append([(word, rest)])
        elif stages:
            stages[-1].append((word, rest))
    if re.search(r"(?i)[:\s]latest\b", path.read_text()):
        p.append(f"{rel}: mentions a `latest` tag")
    for stage in stages:
        ref = stage[0][1].split()[0]
        m = re.fullmatch(r"\$\{?(\w+)\}?", ref)
        if m:
            default = args.get(m.group(1), "")
            if default is None:
                if which == "engine" and m.group(1) == "SGLANG_IMAGE":
                    continue  # must be given: the engine image the operator already runs
                p.append(f"{rel}: FROM {ref}: ARG {m.group(1)} has no default")
                continue
            ref = default
        if not _image_pinned(ref):
            p.append(f"{rel}: FROM {ref}: not pinned (a tag other than latest, or a digest)")
    final = stages[-1] if stages else []
    text_final = " ".join(r for _, r in final)
    if re.search(r"apt-get\s+install|apk\s+add|build-essential|\bgcc\b", text_final):
        p.append(f"{rel}: the final stage installs build tools or OS packages")
    for word, rest in final:
        if word != "RUN":
            continue
        for toks in _shell_commands(rest):
            cmd = " ".join(toks)
            if "pip" in toks[:3] and "install" in toks:
                if "--no-deps" not in toks:
                    p.append(f"{rel}: `{cmd.strip()}` without --no-deps (versions must come from the pins)")
                after = toks[toks.index("install") + 1 :]
                skip_next = False
                for t in after:
                    if skip_next:
                        skip_next = False
                        continue
                    if t in ("-r", "--requirement", "-c", "--constraint", "--target", "--index-url"):
                        skip_next = True
                        continue
                    if t.startswith("-") or t.endswith(".whl") or "*" in t or t.startswith("/"):
                        continue
                    if "==" not in t:
                        p.append(f"{rel}: pip installs {t!r} without an exact version")
    if which == "sidecar":
        users = [r for w, r in final if w == "USER"]
        uid = users[-1].split(":")[0] if users else None
        if not uid or not uid.isdigit() or int(uid) == 0:
            p.append(f"{rel}: the final stage needs USER <numeric non-root uid> (runAsNonRoot verifies numeric ids)")
        ep = [r for w, r in final if w == "ENTRYPOINT"]
        if not ep or json.loads(ep[-1]) != ["kvguard"]:
            p.append(f'{rel}: ENTRYPOINT must be ["kvguard"]')
        p += sidecar_requirements_problems()
    else:
        lock = _pins(ENGINE_LOCK)
        for m in re.finditer(r"xxhash==([\w.]+)", path.read_text()):
            if m.group(1) != lock.get("xxhash"):
                p.append(f"{rel}: xxhash=={m.group(1)}, the tests run with xxhash=={lock.get('xxhash')}")
        if "lmsysorg/sglang:<tag>" not in path.read_text():
            p.append(f"{rel}: the three-line snippet (FROM lmsysorg/sglang:<tag>) is missing")
    p += dockerignore_problems(path, stages)
    return p


def dockerignore_problems(path: Path, stages) -> list[str]:
    """Every COPY source is admitted by the Dockerfile's own allow-list .dockerignore."""
    ignore = path.with_name(path.name + ".dockerignore")
    rel = ignore.relative_to(REPO)
    if not ignore.exists():
        return [f"{rel}: missing (the build context is the repository root, .venv included)"]
    lines = [s.strip() for s in ignore.read_text().splitlines() if s.strip() and not s.startswith("#")]
    if not lines or lines[0] != "*":
        return [f"{rel}: should start with `*` (an allow-list)"]
    allowed = [s[1:].rstrip("/") for s in lines if s.startswith("!")]
    p = []
    for stage in stages:
        for word, rest in stage:
            if word != "COPY" or "--from" in rest:
                continue
            srcs = [t for t in shlex.split(rest) if not t.startswith("--")][:-1]
            for src in srcs:
                src = src.rstrip("/")
                if not any(src == a or src.startswith(a + "/") for a in allowed):
                    p.append(f"{rel}: COPY {src} is not admitted by the allow-list")
                if not (REPO / src).exists():
                    p.append(f"{path.relative_to(REPO)}: COPY {src}: no such file in the repository")
    return p


def sidecar_closure() -> dict[str, str]:
    """kvguard[sidecar]'s dependency closure on this Python: name -> installed version.

    kvguard's own requirements come from pyproject.toml (not the possibly stale installed
    metadata); the rest from the installed distributions' metadata, markers evaluated.
    """
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    roots = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["sidecar"]]
    out: dict[str, str] = {}
    todo = list(roots)
    while todo:
        req = todo.pop()
        name = _norm(req.name)
        if name in out:
            continue
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            out[name] = "NOT INSTALLED"
            continue
        out[name] = dist.version
        for r in map(Requirement, dist.requires or []):
            if (
                r.marker is None
                or r.marker.evaluate({"extra": ""})
                or any(r.marker.evaluate({"extra": e}) for e in req.extras)
            ):
                todo.append(r)
    return out


def sidecar_requirements_problems() -> list[str]:
    rel = SIDECAR_REQUIREMENTS.relative_to(REPO)
    try:
        pinned = _pins(SIDECAR_REQUIREMENTS)
    except (OSError, ValueError) as exc:
        return [f"{rel}: {exc}"]
    closure = sidecar_closure()
    p = []
    for name in sorted(set(pinned) | set(closure)):
        if name not in pinned:
            p.append(f"{rel}: {name} (a dependency of kvguard[sidecar]) is not pinned; the venv has {closure[name]}")
        elif name not in closure:
            p.append(f"{rel}: {name}=={pinned[name]} is not in kvguard[sidecar]'s dependency closure")
        elif pinned[name] != closure[name]:
            p.append(f"{rel}: {name}=={pinned[name]}, but the tests run with {closure[name]}")
    return p


def lock_problems() -> list[str]:
    """requirements/deploy.lock pins what engine.lock also pins at the same versions."""
    deploy, engine = _pins(DEPLOY_LOCK), _pins(ENGINE_LOCK)
    return [
        f"requirements/deploy.lock: {n}=={v} but requirements/engine.lock has {engine[n]}"
        for n, v in deploy.items()
        if n in engine and engine[n] != v
    ]


# --------------------------------------------------------------------------- all of it
def run_all(verbose: bool = True) -> int:
    t0 = time.monotonic()
    failures = 0

    def section(title: str, problems: list[str] | None, skip_reason: str = "") -> None:
        nonlocal failures
        if problems is None:
            print(f"SKIP  {title}: {skip_reason}")
            return
        failures += bool(problems)
        print(f"{'FAIL' if problems else 'ok  '}  {title}")
        for line in problems:
            print(f"      - {line}")

    if verbose:
        for k, v in tool_versions().items():
            print(f"tool  {k}: {v}")
    section("generated files match alerts/ and dashboards/ (deploy/generate.py --check)", generate.check(REPO))
    section("requirements/deploy.lock agrees with requirements/engine.lock", lock_problems())
    rendered = render_all()
    for name, objs in rendered.items():
        kinds = ", ".join(sorted(kn(o) for o in objs))
        section(f"kustomize build {name}: {len(objs)} objects: {kinds}", [])
        if name != "all":
            section(f"schemas {name} (Kubernetes {', '.join(K8S_VERSIONS)}, strict)", schema_problems(objs))
        for w in (o for o in objs if o["kind"] in WORKLOAD_KINDS and _is_watched(o)):
            section(f"pod contract {name} {kn(w)}", pod_problems(w))
        if any(o["metadata"].get("labels", {}).get(WATCHED) == "true" for o in objs if o["kind"] in WORKLOAD_KINDS):
            section(f"the kvguard Component arrived whole {name}", component_problems(objs))
        by_digest = name in (RELEASE, "all")
        section(f"images pinned{' by digest' if by_digest else ''} {name}", image_problems(objs, by_digest))
    section(
        "references across common + the release (all): Secrets, ConfigMaps, Services, NetworkPolicies, "
        "PodDisruptionBudgets, the Redis ledger, the router's workers",
        cross_problems(rendered["all"]),
    )
    section("PrometheusRule and dashboards match their sources (rendered)", generated_problems(rendered["common"]))
    promtool = promtool_problems(rendered["common"])
    section("promtool check rules (PrometheusRule groups)", promtool, "promtool not installed (make apt)")
    for which in DOCKERFILES:
        section(f"Dockerfile {which} (static)", dockerfile_problems(which))
    print(f"deploy-check: {'FAILED' if failures else 'passed'} in {time.monotonic() - t0:.1f} s")
    return 1 if failures else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--render", choices=[*TARGETS, "all"], help="print one rendered target and exit")
    ap.add_argument("-q", "--quiet", action="store_true", help="no tool versions")
    args = ap.parse_args(argv)
    try:
        if args.render:
            print(yaml.safe_dump_all(render_all()[args.render], sort_keys=False), end="")
            return 0
        return run_all(verbose=not args.quiet)
    except (ToolMissing, RuntimeError, generate.GenerateError) as exc:
        print(f"deploy-check: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
