"""`rlbus k8s render`: one run's Kubernetes manifests, a kustomize tree.

    OUT/base/                  namespace, service account (shared by runs)
    OUT/overlays/<run>/        the run: NATS, Secret, config, init Job, roles, learner, KEDA ScaledObjects

Guarantees:
- `check(cfg, run_id, image)` refuses, with one line each saying what to do: a run id that is not a
  DNS label of at most `MAX_RUN_ID` characters (it prefixes every object name); auth off (Kubernetes
  always runs with per-role NATS users); a role device the manifests cannot request; no image.
- Stream and consumer names of the ScaledObjects come from `bus.subjects.Registry(run_id)`: the TASKS
  consumer of every rollout pool (`rollout_consumer(pool=...)`), with `rollout.priority.enabled` also
  each pool's higher classes (`rollout_consumer(pool=..., priority="eval")`: an eval backlog scales
  rollout workers too), and the TRAJ consumer `verifier`. A
  consumer KEDA cannot find makes it fall back to the stream's last sequence and scale to the maximum,
  so these names are never typed here.
- The run config is a ConfigMap (URL passwords redacted, `sandbox.remote = true` as in compose); NATS
  passwords only in the Secret file, written mode 0600.
- The learner with `learner.world_size` > 1 is one pod per rank (`k8s_objects.learner_per_rank`,
  `learner.launch = "external"` in the ConfigMap), unless `learner.launch = "spawn"` asks for one pod
  holding every rank.
- `deploy.service_monitor = true` adds `metrics.yaml`: a metrics Service per role workload and a
  Prometheus Operator ServiceMonitor (`k8s_objects.metrics_objects`); off, the tree has no such CRD object.
- `render` writes only under `out`; rendering again rewrites the same files (passwords kept).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bus.auth import password_env
from bus.roles import ROLES
from bus.subjects import PRIORITY_CLASSES, Registry
from rlbus.deploy import k8s_nats, k8s_objects
from schemas.config import RunConfig

MAX_RUN_ID = 40
"""Longest run id: it prefixes object names (`<run>-scheduler`, `<run>-nats-headless`), which must stay DNS labels."""
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
KEDA_TRIGGER = "nats-jetstream"
KEDA_FIELDS = (
    "natsServerMonitoringEndpoint",
    "account",
    "stream",
    "consumer",
    "lagThreshold",
    "activationLagThreshold",
)
"""The trigger metadata KEDA documents for `nats-jetstream` that the render sets (plus `useHttps`, left at false)."""


class RenderError(ValueError):
    """A config or argument the manifests cannot be rendered from (the message says what to do)."""


def run_id_problem(run_id: str) -> str | None:
    """Why `run_id` cannot name a run's Kubernetes objects (with a run id that can), or None."""
    if _DNS_LABEL.match(run_id or "") and len(run_id) <= MAX_RUN_ID:
        return None
    fixed = re.sub(r"[^a-z0-9-]+", "-", (run_id or "").lower())[:MAX_RUN_ID].strip("-") or "run-1"
    return (
        f"--run-id {run_id!r} is not a DNS label: Kubernetes object names allow only lowercase letters a-z, "
        f"digits and '-', starting and ending with a letter or digit; the run id prefixes every object name "
        f"(<run-id>-scheduler, <run-id>-nats-headless), so it may have at most {MAX_RUN_ID} characters "
        f"(a DNS label has 63). For example: --run-id {fixed}"
    )


def rollout_gpus(cfg: RunConfig) -> int:
    """GPUs of one rollout pod: 1 with vLLM or a CUDA device of the hf engine, else 0."""
    rc = cfg.rollout
    if rc.engine == "vllm":
        return 1
    return 1 if rc.engine == "hf" and rc.hf.device.startswith("cuda") else 0


def per_rank_learner(cfg: RunConfig) -> bool:
    """One learner pod per rank: `learner.world_size` > 1 unless `learner.launch = "spawn"` (one pod
    holding every rank, e.g. one 8-GPU node); the ConfigMap then says `learner.launch = "external"`."""
    return cfg.learner.world_size > 1 and cfg.learner.launch != "spawn"


def device_problems(cfg: RunConfig) -> list[str]:
    """What the manifests cannot request for the config's devices (one line each)."""
    out = []
    rc, lc = cfg.rollout, cfg.learner
    if rc.engine == "hf" and rc.hf.device not in ("cpu", "cuda", "cuda:0"):
        out.append(
            f"rollout.hf.device = {rc.hf.device!r}: a rollout pod gets either no GPU or one "
            "`nvidia.com/gpu`, seen as cuda:0; set rollout.hf.device = 'cpu' or 'cuda'"
        )
    if lc.backend == "nccl" and cfg.deploy.learner_device != "cuda":
        out.append(
            "learner.backend = 'nccl' needs GPUs: set deploy.learner_device = 'cuda' (or learner.backend = 'auto')"
        )
    return out


@dataclass
class Context:
    """What every object builder needs: the config, the run, and the names derived from it."""

    cfg: RunConfig
    run_id: str
    image: str
    namespace: str

    @property
    def deploy(self):
        return self.cfg.deploy

    def name(self, what: str) -> str:
        """Object name of a part of the run: `<run>-<what>`."""
        return f"{self.run_id}-{what}"

    @property
    def nats_headless(self) -> str:
        return self.name("nats-headless")

    def nats_pod_host(self, i: int) -> str:
        return f"{self.name('nats')}-{i}.{self.nats_headless}.{self.namespace}.svc.cluster.local"

    @property
    def nats_url(self) -> str:
        return f"nats://{self.name('nats')}:{k8s_nats.CLIENT}"

    @property
    def monitor_endpoint(self) -> str:
        return f"{self.nats_headless}.{self.namespace}.svc.cluster.local:{k8s_nats.MONITOR}"

    @property
    def stream_replicas(self) -> int:
        return min(3, self.deploy.nats_replicas)

    def password_key(self, user: str) -> str:
        return password_env(user)


def check(cfg: RunConfig, run_id: str, image: str, namespace: str) -> None:
    """Raise RenderError with every reason the run cannot be rendered (see the module guarantees)."""
    problems = []
    if problem := run_id_problem(run_id):
        problems.append(problem)
    if not _DNS_LABEL.match(namespace or "") or len(namespace) > 63:
        problems.append(f"--namespace {namespace!r} is not a DNS label (lowercase a-z, 0-9, '-', at most 63)")
    if not cfg.deploy.nats_auth:
        problems.append(
            "deploy.nats_auth = false: a Kubernetes run always runs with per-role NATS users (a shared cluster "
            "network reaches the server); set deploy.nats_auth = true"
        )
    problems += device_problems(cfg)
    if not image:
        problems.append("no image: pass --image IMAGE (e.g. --image registry.example/rlbus:latest) or set deploy.image")
    unknown = sorted(set(cfg.deploy.resources) - {r.name for r in ROLES} - {"nats", "init"})
    if unknown:
        problems.append(
            f"deploy.resources has no role {', '.join(unknown)} (roles: {', '.join(r.name for r in ROLES)}, nats, init)"
        )
    if problems:
        raise RenderError("\n".join(problems))


def scaled_object(ctx: Context, role: str, specs: list, scaling) -> dict[str, Any]:
    """A KEDA ScaledObject of a role's Deployment, one `nats-jetstream` trigger per consumer spec."""
    d = ctx.deploy
    triggers = [
        {
            "type": KEDA_TRIGGER,
            "metadata": {
                "natsServerMonitoringEndpoint": ctx.monitor_endpoint,
                "account": d.nats_account,
                "stream": spec.stream,
                "consumer": spec.durable,
                "lagThreshold": str(scaling.lag_threshold),
                "activationLagThreshold": str(scaling.activation_lag_threshold),
                "useHttps": "false",
            },
        }
        for spec in specs
    ]
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": k8s_objects.meta(ctx.name(role), ctx.run_id, role),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": ctx.name(role)},
            "pollingInterval": d.polling_interval_s,
            "cooldownPeriod": d.cooldown_period_s,
            "minReplicaCount": scaling.min_replicas,
            "maxReplicaCount": scaling.max_replicas,
            "triggers": triggers,
        },
    }


def keda_objects(ctx: Context) -> list[dict[str, Any]]:
    """ScaledObjects of the rollout pool (every duration pool's TASKS consumers, one per priority
    class when priority is on) and the verifier pool."""
    reg = Registry(ctx.run_id)
    higher = [c for c in PRIORITY_CLASSES if c != "train"] if ctx.cfg.rollout.priority.enabled else []
    classes = ["train", *higher]  # the training consumer's trigger first
    rollout = [reg.rollout_consumer(pool=pool, priority=c) for pool in ctx.cfg.rollout.pools for c in classes]
    return [
        scaled_object(ctx, "rollout", rollout, ctx.deploy.rollout),
        scaled_object(ctx, "verifier", [reg.verifier_consumer()], ctx.deploy.verifier),
    ]


def expected_replicas(backlog: int, scaling) -> int:
    """KEDA's target for a pool: ceil(backlog / lagThreshold), clamped to [min, max] (HPA AverageValue)."""
    want = math.ceil(backlog / scaling.lag_threshold) if backlog > scaling.activation_lag_threshold else 0
    return max(scaling.min_replicas, min(scaling.max_replicas, want))


def run_config_map(ctx: Context) -> dict[str, Any]:
    """The run config as a ConfigMap (`config.json`): resolved, the run id set, URL passwords redacted."""
    from schemas.redact import redact_tree

    cfg = ctx.cfg.model_copy(deep=True)
    cfg.run.run_id = ctx.run_id
    cfg.run.run_dir = k8s_objects.RUNS
    cfg.run.nats_url = ctx.nats_url
    cfg.sandbox.remote = True  # tool calls go to the sandbox service (compose does the same)
    if per_rank_learner(cfg):
        cfg.learner.launch = "external"  # one pod per rank: each finds the others by env (learner/rendezvous.py)
    data = redact_tree(cfg.model_dump(mode="json"))
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": k8s_objects.meta(ctx.name("config"), ctx.run_id, "config"),
        "data": {"config.json": json.dumps(data, indent=1, sort_keys=True)},
    }


def role_objects(ctx: Context) -> dict[str, list[dict[str, Any]]]:
    """File name -> objects of the roles: one Deployment per pool role, the learner StatefulSet."""
    d, cfg = ctx.deploy, ctx.cfg
    out: dict[str, list[dict[str, Any]]] = {}
    for role in ROLES:
        if role.name == "tracker" and not cfg.tracking.backends:
            continue
        if role.name == "learner":
            per_rank = per_rank_learner(cfg)
            gpus = (1 if per_rank else cfg.learner.world_size) if d.learner_device == "cuda" else 0
            out["learner.yaml"] = k8s_objects.learner_statefulset(ctx, gpus, per_rank)
            continue
        scaling = getattr(d, role.name, None) if role.name in ("rollout", "verifier") else None
        replicas = max(1, scaling.min_replicas) if scaling else 1
        gpus = rollout_gpus(cfg) if role.name == "rollout" else 0
        out[f"{role.name}.yaml"] = [k8s_objects.deployment(ctx, role.name, replicas, gpus)]
    return out


def base_files(namespace: str) -> dict[str, list[dict[str, Any]] | dict[str, Any]]:
    """The base: the namespace and the service account every pod runs as (no API token mounted)."""
    ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    sa = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": "rlbus", "labels": {"app.kubernetes.io/name": "rlbus"}},
        "automountServiceAccountToken": False,
    }
    files: dict[str, Any] = {"namespace.yaml": [ns], "serviceaccount.yaml": [sa]}
    files["kustomization.yaml"] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": namespace,
        "resources": sorted(k for k in files if k != "kustomization.yaml"),
    }
    return files


def overlay_files(ctx: Context, pws: dict[str, str]) -> dict[str, Any]:
    """The run's overlay: file name -> objects (a kustomization last)."""
    files: dict[str, Any] = {
        "nats.yaml": [k8s_nats.config_map(ctx), *k8s_nats.services(ctx), k8s_nats.statefulset(ctx)],
        "nats-auth.yaml": [k8s_nats.secret(ctx, pws)],
        "config.yaml": [run_config_map(ctx)],
        "runs-pvc.yaml": [k8s_objects.runs_claim(ctx)],
        "init-job.yaml": [k8s_objects.init_job(ctx)],
        **role_objects(ctx),
        "keda.yaml": keda_objects(ctx),
    }
    if ctx.deploy.service_monitor:
        files["metrics.yaml"] = k8s_objects.metrics_objects(ctx, [o for objs in files.values() for o in objs])
    files["kustomization.yaml"] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": ctx.namespace,
        "resources": ["../../base", *files],
    }
    return files


SECRET_FILES = ("nats-auth.yaml", "nats-passwords.env")


def render(cfg: RunConfig, run_id: str, out: Path, image: str = "", namespace: str = "") -> list[Path]:
    """Write the kustomize tree of the run under `out`; return the files written (sorted)."""
    namespace = namespace or cfg.deploy.namespace
    image = image or cfg.deploy.image
    check(cfg, run_id, image, namespace)
    ctx = Context(cfg, run_id, image, namespace)
    overlay = out / "overlays" / run_id
    overlay.mkdir(parents=True, exist_ok=True)
    written = _write_tree(out / "base", base_files(namespace))
    written += _write_tree(overlay, overlay_files(ctx, k8s_nats.passwords(overlay)))
    (overlay / "values.yaml").write_text(k8s_nats.helm_values(ctx))
    written += [overlay / "values.yaml", overlay / "nats-passwords.env"]
    return sorted(written)


def _write_tree(folder: Path, files: dict[str, Any]) -> list[Path]:
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, objs in files.items():
        path = folder / name
        text = (
            yaml.safe_dump(objs, sort_keys=False)
            if isinstance(objs, dict)
            else yaml.safe_dump_all(objs, sort_keys=False)
        )
        if name in SECRET_FILES:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(path, 0o600)
        else:
            path.write_text(text)
        out.append(path)
    return out
