"""Config of deploying a run past one machine: Kubernetes manifests (`rlbus k8s render`) and
Slurm batch scripts (`rlbus slurm render`).

No role reads this section at run time; only the renderers do. Names of streams and consumers
are never configured here: they come from `bus.subjects.Registry` of the run id, so a manifest
can not drift from what the workers create.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from schemas.config.base import Section


class PoolScaling(Section):
    """KEDA autoscaling of one worker pool (rollout on TASKS, verifier on TRAJ) by its consumer's backlog."""

    min_replicas: int = Field(default=1, ge=0)
    """Fewest replicas (`minReplicaCount`); 0 only with `deploy.scale_to_zero = true`."""
    max_replicas: int = Field(default=8, ge=1)
    """Most replicas (`maxReplicaCount`)."""
    lag_threshold: int = Field(default=16, ge=1)
    """Backlog per replica KEDA aims at (`lagThreshold`): replicas = ceil((num_pending + num_ack_pending) / this)."""
    activation_lag_threshold: int = Field(default=0, ge=0)
    """Backlog above which a pool scaled to zero wakes up (`activationLagThreshold`)."""

    @model_validator(mode="after")
    def _ordered(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        return self


class RoleResources(Section):
    """Kubernetes `resources` of one role's pods (GPUs are added from the role's device, never here)."""

    cpu: str = "1"
    """CPU request (Kubernetes quantity: `500m`, `2`)."""
    memory: str = "2Gi"
    """Memory request (`512Mi`, `8Gi`)."""
    cpu_limit: str = ""
    """CPU limit; empty = none (the pod may burst)."""
    memory_limit: str = ""
    """Memory limit; empty = the request (a role above it is OOM-killed, then restarted)."""


def default_tolerations() -> list[dict[str, str]]:
    """The toleration GPU node pools usually carry (`nvidia.com/gpu` taint, NoSchedule)."""
    return [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


class DeploySection(Section):
    """Deployment past one machine: Kubernetes (`rlbus k8s render`) and Slurm (`rlbus slurm render`)."""

    PLACE = "deploy"

    image: str = ""
    """Container image of every rlbus role (`make images` builds `rlbus:latest`); `--image` overrides; required."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Kubernetes `imagePullPolicy` of the rlbus image."""
    namespace: str = "rlbus"
    """Kubernetes namespace of the run's objects (`--namespace` overrides)."""
    nats_image: str = "nats:2.10-alpine"
    """Image of the NATS StatefulSet (the official nats image: its entry point runs nats-server with the args)."""
    nats_replicas: Literal[1, 3, 5] = 3
    """NATS servers (JetStream cluster; streams are created with this many replicas, at most 3)."""
    nats_storage: str = "10Gi"
    """JetStream file store per NATS pod (one PVC each)."""
    nats_auth: bool = True
    """Per-role NATS users (`bus.auth`). Kubernetes always runs with them (`rlbus k8s render` refuses false);
    a Slurm script with false starts nats-server without users (a private allocation only)."""
    nats_account: str = "$G"
    """NATS account KEDA reads `/jsz` under: `$G` when the server has users but no accounts (rlbus's case)."""
    storage_class: str = ""
    """StorageClass of the NATS and checkpoint PVCs; empty = the cluster's default."""
    runs_storage: str = "20Gi"
    """Size of the shared run folder (ReadWriteMany PVC at /runs: config.json, model/start)."""
    runs_storage_class: str = ""
    """StorageClass of the run folder; it must offer ReadWriteMany (NFS, CephFS, EFS); empty = the default."""
    checkpoint_storage: str = "50Gi"
    """Size of the learner's checkpoint PVC (ReadWriteOnce, its own volume) when the learner is one pod
    (`learner.world_size = 1`, or `learner.launch = "spawn"`). One pod per rank writes its sharded (DCP)
    checkpoints to the shared run folder instead: every rank writes its own shards into one directory."""
    learner_master_port: int = Field(default=29500, ge=1, le=65535)
    """One pod per learner rank: the rendezvous port rank 0 listens on (MASTER_PORT, torch's default)."""
    metrics_port: int = Field(default=9100, ge=1, le=65535)
    """Port every pod serves Prometheus `/metrics` on (env RLBUS_METRICS_PORT); the readiness probe reads it."""
    learner_device: Literal["cpu", "cuda"] = "cpu"
    """Device of the learner pods: `cuda` requests one GPU (`nvidia.com/gpu`) per rank's pod (one pod per rank;
    `learner.world_size` GPUs in the one pod of `learner.launch = "spawn"`); `cpu` none.
    The learner itself takes CUDA when it sees it; `learner.backend = "nccl"` needs `cuda` here."""
    gpu_node_selector: dict[str, str] = Field(default_factory=dict)
    """nodeSelector of pods that request GPUs (e.g. `{"nvidia.com/gpu.present" = "true"}`); empty = none."""
    gpu_tolerations: list[dict[str, str]] = Field(default_factory=default_tolerations)
    """Tolerations of pods that request GPUs (default: the `nvidia.com/gpu` NoSchedule taint)."""
    sandbox_runtime_class: str = ""
    """`runtimeClassName` of the pods that open sandboxes (sandbox, verifier, scheduler): `gvisor` (runsc) or
    `kata` for a second kernel boundary around bwrap; empty = the node's default runtime."""
    service_monitor: bool = False
    """Render a Prometheus Operator `ServiceMonitor` (`monitoring.coreos.com/v1`, the CRD must be installed)
    and one headless metrics Service per role (`<run>-<role>-metrics`, port `metrics`), so Prometheus scrapes
    every pod's `/metrics`; off = no CRD object in the tree."""
    service_monitor_labels: dict[str, str] = Field(default_factory=dict)
    """Extra labels of the ServiceMonitor, for a Prometheus whose `serviceMonitorSelector` asks for them
    (kube-prometheus-stack: `{release = "<helm release>"}`); empty = none."""
    service_monitor_interval: str = Field(default="30s", pattern=r"^([0-9]+(ms|s|m|h))+$")
    """Scrape interval of the ServiceMonitor's endpoints (a Prometheus duration: `15s`, `1m`)."""
    scale_to_zero: bool = False
    """Allow the KEDA pools' min_replicas = 0 (an idle pool costs nothing; the first task waits for a pod)."""
    polling_interval_s: int = Field(default=15, ge=1)
    """How often KEDA reads the consumers' backlog (`pollingInterval`)."""
    cooldown_period_s: int = Field(default=300, ge=0)
    """How long KEDA waits after the last active poll before scaling a pool to zero (`cooldownPeriod`)."""
    rollout: PoolScaling = Field(default_factory=PoolScaling)
    """Autoscaling of rollout workers on the TASKS consumer `rollout`."""
    verifier: PoolScaling = Field(default_factory=lambda: PoolScaling(lag_threshold=64))
    """Autoscaling of verifier workers on the TRAJ consumer `verifier`."""
    resources: dict[str, RoleResources] = Field(default_factory=dict)
    """Per role (`sampler`, `rollout`, `sandbox`, `verifier`, `learner`, `scheduler`, `tracker`, `nats`, `init`):
    its `resources`; a role not listed gets the defaults of `RoleResources`."""
    slurm_partition: str = ""
    """Slurm partition (`#SBATCH --partition`); empty = the cluster's default."""
    slurm_time: str = "24:00:00"
    """Slurm wall-time limit (`#SBATCH --time`)."""
    slurm_gpus_per_node: int = Field(default=0, ge=0)
    """GPUs per node requested from Slurm (`#SBATCH --gpus-per-node`); 0 = none."""
    slurm_placement: dict[str, int] = Field(default_factory=dict)
    """Role -> node index (0 = the first node, which also runs nats-server); a role not listed is placed
    round-robin over the nodes, GPU roles (rollout, learner) from the last node down."""

    @model_validator(mode="after")
    def _zero_needs_opt_in(self):
        for name in ("rollout", "verifier"):
            if getattr(self, name).min_replicas == 0 and not self.scale_to_zero:
                raise ValueError(f"deploy.{name}.min_replicas = 0 needs deploy.scale_to_zero = true")
        return self
