"""The run's NATS on Kubernetes: a JetStream StatefulSet with cluster routes, its per-role users, the
Secret of their passwords, and `values.yaml` for the official NATS Helm chart.

Guarantees:
- The server config (a ConfigMap) holds `bus.auth.server_auth_config([run_id])`: every role user with
  its allow-only permissions and `$RLBUS_NATS_PASSWORD_<USER>` references, never a password. The
  passwords live only in the Secret, which the server pods read as environment.
- Each server's `server_name` is its pod name and the monitoring port 8222 is served on the headless
  Service, so `<pod>.<headless service>:8222` reaches one node (KEDA queries a clustered consumer's
  leader that way).
- Passwords are generated once per output folder (`nats-passwords.env`, mode 0600, kept when present,
  like `rlbus.natsauth write-env`), so rendering again never locks out a running server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bus.auth import USERS, password_env, server_auth_config
from rlbus.deploy.k8s_objects import labels, meta
from rlbus.natsauth import read_env, write_env_file

CLIENT, ROUTES, MONITOR = 4222, 6222, 8222


def _nats_size(quantity: str) -> str:
    """A Kubernetes quantity (`10Gi`) as a nats-server size (`10G`: nats counts in powers of 1024)."""
    for suffix in ("Ki", "Mi", "Gi", "Ti"):
        if quantity.endswith(suffix):
            return quantity[: -len(suffix)] + suffix[0]
    return quantity


def nats_conf(ctx) -> str:
    """nats-server config of every node (env POD_NAME names the node)."""
    d = ctx.deploy
    lines = [
        "# rendered by `rlbus k8s render`: no secret here (passwords are $RLBUS_NATS_PASSWORD_<USER> env)",
        "server_name: $POD_NAME",
        f"listen: 0.0.0.0:{CLIENT}",
        f"http: 0.0.0.0:{MONITOR}",
        "max_payload: 8MB",
        'write_deadline: "10s"',
        "jetstream {",
        "  store_dir: /data/jetstream",
        f"  max_file_store: {_nats_size(d.nats_storage)}",
        "}",
    ]
    if d.nats_replicas > 1:
        routes = [f"    nats-route://{ctx.nats_pod_host(i)}:{ROUTES}" for i in range(d.nats_replicas)]
        lines += ["cluster {", f"  name: {ctx.name('nats')}", f"  listen: 0.0.0.0:{ROUTES}", "  routes: ["]
        lines += routes + ["  ]", "}"]
    return "\n".join(lines) + "\n" + server_auth_config([ctx.run_id])


def passwords(out_dir: Path) -> dict[str, str]:
    """Every NATS user's password, from `out_dir/nats-passwords.env` (created 0600 when missing)."""
    path = out_dir / "nats-passwords.env"
    write_env_file(path)  # keeps existing passwords
    env = read_env(path)
    return {u: env[password_env(u)] for u in USERS}


def secret(ctx, pws: dict[str, str]) -> dict[str, Any]:
    """The Secret of every user's password (key `RLBUS_NATS_PASSWORD_<USER>`)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta(ctx.name("nats-auth"), ctx.run_id, "nats"),
        "type": "Opaque",
        "stringData": {password_env(u): pws[u] for u in USERS},
    }


def services(ctx) -> list[dict[str, Any]]:
    """The client Service (`<run>-nats:4222`) and the headless one (routes, monitoring, pod DNS)."""
    sel = labels(ctx.run_id, "nats")
    ports = [
        {"name": "client", "port": CLIENT},
        {"name": "cluster", "port": ROUTES},
        {"name": "monitor", "port": MONITOR},
    ]
    client = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(ctx.name("nats"), ctx.run_id, "nats"),
        "spec": {"selector": sel, "ports": [ports[0]]},
    }
    headless = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(ctx.nats_headless, ctx.run_id, "nats"),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": sel, "ports": ports},
    }
    return [client, headless]


def _nats_container(ctx) -> dict[str, Any]:
    from rlbus.deploy.k8s_objects import resources

    return {
        "name": "nats",
        "image": ctx.deploy.nats_image,
        "args": ["--config", "/etc/nats/nats.conf"],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "envFrom": [{"secretRef": {"name": ctx.name("nats-auth")}}],
        "ports": [
            {"name": "client", "containerPort": CLIENT},
            {"name": "cluster", "containerPort": ROUTES},
            {"name": "monitor", "containerPort": MONITOR},
        ],
        "resources": resources(ctx.deploy, "nats"),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/nats", "readOnly": True},
            {"name": "data", "mountPath": "/data"},
        ],
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "monitor"}, "periodSeconds": 30},
        "readinessProbe": {
            "httpGet": {"path": "/healthz?js-enabled-only=true", "port": "monitor"},
            "periodSeconds": 10,
        },
    }


def statefulset(ctx) -> dict[str, Any]:
    """`deploy.nats_replicas` JetStream servers, one PVC each, started in parallel (routes need peers)."""
    d = ctx.deploy
    claim: dict[str, Any] = {
        "metadata": {"name": "data", "labels": labels(ctx.run_id, "nats")},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": d.nats_storage}}},
    }
    if d.storage_class:
        claim["spec"]["storageClassName"] = d.storage_class
    pod = {
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 60,
        "securityContext": {"fsGroup": 1000},
        "containers": [_nats_container(ctx)],
        "volumes": [{"name": "config", "configMap": {"name": ctx.name("nats-config")}}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta(ctx.name("nats"), ctx.run_id, "nats"),
        "spec": {
            "serviceName": ctx.nats_headless,
            "replicas": d.nats_replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels(ctx.run_id, "nats")},
            "template": {"metadata": {"labels": labels(ctx.run_id, "nats")}, "spec": pod},
            "volumeClaimTemplates": [claim],
        },
    }


def config_map(ctx) -> dict[str, Any]:
    """The server config as a ConfigMap (users and permissions; no password)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(ctx.name("nats-config"), ctx.run_id, "nats"),
        "data": {"nats.conf": nats_conf(ctx)},
    }


def helm_values(ctx) -> str:
    """A documented `values.yaml` for the official chart (https://github.com/nats-io/k8s, chart `nats`)."""
    authz = server_auth_config([ctx.run_id]).rstrip("\n")
    indented = "\n".join("        " + line for line in authz.splitlines())  # deeper than the key `auth.conf: |` (6)
    d = ctx.deploy
    return f"""# values.yaml for the official NATS Helm chart: the production alternative to nats.yaml.
#   helm repo add nats https://nats-io.github.io/k8s/helm/charts/
#   helm install {ctx.name("nats")} nats/nats -n {ctx.namespace} -f values.yaml
# Then drop nats.yaml from kustomization.yaml; keep the Secret {ctx.name("nats-auth")} (nats-auth.yaml):
# the server reads every user's password from it as $RLBUS_NATS_PASSWORD_<USER>.
# The chart names its client Service after the release, so the roles' NATS_URL
# (nats://{ctx.name("nats")}:{CLIENT}) and KEDA's monitoring endpoint stay the same when the
# release is called {ctx.name("nats")}. Rendered by `rlbus k8s render` for run {ctx.run_id}.
# Its keys are checked against the chart's values.yaml (nats 2.14.2, tests/data/nats_chart_values_keys.txt);
# not installed here (no cluster, no helm): compare with `helm show values nats/nats` of your chart version.
config:
  cluster:
    enabled: {"true" if d.nats_replicas > 1 else "false"}
    replicas: {d.nats_replicas}          # 3 nodes: R3 streams survive one lost node
  jetstream:
    enabled: true
    fileStore:
      pvc:
        size: {d.nats_storage}
{("        storageClassName: " + d.storage_class) if d.storage_class else "        # storageClassName: default"}
  monitor:
    enabled: true      # /jsz for KEDA's nats-jetstream scaler; keep it inside the cluster
    port: {MONITOR}
  merge:
    # the per-role users of this run (bus.auth.server_auth_config), no secret inside:
    $include: auth.conf
configMap:
  merge:
    data:
      auth.conf: |
{indented}
container:
  merge:
    # every RLBUS_NATS_PASSWORD_<USER> from the run's Secret, as the server's environment
    envFrom:
      - secretRef:
          name: {ctx.name("nats-auth")}
"""
