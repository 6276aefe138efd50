"""Kubernetes objects of the rlbus roles, as plain dicts (YAML-ready).

Guarantees:
- Every pod runs the one rlbus image with `rlbus-entrypoint ROLE`, logs in as the role's own NATS user
  with its password read from a file of the run's Secret (never an env value, never a ConfigMap), and
  serves Prometheus `/metrics` on `deploy.metrics_port`.
- Probes: liveness is `rlbus-entrypoint health ROLE` (this pod's worker heartbeat is on the bus, the
  compose healthcheck); readiness is an HTTP GET of `/metrics`, which a worker serves once its session
  started.
- Metrics (`deploy.service_monitor`): one headless Service `<run>-<role>-metrics` per role whose pods
  serve `/metrics`, selecting exactly that role's pods, its port named `metrics`, and one Prometheus
  Operator ServiceMonitor selecting those Services (by `rlbus.io/metrics`) on that port name.
- Security: the roles that handle policy output without sandboxes run as uid 10001, non-root, no
  privilege escalation, every capability dropped, the runtime's seccomp profile; the three roles that
  open bwrap sandboxes (sandbox, verifier, scheduler) get what `docs/deploy.md` gives them in compose
  (root inside, seccomp and AppArmor unconfined, an unmasked /proc), and `deploy.sandbox_runtime_class`.
"""

from __future__ import annotations

from typing import Any

SANDBOX_ROLES = ("sandbox", "verifier", "scheduler")
"""Roles that open process (bwrap) sandboxes: root in the pod, unconfined seccomp/AppArmor, unmasked /proc."""
ROLE_UID = 10001
PASSWORD_DIR = "/run/secrets/nats"
CONFIG_DIR = "/etc/rlbus"
RUNS = "/runs"


def labels(run_id: str, component: str) -> dict[str, str]:
    """The labels every object of a run's component carries (selectors use them)."""
    return {"app.kubernetes.io/name": "rlbus", "app.kubernetes.io/component": component, "rlbus.io/run": run_id}


def meta(name: str, run_id: str, component: str, **extra: Any) -> dict[str, Any]:
    """`metadata` of an object (the namespace comes from the kustomization)."""
    return {"name": name, "labels": labels(run_id, component), **extra}


def resources(deploy, role: str, gpus: int = 0) -> dict[str, Any]:
    """`resources` of a role's container from `deploy.resources[role]`; `gpus` adds `nvidia.com/gpu`."""
    from schemas.config.deploy import RoleResources

    rr = deploy.resources.get(role) or RoleResources()
    limits: dict[str, Any] = {"memory": rr.memory_limit or rr.memory}
    if rr.cpu_limit:
        limits["cpu"] = rr.cpu_limit
    if gpus:
        limits["nvidia.com/gpu"] = gpus  # extended resources: a limit (the request follows it)
    return {"requests": {"cpu": rr.cpu, "memory": rr.memory}, "limits": limits}


def security_context(role: str) -> dict[str, Any]:
    """The container `securityContext` of a role (see the module guarantees)."""
    if role in SANDBOX_ROLES:
        return {
            "runAsUser": 0,
            "runAsGroup": 0,
            "privileged": False,
            "allowPrivilegeEscalation": False,
            "seccompProfile": {"type": "Unconfined"},
            "appArmorProfile": {"type": "Unconfined"},
            "procMount": "Unmasked",
        }
    return {
        "runAsUser": ROLE_UID,
        "runAsGroup": ROLE_UID,
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def role_env(ctx, role: str, user: str | None = None) -> list[dict[str, Any]]:
    """The environment of a role's container: the run, the NATS URL and login, the metrics port."""
    env = [
        {"name": "NATS_URL", "value": ctx.nats_url},
        {"name": "RLBUS_RUN_ID", "value": ctx.run_id},
        {"name": "RLBUS_RUN_DIR", "value": RUNS},
        {"name": "RLBUS_CONFIG", "value": f"{CONFIG_DIR}/config.json"},
        {"name": "RLBUS_STREAM_REPLICAS", "value": str(ctx.stream_replicas)},
        {"name": "RLBUS_NATS_USER", "value": user or role},
        {"name": "RLBUS_NATS_PASSWORD_FILE", "value": f"{PASSWORD_DIR}/password"},
        {"name": "RLBUS_METRICS_PORT", "value": str(ctx.deploy.metrics_port)},
    ]
    return env


def probes(ctx, role: str) -> dict[str, Any]:
    """Liveness (the heartbeat check of the entry point) and readiness (`/metrics` answers)."""
    return {
        "livenessProbe": {
            "exec": {"command": ["rlbus-entrypoint", "health", role]},
            "initialDelaySeconds": 180,
            "periodSeconds": 30,
            "timeoutSeconds": 15,
            "failureThreshold": 3,
        },
        "readinessProbe": {
            "httpGet": {"path": "/metrics", "port": "metrics"},
            "initialDelaySeconds": 10,
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
    }


def volumes(ctx, role: str, user: str | None = None) -> tuple[list[dict], list[dict]]:
    """(volumes, volumeMounts) of a role: the run folder, the run config, its own NATS password."""
    user = user or role
    writable = role == "init" or (role == "learner" and ctx.cfg.learner.world_size > 1)  # the ranks file
    vols = [
        {"name": "runs", "persistentVolumeClaim": {"claimName": ctx.name("runs")}},
        {"name": "config", "configMap": {"name": ctx.name("config")}},
        {
            "name": "nats-password",
            "secret": {
                "secretName": ctx.name("nats-auth"),
                "items": [{"key": ctx.password_key(user), "path": "password"}],
                "defaultMode": 0o400,
            },
        },
    ]
    mounts = [
        {"name": "runs", "mountPath": RUNS, "readOnly": not writable},
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "nats-password", "mountPath": PASSWORD_DIR, "readOnly": True},
    ]
    return vols, mounts


def container(ctx, role: str, args: list[str], gpus: int = 0, user: str | None = None) -> dict[str, Any]:
    """The rlbus container of a role."""
    _, mounts = volumes(ctx, role, user)
    out: dict[str, Any] = {
        "name": role,
        "image": ctx.image,
        "imagePullPolicy": ctx.deploy.image_pull_policy,
        "args": args,
        "env": role_env(ctx, role, user),
        "resources": resources(ctx.deploy, role, gpus),
        "securityContext": security_context(role),
        "volumeMounts": mounts,
    }
    if role != "init":
        out["ports"] = [{"name": "metrics", "containerPort": ctx.deploy.metrics_port}]
        out.update(probes(ctx, role))
    return out


def pod_spec(ctx, role: str, args: list[str], gpus: int = 0, user: str | None = None) -> dict[str, Any]:
    """A role's pod spec: its container, volumes, scheduling hooks and grace period."""
    vols, _ = volumes(ctx, role, user)
    spec: dict[str, Any] = {
        "serviceAccountName": "rlbus",
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 40,  # SIGTERM finishes the batch and flushes acks
        "containers": [container(ctx, role, args, gpus, user)],
        "volumes": vols,
    }
    if role in SANDBOX_ROLES:
        spec["hostUsers"] = False  # a user namespace: root in the pod is an unprivileged host uid
        if ctx.deploy.sandbox_runtime_class:
            spec["runtimeClassName"] = ctx.deploy.sandbox_runtime_class
    if gpus:
        if ctx.deploy.gpu_node_selector:
            spec["nodeSelector"] = dict(ctx.deploy.gpu_node_selector)
        if ctx.deploy.gpu_tolerations:
            spec["tolerations"] = [dict(t) for t in ctx.deploy.gpu_tolerations]
    return spec


def deployment(ctx, role: str, replicas: int, gpus: int = 0) -> dict[str, Any]:
    """A Deployment of `replicas` pods of a role (`strategy: Recreate` for a single-replica role)."""
    spec: dict[str, Any] = {
        "replicas": replicas,
        "selector": {"matchLabels": labels(ctx.run_id, role)},
        "template": {"metadata": {"labels": labels(ctx.run_id, role)}, "spec": pod_spec(ctx, role, [role], gpus)},
    }
    if role in ("scheduler", "tracker", "sampler"):
        spec["strategy"] = {"type": "Recreate"}  # one per run: never two side by side during an update
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(ctx.name(role), ctx.run_id, role),
        "spec": spec,
    }


def learner_statefulset(ctx, gpus: int, per_rank: bool = False) -> list[dict[str, Any]]:
    """The learner: a headless Service and its StatefulSet.

    One pod (`per_rank` False): it holds every rank (`rlbus worker learner` is rank 0 and starts ranks
    1..N-1 itself on one node) and requests `gpus` GPUs; its checkpoint PVC is its own
    (volumeClaimTemplates). One pod per rank (`per_rank`, `learner.launch = "external"`): see
    `learner_per_rank`."""
    if per_rank:
        return learner_per_rank(ctx, gpus)
    pod = pod_spec(ctx, "learner", ["learner"], gpus)
    pod["containers"][0]["volumeMounts"].append(
        {"name": "checkpoints", "mountPath": f"{RUNS}/{ctx.run_id}/checkpoints"}
    )
    pod["securityContext"] = {"fsGroup": ROLE_UID}  # the PVC is writable by uid 10001
    claim: dict[str, Any] = {
        "metadata": {"name": "checkpoints", "labels": labels(ctx.run_id, "learner")},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": ctx.deploy.checkpoint_storage}},
        },
    }
    if ctx.deploy.storage_class:
        claim["spec"]["storageClassName"] = ctx.deploy.storage_class
    service, sts = _learner_pair(ctx, pod, replicas=1, policy="OrderedReady")  # the learner lease: one per run
    sts["spec"]["volumeClaimTemplates"] = [claim]
    return [service, sts]


def learner_master_addr(ctx) -> str:
    """MASTER_ADDR of a per-rank learner: pod 0 of the StatefulSet through its headless Service."""
    name = ctx.name("learner")
    return f"{name}-0.{name}.{ctx.namespace}.svc.cluster.local"


def learner_per_rank(ctx, gpus: int) -> list[dict[str, Any]]:
    """One learner pod per rank (`learner.launch = "external"`, learner/rendezvous.py).

    - `replicas` = `learner.world_size`, `podManagementPolicy: Parallel` (every rank starts at once: the
      rendezvous needs them all, and OrderedReady would wait for pod 0's readiness first), `gpus`
      (0 or 1) GPUs per pod.
    - Rendezvous: the headless Service (the StatefulSet's `serviceName`) gives pod 0 the DNS name
      `MASTER_ADDR` (`learner_master_addr`), published before it is ready
      (`publishNotReadyAddresses`: rank 0 listens before its readiness probe passes); MASTER_PORT is
      `deploy.learner_master_port`, WORLD_SIZE the world size; each pod's rank is the ordinal ending its
      host name (`<run>-learner-N`), LOCAL_RANK 0 (its one GPU).
    - Checkpoints: the shared run folder (ReadWriteMany, mounted read-write), not a per-pod PVC: a sharded
      (DCP) checkpoint is one directory in which every rank writes its own shards and rank 0 the
      metadata, and a restarted rank must read the others' shards to reshard."""
    pod = pod_spec(ctx, "learner", ["learner"], gpus)
    c = pod["containers"][0]
    c["env"] += [
        {"name": "MASTER_ADDR", "value": learner_master_addr(ctx)},
        {"name": "MASTER_PORT", "value": str(ctx.deploy.learner_master_port)},
        {"name": "WORLD_SIZE", "value": str(ctx.cfg.learner.world_size)},
        {"name": "LOCAL_RANK", "value": "0"},
        {"name": "RLBUS_LEARNER_LAUNCH", "value": "external"},  # `health learner` on a rank > 0: its /metrics
    ]
    c["ports"].append({"name": "rendezvous", "containerPort": ctx.deploy.learner_master_port})
    pod["securityContext"] = {"fsGroup": ROLE_UID}
    service, sts = _learner_pair(ctx, pod, replicas=ctx.cfg.learner.world_size, policy="Parallel")
    service["spec"]["ports"].append({"name": "rendezvous", "port": ctx.deploy.learner_master_port})
    service["spec"]["publishNotReadyAddresses"] = True
    return [service, sts]


def _learner_pair(ctx, pod: dict[str, Any], replicas: int, policy: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The learner's headless Service (the StatefulSet's `serviceName`) and StatefulSet of `pod`."""
    name = ctx.name("learner")
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(name, ctx.run_id, "learner"),
        "spec": {
            "clusterIP": "None",
            "selector": labels(ctx.run_id, "learner"),
            "ports": [{"name": "metrics", "port": ctx.deploy.metrics_port}],
        },
    }
    sts = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta(name, ctx.run_id, "learner"),
        "spec": {
            "serviceName": name,
            "replicas": replicas,
            "podManagementPolicy": policy,
            "selector": {"matchLabels": labels(ctx.run_id, "learner")},
            "template": {"metadata": {"labels": labels(ctx.run_id, "learner")}, "spec": pod},
        },
    }
    return service, sts


def init_job(ctx) -> dict[str, Any]:
    """The one-shot Job that prepares the run folder and creates the run's streams (as NATS `admin`)."""
    pod = pod_spec(ctx, "init", ["init"], user="admin")
    pod["restartPolicy"] = "OnFailure"
    pod["containers"][0]["securityContext"] = {"runAsUser": 0, "allowPrivilegeEscalation": False}  # it chowns
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta(ctx.name("init"), ctx.run_id, "init"),
        "spec": {"backoffLimit": 3, "template": {"metadata": {"labels": labels(ctx.run_id, "init")}, "spec": pod}},
    }


def runs_claim(ctx) -> dict[str, Any]:
    """The shared run folder: a ReadWriteMany PVC (config.json and model/start for every role)."""
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": ctx.deploy.runs_storage}},
    }
    if ctx.deploy.runs_storage_class:
        spec["storageClassName"] = ctx.deploy.runs_storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": meta(ctx.name("runs"), ctx.run_id, "runs"),
        "spec": spec,
    }


METRICS_LABEL = "rlbus.io/metrics"
"""Label of the metrics Services the ServiceMonitor selects (value "true")."""


def metrics_service(ctx, role: str) -> dict[str, Any]:
    """A headless Service of a role's pods on the `metrics` port (what the ServiceMonitor scrapes)."""
    md = meta(ctx.name(f"{role}-metrics"), ctx.run_id, role)
    md["labels"][METRICS_LABEL] = "true"
    port = ctx.deploy.metrics_port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": md,
        "spec": {
            "clusterIP": "None",
            "selector": labels(ctx.run_id, role),
            "ports": [{"name": "metrics", "port": port, "targetPort": "metrics"}],
        },
    }


def service_monitor(ctx) -> dict[str, Any]:
    """A Prometheus Operator ServiceMonitor of the run's metrics Services (`/metrics` on port `metrics`)."""
    md = meta(ctx.name("metrics"), ctx.run_id, "metrics")
    md["labels"].update(ctx.deploy.service_monitor_labels)
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": md,
        "spec": {
            "selector": {
                "matchLabels": {"app.kubernetes.io/name": "rlbus", "rlbus.io/run": ctx.run_id, METRICS_LABEL: "true"}
            },
            "namespaceSelector": {"matchNames": [ctx.namespace]},
            "endpoints": [{"port": "metrics", "path": "/metrics", "interval": ctx.deploy.service_monitor_interval}],
        },
    }


def metrics_objects(ctx, workloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The metrics Services of every workload (Deployment, StatefulSet) whose pods serve `metrics`, and
    the ServiceMonitor that selects them."""
    roles = []
    for obj in workloads:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        ports = [p for c in obj["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])]
        if any(p["name"] == "metrics" for p in ports):
            roles.append(obj["metadata"]["labels"]["app.kubernetes.io/component"])
    return [*(metrics_service(ctx, role) for role in roles), service_monitor(ctx)]
