"""`rlbus k8s render` checked offline (issue 34): the kustomize tree renders (`kubectl kustomize`),
every core object validates against Kubernetes KUBE_VERSION (`kubernetes-validate`, strict), the
ScaledObjects carry exactly the fields KEDA documents for its `nats-jetstream` trigger, and their
stream and consumer names exist on a real nats-server's `/jsz` under exactly those names. The
metric test computes KEDA's formula from `/jsz` against the backlog `rlbus top` reads.

No live cluster: what a kubelet, KEDA or the NATS Helm chart would do with the tree is not run here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from bus.subjects import PRIORITY_CLASSES, Registry
from rlbus.deploy import k8s
from schemas.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.toml"
RUN = "exp-7"
KUBE_VERSION = "1.31.0"
"""The Kubernetes version the core objects are validated against (appArmorProfile is GA since 1.30)."""

# KEDA's nats-jetstream scaler (keda.sh/docs/2.19/scalers/nats-jetstream, the same since 2.8 plus
# useHttps): trigger metadata and which of it is required; ScaledObject spec fields the render uses.
KEDA_REQUIRED = {"natsServerMonitoringEndpoint", "account", "stream", "consumer", "lagThreshold"}
KEDA_OPTIONAL = {"activationLagThreshold", "useHttps"}
KEDA_SPEC = {"scaleTargetRef", "pollingInterval", "cooldownPeriod", "minReplicaCount", "maxReplicaCount", "triggers"}


def _render(tmp_path: Path, *sets: str, run_id: str = RUN, **kw) -> tuple[Path, list[Path]]:
    cfg = load_config(DEMO, list(sets))
    out = tmp_path / "k8s"
    return out, k8s.render(cfg, run_id, out, image=kw.get("image", "rlbus:test"), namespace=kw.get("namespace", ""))


def _objects(out: Path) -> list[dict]:
    docs = []
    for path in sorted(out.rglob("*.yaml")):
        if path.name not in ("kustomization.yaml", "values.yaml"):
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _scaled(out: Path) -> list[dict]:
    return [d for d in _objects(out) if d["kind"] == "ScaledObject"]


def test_tree_lists_every_part(tmp_path):
    out, files = _render(tmp_path)
    names = sorted(str(p.relative_to(out)) for p in files)
    overlay = f"overlays/{RUN}/"
    want = ["config.yaml", "init-job.yaml", "keda.yaml", "kustomization.yaml", "learner.yaml", "nats-auth.yaml"]
    want += ["nats-passwords.env", "nats.yaml", "rollout.yaml", "runs-pvc.yaml", "sampler.yaml", "sandbox.yaml"]
    want += ["scheduler.yaml", "values.yaml", "verifier.yaml"]
    assert names == ["base/kustomization.yaml", "base/namespace.yaml", "base/serviceaccount.yaml"] + [
        overlay + n for n in want
    ]
    for secret in ("nats-auth.yaml", "nats-passwords.env"):
        assert (out / overlay / secret).stat().st_mode & 0o777 == 0o600
    kinds = {(d["kind"], d["metadata"]["name"]) for d in _objects(out)}
    assert ("StatefulSet", f"{RUN}-nats") in kinds and ("StatefulSet", f"{RUN}-learner") in kinds
    for role in ("sampler", "rollout", "verifier", "sandbox", "scheduler"):
        assert ("Deployment", f"{RUN}-{role}") in kinds
    nats = next(d for d in _objects(out) if d["kind"] == "StatefulSet" and d["metadata"]["name"] == f"{RUN}-nats")
    assert nats["spec"]["replicas"] == 3 and nats["spec"]["volumeClaimTemplates"]


@pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl is not installed (Debian: apt-get install kubectl)"
)
def test_kubectl_kustomize_renders(tmp_path):
    out, _ = _render(tmp_path)
    proc = subprocess.run(
        ["kubectl", "kustomize", str(out / "overlays" / RUN)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert len(docs) == len(_objects(out))  # base (namespace, service account) and overlay, each once
    assert all(d["metadata"].get("namespace") == "rlbus" for d in docs if d["kind"] != "Namespace")


def test_core_objects_validate(tmp_path):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]' (kubernetes-validate)")
    per_rank = ["learner.world_size=4", "deploy.learner_device=cuda", "deploy.service_monitor=true"]
    for sets in (
        [],
        ["rollout.hf.device=cuda", "deploy.learner_device=cuda", "deploy.sandbox_runtime_class=gvisor"],
        per_rank,
        [*per_rank, "learner.launch=spawn"],
    ):
        out, _ = _render(tmp_path, *sets)
        docs = [d for d in _objects(out) if not d["apiVersion"].startswith(("keda.sh/", "monitoring.coreos.com/"))]
        assert len(docs) > 15
        for doc in docs:
            kv.validate(doc, KUBE_VERSION, strict=True)  # raises on an unknown field or a wrong type
    bad = dict(docs[0], spec={"replicas": "three"})
    with pytest.raises(Exception):
        kv.validate(bad, KUBE_VERSION, strict=True)


def test_scaled_objects_have_keda_fields(tmp_path):
    out, _ = _render(tmp_path, "deploy.rollout.lag_threshold=5", "deploy.verifier.max_replicas=20")
    deployments = {d["metadata"]["name"] for d in _objects(out) if d["kind"] == "Deployment"}
    scaled = {d["metadata"]["name"]: d for d in _scaled(out)}
    assert set(scaled) == {f"{RUN}-rollout", f"{RUN}-verifier"}
    for so in scaled.values():
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        assert set(so["spec"]) <= KEDA_SPEC
        assert so["spec"]["scaleTargetRef"]["name"] in deployments
        assert so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]
        for trig in so["spec"]["triggers"]:
            assert trig["type"] == "nats-jetstream"
            meta = trig["metadata"]
            assert KEDA_REQUIRED <= set(meta) <= KEDA_REQUIRED | KEDA_OPTIONAL
            assert all(isinstance(v, str) for v in meta.values())  # KEDA metadata is a string map
            assert meta["natsServerMonitoringEndpoint"] == f"{RUN}-nats-headless.rlbus.svc.cluster.local:8222"
            assert meta["account"] == "$G"
    rollout = scaled[f"{RUN}-rollout"]["spec"]
    assert {t["metadata"]["lagThreshold"] for t in rollout["triggers"]} == {"5"}
    consumers = {t["metadata"]["consumer"] for t in rollout["triggers"]}
    assert {"rollout", "rollout-short-eval"} <= consumers  # an eval backlog scales rollout too
    out, _ = _render(tmp_path / "fcfs", "rollout.priority.enabled=false")
    fcfs = next(s for s in _scaled(out) if s["metadata"]["name"].endswith("-rollout"))
    assert not any(t["metadata"]["consumer"].endswith("-eval") for t in fcfs["spec"]["triggers"])
    assert scaled[f"{RUN}-verifier"]["spec"]["maxReplicaCount"] == 20


def test_scale_to_zero_is_an_option(tmp_path):
    with pytest.raises(Exception, match="scale_to_zero"):
        load_config(DEMO, ["deploy.rollout.min_replicas=0"])
    out, _ = _render(tmp_path, "deploy.scale_to_zero=true", "deploy.rollout.min_replicas=0")
    rollout = next(s for s in _scaled(out) if s["metadata"]["name"].endswith("-rollout"))
    assert rollout["spec"]["minReplicaCount"] == 0


def test_secrets_stay_out_of_configmaps_and_survive_a_rerender(tmp_path):
    out, _ = _render(tmp_path)
    overlay = out / "overlays" / RUN
    secret = yaml.safe_load((overlay / "nats-auth.yaml").read_text())
    passwords = list(secret["stringData"].values())
    assert len(passwords) >= 8 and all(p.startswith("pw") for p in passwords)
    for path in out.rglob("*"):
        if path.is_file() and path.name not in k8s.SECRET_FILES:
            text = path.read_text()
            assert not any(p in text for p in passwords), path
    conf = next(d for d in _objects(out) if d["metadata"]["name"] == f"{RUN}-nats-config")["data"]["nats.conf"]
    assert "$RLBUS_NATS_PASSWORD_ROLLOUT" in conf and "routes" in conf
    _render(tmp_path)
    assert yaml.safe_load((overlay / "nats-auth.yaml").read_text()) == secret
    for d in _objects(out):
        if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"] != f"{RUN}-nats":
            env = {e["name"]: e.get("value") for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
            assert env["RLBUS_NATS_PASSWORD_FILE"] and "RLBUS_NATS_PASSWORD" not in env
            assert env["RLBUS_NATS_USER"] == d["metadata"]["labels"]["app.kubernetes.io/component"]


def _container(out: Path, name: str) -> tuple[dict, dict]:
    obj = next(d for d in _objects(out) if d["metadata"]["name"] == f"{RUN}-{name}" and "template" in d.get("spec", {}))
    pod = obj["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def test_gpus_follow_devices_and_probes_and_security(tmp_path):
    out, _ = _render(tmp_path)
    pod, c = _container(out, "rollout")
    assert "nvidia.com/gpu" not in c["resources"]["limits"] and "tolerations" not in pod
    assert c["livenessProbe"]["exec"]["command"] == ["rlbus-entrypoint", "health", "rollout"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/metrics"
    assert c["securityContext"]["runAsNonRoot"] and c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    pod, c = _container(out, "sandbox")
    assert c["securityContext"]["seccompProfile"] == {"type": "Unconfined"} and "runtimeClassName" not in pod
    sets = ["rollout.hf.device=cuda", "deploy.learner_device=cuda", "learner.world_size=2"]
    sets += ["deploy.sandbox_runtime_class=gvisor", 'deploy.gpu_node_selector={"gpu"="h100"}']
    out, _ = _render(tmp_path, *sets)
    pod, c = _container(out, "rollout")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    pod, c = _container(out, "learner")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1  # one pod per rank (test_learner_is_one_pod_per_rank)
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu" and pod["nodeSelector"] == {"gpu": "h100"}
    assert _container(out, "verifier")[0]["runtimeClassName"] == "gvisor"
    assert "nvidia.com/gpu" not in _container(out, "verifier")[1]["resources"]["limits"]


@pytest.mark.parametrize(
    ("run_id", "sets", "image", "says"),
    [
        ("Exp_7", [], "img", "not a DNS label: Kubernetes object names allow only lowercase"),
        ("x" * 41, [], "img", "at most 40 characters"),
        (RUN, ["deploy.nats_auth=false"], "img", "per-role NATS users"),
        (RUN, ["rollout.hf.device=cuda:1"], "img", "seen as cuda:0"),
        (RUN, ["rollout.hf.device=mps"], "img", "rollout.hf.device = 'mps'"),
        (RUN, ["learner.backend=nccl"], "img", "deploy.learner_device = 'cuda'"),
        (RUN, [], "", "pass --image IMAGE"),
        (RUN, ['deploy.resources.rollouts={cpu="2"}'], "img", "deploy.resources has no role rollouts"),
    ],
)
def test_render_refuses(tmp_path, run_id, sets, image, says):
    with pytest.raises(k8s.RenderError, match=says.replace("(", r"\(").replace("*", r"\*")):
        _render(tmp_path, *sets, run_id=run_id, image=image)
    assert not (tmp_path / "k8s").exists()


def test_cli_render_and_refusal(tmp_path):
    # a process of its own: the CLI configures this process's logging once (to the stderr of the moment)
    cli = [sys.executable, "-m", "rlbus.cli", "k8s", "render", str(DEMO), "--run-id", RUN]
    done = subprocess.run([*cli, "--out", str(tmp_path), "--image", "i:1"], capture_output=True, text=True)
    assert done.returncode == 0 and f"overlays/{RUN}/keda.yaml" in done.stdout, done.stderr
    refused = subprocess.run([*cli, "--out", str(tmp_path / "x")], capture_output=True, text=True)
    assert refused.returncode != 0 and "--image" in refused.stderr


# -- the names and metric tests: a real nats-server with its monitoring port ----------------------------


@pytest.fixture
def monitored_server(tmp_path):
    from bus.server import EmbeddedNats, free_port

    server = EmbeddedNats(tmp_path / "nats", monitor_port=free_port()).start()
    yield server
    server.stop()


def jsz(monitor_url: str) -> dict[tuple[str, str, str], dict]:
    """(account, stream, consumer) -> the consumer's `/jsz?consumers=true` record."""
    with urllib.request.urlopen(f"{monitor_url}/jsz?consumers=true", timeout=10) as resp:
        data = json.load(resp)
    out = {}
    for account in data.get("account_details") or []:
        for stream in account.get("stream_detail") or []:
            for consumer in stream.get("consumer_detail") or []:
                out[(account["name"], stream["name"], consumer["name"])] = consumer
    return out


def keda_replicas(consumers: dict, trigger: dict, scaling) -> int:
    """KEDA's target from `/jsz`: (num_pending + num_ack_pending) of the trigger's consumer / lagThreshold."""
    m = trigger["metadata"]
    info = consumers[(m["account"], m["stream"], m["consumer"])]
    return k8s.expected_replicas(info["num_pending"] + info["num_ack_pending"], scaling)


async def _run_topology(js, reg: Registry, cfg) -> None:
    """What the run's workers create: every stream (launcher/init) and each pool's durable (the rollout and
    verifier workers call these very Registry methods, rollout_workers/worker.py, verifier_workers/worker.py)."""
    from bus.conn import ensure_consumer, ensure_topology

    await ensure_topology(js, reg)
    classes = PRIORITY_CLASSES if cfg.rollout.priority.enabled else ("train",)
    for pool, pc in cfg.rollout.pools.items():
        for c in classes:
            await ensure_consumer(
                js, reg.rollout_consumer(pc.ack_wait_s or cfg.rollout.ack_wait_s, pool=pool, priority=c)
            )
    await ensure_consumer(js, reg.verifier_consumer(cfg.verifier.ack_wait_s))


async def test_scaled_object_names_exist_on_the_server(tmp_path, monitored_server):
    from bus.conn import connect

    cfg = load_config(DEMO)
    out = tmp_path / "k8s"
    k8s.render(cfg, RUN, out, image="i")
    reg = Registry(RUN)
    nc = await connect(monitored_server.url, name="pytest")
    try:
        await _run_topology(nc.jetstream(timeout=10), reg, cfg)
    finally:
        await nc.close()
    consumers = jsz(monitored_server.monitor_url)
    triggers = [t["metadata"] for so in _scaled(out) for t in so["spec"]["triggers"]]
    assert len(triggers) == len(cfg.rollout.pools) * len(PRIORITY_CLASSES) + 1
    for m in triggers:
        assert (m["account"], m["stream"], m["consumer"]) in consumers, (m, sorted(consumers))
    assert ("$G", f"TASKS_{RUN}", "rollout") in consumers and ("$G", f"TRAJ_{RUN}", "verifier") in consumers
    renamed = dict(triggers[0], consumer=triggers[0]["consumer"] + "s")  # what a hand-typed name would drift to
    assert (renamed["account"], renamed["stream"], renamed["consumer"]) not in consumers


async def test_keda_metric_follows_the_backlog_and_falls_to_min(tmp_path, monitored_server):
    from bus.conn import connect
    from bus.telemetry import Heartbeats
    from rlbus.commands.top import collect_frame

    cfg = load_config(DEMO, ["deploy.rollout.lag_threshold=4", "deploy.rollout.max_replicas=5"])
    out = tmp_path / "k8s"
    k8s.render(cfg, RUN, out, image="i")
    trigger = next(s for s in _scaled(out) if s["metadata"]["name"].endswith("-rollout"))["spec"]["triggers"][0]
    reg = Registry(RUN)
    nc = await connect(monitored_server.url, name="pytest")
    js = nc.jetstream(timeout=10)
    try:
        await _run_topology(js, reg, cfg)
        for i in range(13):
            await js.publish(reg.tasks("arith"), b"x", headers={"Nats-Msg-Id": f"t{i}"})
        frame = await collect_frame(js, reg, Heartbeats(RUN))
        top = next(c for c in frame["consumers"] if c["stream"] == "TASKS" and c["name"] == "rollout")
        consumers = jsz(monitored_server.monitor_url)
        info = consumers[("$G", f"TASKS_{RUN}", "rollout")]
        assert info["num_pending"] + info["num_ack_pending"] == top["pending"] + top["ack_pending"] == 13
        assert keda_replicas(consumers, trigger, cfg.deploy.rollout) == 4  # ceil(13 / 4), under max 5
        sub = await js.pull_subscribe_bind("rollout", stream=reg.stream("TASKS"))
        msgs = await sub.fetch(13, timeout=5)
        assert keda_replicas(jsz(monitored_server.monitor_url), trigger, cfg.deploy.rollout) == 4  # acks pending
        for msg in msgs:
            await msg.ack_sync()
        assert keda_replicas(jsz(monitored_server.monitor_url), trigger, cfg.deploy.rollout) == 1  # drained: min
    finally:
        await nc.close()


def test_expected_replicas_clamps():
    from schemas.config.deploy import PoolScaling

    s = PoolScaling(min_replicas=2, max_replicas=6, lag_threshold=10)
    assert [k8s.expected_replicas(b, s) for b in (0, 5, 21, 59, 1000)] == [2, 2, 3, 6, 6]
    z = PoolScaling(min_replicas=0, max_replicas=3, lag_threshold=10, activation_lag_threshold=5)
    assert [k8s.expected_replicas(b, z) for b in (0, 5, 6)] == [0, 0, 1]


def test_embedded_server_of_a_run_serves_jsz_and_run_json_records_it(tmp_path):
    """`rlbus up`'s own nats-server serves its monitoring port; run.json records it as `monitor_url`
    (KEDA's formula, `rlbus top` and an operator read /jsz there); a restart by the watchdog keeps it."""
    import io

    from rich.console import Console

    from rlbus.run.folder import RunFolder
    from rlbus.run.launcher import _start_server
    from rlbus.run.supervisor import Supervisor
    from rlbus.run.watchdog import ServerKeeper

    run_path = tmp_path / "runs" / "r1"
    cfg = load_config(DEMO)
    url, server = _start_server(cfg, run_path, False, Console(file=io.StringIO()))
    keeper = ServerKeeper(server, RunFolder(run_path).nats, run_path)
    try:
        assert keeper.monitor_url and keeper.monitor_url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(f"{keeper.monitor_url}/jsz", timeout=10) as resp:
            assert resp.status == 200 and "server_id" in json.load(resp)
        sup = Supervisor(run_path, run_path / "config.json", url, "r1", tmp_path / "runs")
        sup.server_pid, sup.monitor_url = keeper.pid, keeper.monitor_url
        sup.write_state()
        assert RunFolder(run_path).state()["monitor_url"] == keeper.monitor_url
        before = keeper.monitor_url
        server.proc.kill()
        server.proc.wait()
        assert keeper.check()  # restarted on the same ports
        assert keeper.monitor_url == before
        with urllib.request.urlopen(f"{keeper.monitor_url}/healthz", timeout=10) as resp:
            assert resp.status == 200
    finally:
        keeper.stop()


@pytest.mark.parametrize("replicas", ["3", "1"])
def test_nats_server_accepts_the_rendered_config(tmp_path, replicas):
    """The ConfigMap's nats.conf parses in nats-server itself (`-t`), users and cluster routes included,
    with the passwords the Secret gives the server pods as environment."""
    import os

    from bus.server import nats_server_binary

    out, _ = _render(tmp_path, f"deploy.nats_replicas={replicas}")
    conf = next(d for d in _objects(out) if d["metadata"]["name"] == f"{RUN}-nats-config")["data"]["nats.conf"]
    assert ("cluster {" in conf) == (replicas == "3")
    path = tmp_path / "nats.conf"
    path.write_text(conf)
    secret = yaml.safe_load((out / "overlays" / RUN / "nats-auth.yaml").read_text())["stringData"]
    env = dict(os.environ, POD_NAME=f"{RUN}-nats-0", **secret)
    proc = subprocess.run([nats_server_binary(), "-t", "-c", str(path)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and "is valid" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def _learner(out: Path) -> tuple[dict, dict]:
    """The learner's StatefulSet and the Service its `serviceName` names (which must exist)."""
    objs = _objects(out)
    sts = next(d for d in objs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == f"{RUN}-learner")
    svc = next(d for d in objs if d["kind"] == "Service" and d["metadata"]["name"] == sts["spec"]["serviceName"])
    return sts, svc


def test_learner_is_one_pod_per_rank(tmp_path):
    """world_size 4: four pods of one StatefulSet, started together, one GPU each, meeting at pod 0 through
    the headless Service; each pod's rank, as learner/rendezvous.py reads it from the rendered env and its
    host name `<sts>-N`, is its ordinal; checkpoints on the shared ReadWriteMany run folder."""
    from learner.rendezvous import resolve
    from schemas.config import RunConfig

    out, _ = _render(tmp_path, "learner.world_size=4", "deploy.learner_device=cuda", namespace="team-a")
    sts, svc = _learner(out)
    spec, pod = sts["spec"], sts["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert spec["replicas"] == 4 and spec["podManagementPolicy"] == "Parallel"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["MASTER_ADDR"] == f"{RUN}-learner-0.{svc['metadata']['name']}.team-a.svc.cluster.local"
    assert env["WORLD_SIZE"] == "4" and env["LOCAL_RANK"] == "0" and "RANK" not in env  # the rank: the ordinal
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    port = int(env["MASTER_PORT"])
    assert {"name": "rendezvous", "port": port} in svc["spec"]["ports"]
    assert {"name": "rendezvous", "containerPort": port} in c["ports"]
    config = json.loads(
        next(d for d in _objects(out) if d["kind"] == "ConfigMap" and "config.json" in d["data"])["data"]["config.json"]
    )
    lc = RunConfig.model_validate(config).learner
    assert (lc.launch, lc.world_size) == ("external", 4)
    for ordinal in range(4):
        rv = resolve(lc, env, hostname=f"{sts['metadata']['name']}-{ordinal}")
        assert (rv.rank, rv.world, rv.addr, rv.port) == (ordinal, 4, env["MASTER_ADDR"], port)
    assert "volumeClaimTemplates" not in spec  # DCP: every rank writes its shards into one shared directory
    runs = next(m for m in c["volumeMounts"] if m["name"] == "runs")
    assert runs == {"name": "runs", "mountPath": "/runs", "readOnly": False}
    claim = next(v for v in pod["volumes"] if v["name"] == "runs")["persistentVolumeClaim"]["claimName"]
    pvc = next(d for d in _objects(out) if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == claim)
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_spawn_learner_stays_one_pod_and_one_rank_has_no_rendezvous(tmp_path):
    out, _ = _render(tmp_path, "learner.world_size=4", "deploy.learner_device=cuda", "learner.launch=spawn")
    sts, svc = _learner(out)
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert sts["spec"]["replicas"] == 1 and c["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {f"/runs/{RUN}/checkpoints"}
    assert "MASTER_ADDR" not in {e["name"] for e in c["env"]}
    out, _ = _render(tmp_path / "one")
    sts, svc = _learner(out)
    assert sts["spec"]["replicas"] == 1 and "publishNotReadyAddresses" not in svc["spec"]


CHART_KEYS = ROOT / "tests" / "data" / "nats_chart_values_keys.txt"
"""Key paths of the NATS chart's values.yaml (its header names the chart version and commit they come from)."""


def _key_paths(tree: dict, prefix: str = "") -> list[str]:
    """Dotted key paths of a values tree; below a `merge` / `patch` key the chart takes anything."""
    out = []
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        out.append(path)
        if isinstance(value, dict) and key not in ("merge", "patch"):
            out += _key_paths(value, path)
    return out


@pytest.mark.parametrize("sets", [[], ["deploy.nats_replicas=1", "deploy.storage_class=fast"]])
def test_helm_values_use_only_chart_keys(tmp_path, sets):
    """The rendered values.yaml sets only keys the official chart has (a misspelt key would be ignored by
    helm silently), and the auth include follows the chart's documented `$include` + configMap pattern."""
    chart = {line for line in CHART_KEYS.read_text().splitlines() if line and not line.startswith("#")}
    assert {"config.cluster.replicas", "config.jetstream.fileStore.pvc.size", "configMap.merge"} <= chart
    out, _ = _render(tmp_path, *sets)
    values = yaml.safe_load((out / "overlays" / RUN / "values.yaml").read_text())
    paths = _key_paths(values)
    assert len(paths) >= 12 and not sorted(set(paths) - chart), sorted(set(paths) - chart)
    include = values["config"]["merge"]["$include"]
    from bus.auth import server_auth_config

    # the included file is in the chart's ConfigMap, intact (values.yaml once indented it as badly as
    # its key: not YAML at all)
    assert values["configMap"]["merge"]["data"][include] == server_auth_config([RUN])
    assert values["config"]["cluster"]["enabled"] is (values["config"]["cluster"]["replicas"] > 1)
    assert _key_paths({"config": {"jetstream": {"filestore": {}}}})[-1] not in chart  # the check can fail
