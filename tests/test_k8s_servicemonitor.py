"""`deploy.service_monitor` (issue 34, item 4): the k8s overlay's optional Prometheus Operator
ServiceMonitor selects exactly the rendered metrics Services, on their port `metrics`, and each of those
Services selects exactly one role's pods, whose container serves `/metrics` on that port (the port the
pod's RLBUS_METRICS_PORT names). Off by default: no CRD object Prometheus Operator must know.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from rlbus.deploy import k8s
from schemas.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.toml"
RUN = "exp-7"
KUBE_VERSION = "1.31.0"


def _render(tmp_path: Path, *sets: str) -> Path:
    out = tmp_path / "k8s"
    k8s.render(load_config(DEMO, list(sets)), RUN, out, image="rlbus:test")
    return out


def _objects(out: Path) -> list[dict]:
    docs = []
    for path in sorted(out.rglob("*.yaml")):
        if path.name not in ("kustomization.yaml", "values.yaml"):
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_off_by_default(tmp_path):
    out = _render(tmp_path)
    assert not (out / "overlays" / RUN / "metrics.yaml").exists()
    assert not [d for d in _objects(out) if d["kind"] == "ServiceMonitor"]


def test_service_monitor_selects_the_metrics_services_and_ports(tmp_path):
    out = _render(
        tmp_path,
        "deploy.service_monitor=true",
        "deploy.metrics_port=9200",
        'deploy.service_monitor_labels={release="kps"}',
        "deploy.service_monitor_interval=15s",
    )
    overlay = out / "overlays" / RUN
    assert "metrics.yaml" in yaml.safe_load((overlay / "kustomization.yaml").read_text())["resources"]
    docs = _objects(out)
    (sm,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "kps"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["rlbus"]}
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint == {"port": "metrics", "path": "/metrics", "interval": "15s"}

    selected = [
        d
        for d in docs
        if d["kind"] == "Service" and _matches(sm["spec"]["selector"]["matchLabels"], d["metadata"]["labels"])
    ]
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    serving = {  # role -> its pods' labels, for every workload whose container has a `metrics` port
        w["metadata"]["labels"]["app.kubernetes.io/component"]: w["spec"]["template"]["metadata"]["labels"]
        for w in workloads
        for c in w["spec"]["template"]["spec"]["containers"]
        if any(p["name"] == "metrics" for p in c.get("ports", []))
    }
    assert set(serving) >= {"sampler", "rollout", "verifier", "sandbox", "scheduler", "learner"}
    assert "nats" not in serving  # its monitoring port serves /jsz, not Prometheus text
    covered = set()
    for svc in selected:
        (port,) = [p for p in svc["spec"]["ports"] if p["name"] == endpoint["port"]]
        assert port["port"] == 9200 and port["targetPort"] == "metrics"
        pods = [role for role, pod_labels in serving.items() if _matches(svc["spec"]["selector"], pod_labels)]
        assert len(pods) == 1, (svc["metadata"]["name"], pods)  # one role's pods per Service
        covered.add(pods[0])
        (w,) = [w for w in workloads if w["metadata"]["labels"]["app.kubernetes.io/component"] == pods[0]]
        (ctr,) = w["spec"]["template"]["spec"]["containers"]
        assert {"name": "metrics", "containerPort": 9200} in ctr["ports"]
        assert {"name": "RLBUS_METRICS_PORT", "value": "9200"} in ctr["env"]
    assert covered == set(serving)  # every role's pods are scraped, each once
    assert len(selected) == len(serving)


def test_metrics_services_validate_and_kustomize(tmp_path):
    out = _render(tmp_path, "deploy.service_monitor=true")
    services = [d for d in _objects(out) if d["kind"] == "Service" and d["metadata"]["name"].endswith("-metrics")]
    assert services
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]' (kubernetes-validate)")
    for svc in services:
        kv.validate(svc, KUBE_VERSION, strict=True)
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (Debian: apt-get install kubectl)")
    proc = subprocess.run(
        ["kubectl", "kustomize", str(out / "overlays" / RUN)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(proc.stdout) if d]
    assert kinds.count("ServiceMonitor") == 1


def test_bad_interval_is_refused():
    with pytest.raises(Exception, match="service_monitor_interval"):
        load_config(DEMO, ["deploy.service_monitor_interval=thirty"])
