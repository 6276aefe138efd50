"""Large public payloads by reference (issue 18): a repository over the domain's inline limit and a
diff over `rollout.artifact_inline_bytes` travel as objects of the run's payload bucket, named by
sha256, with messages carrying (uri, sha256, size). Everything here runs on the real session
nats-server; the end-to-end test runs the real sampler, rollout and verifier workers in-process
with docker episodes (marked `docker`, skipped with the reason when no engine answers).

The limits are set small (tens of bytes) so the tiny fixture repositories take the reference path.
"""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from bus.conn import ensure_topology
from bus.objects import put_blob
from bus.payloads import (
    PayloadCache,
    PayloadUnavailable,
    get_payload,
    pack_files,
    payload_name,
    payload_ref,
    put_payload,
    rebind,
    resolve_artifacts,
    unpack_files,
)
from bus.publish import publish_many
from bus.session import WorkerContext
from bus.streams import iter_stream
from bus.subjects import Registry
from bus.weight_stores import NatsStore
from producers.domains import TaskSkipped, make_source
from producers.repo_cache import load_task
from rollout_workers.agent import Episode
from rollout_workers.repo_payloads import PayloadMissing, offload_artifacts, resolve_workspaces
from schemas import BlobRef, DeadLetter, Reward, Task, Trajectory, Turn, decode, encode
from schemas.config import RunConfig
from tests.conftest import settled_consumer
from tests.messages import store_checks
from tests.test_repo_episode import docker_only, repo_image, tokenizer_dir  # noqa: F401 - fixtures
from verifier_workers import registry
from verifier_workers.verdict import Verdict
from verifier_workers.verifiers.repo import RepoSandboxInfraError, verify_repo

TASKS = ["fixture-clamp", "fixture-wordcount"]


def domain_config(**params) -> RunConfig:
    return RunConfig.model_validate(
        {
            "sampler": {
                "group_size": 2,
                "domains": {
                    "repo": {"max_turns": 8, "max_tokens": 1024, "params": {"tasks": TASKS, "eval_tasks": [], **params}}
                },
            }
        }
    )


async def object_names(js, bucket: str) -> list[str]:
    return sorted(await NatsStore(js, bucket).names())


# ---------------------------------------------------------------- the store: names, checks, retention
async def test_payloads_are_content_addressed_checked_and_out_of_weight_retentions_reach(js, run_id, drop_run):
    from learner.retention import Retention, version_name

    reg = Registry(run_id)
    await ensure_topology(js, reg)
    data = b"x" * 5000
    ref = await put_payload(js, reg, data)
    assert ref == await put_payload(js, reg, data) == payload_ref(reg, data)  # same bytes, same object
    assert ref.uri == f"nats-object://workspaces-{run_id}/sha256-{hashlib.sha256(data).hexdigest()}"
    assert await object_names(js, reg.workspace_bucket) == [payload_name(ref.sha256)]
    assert await get_payload(js, reg, ref) == data

    # weight retention prunes the weight store only, and only vNNNNNN.safetensors names
    weights = NatsStore(js, reg.object_bucket)
    for v in range(4):
        await weights.put(version_name(v), b"w%d" % v)
    await weights.put(payload_name(ref.sha256), b"not a version")  # even a payload-like name in the weights bucket
    deleted = await Retention(weights, keep=1, js=js, reg=reg).after_publish(3)
    assert deleted == 2 and sorted(await weights.names()) == sorted(
        [version_name(0), version_name(3), payload_name(ref.sha256)]
    )
    assert await Retention(NatsStore(js, reg.workspace_bucket), keep=1).after_publish(9) == 0
    assert await get_payload(js, reg, ref) == data

    missing = payload_ref(reg, b"never stored")
    with pytest.raises(PayloadUnavailable, match="not in the object store"):
        await get_payload(js, reg, missing)
    await put_blob(js, reg.workspace_bucket, payload_name(ref.sha256), b"y" * 5000)  # same name, other bytes
    with pytest.raises(PayloadUnavailable, match="sha256"):
        await get_payload(js, reg, ref)
    with pytest.raises(PayloadUnavailable, match="this run's payload bucket"):
        await get_payload(js, reg, payload_ref(Registry("otherrun"), data))
    with pytest.raises(ValueError, match="sha256-<sha256"):  # a ref must name its own content
        BlobRef(uri=f"nats-object://workspaces-{run_id}/sha256-{'0' * 64}", sha256=ref.sha256, size=ref.size)


async def test_a_planted_meta_is_repaired_by_the_writer_not_trusted(js, run_id, drop_run):
    """Issue 27: a meta under a workspace's name that claims its size and digest but points at other
    chunks. The old `_holds` believed the meta and skipped the write, so every task of that
    repository failed for the run; now the writer reads the bytes back and rewrites them."""
    import base64
    import json

    reg = Registry(run_id)
    await ensure_topology(js, reg)
    data = b"the real repository " * 300
    ref = payload_ref(reg, data)
    await put_blob(js, reg.workspace_bucket, "junk", b"j" * len(data), purge_replaced=False)
    store = await js.object_store(reg.workspace_bucket)
    junk = await store.get_info("junk")
    meta = {
        **junk.as_dict(),
        "name": payload_name(ref.sha256),
        "size": ref.size,
        "digest": "SHA-256=" + base64.urlsafe_b64encode(bytes.fromhex(ref.sha256)).decode(),
    }
    subject = f"$O.{reg.workspace_bucket}.M." + base64.urlsafe_b64encode(payload_name(ref.sha256).encode()).decode()
    await js.publish(subject, json.dumps(meta).encode(), headers={"Nats-Rollup": "sub"})
    planted = await store.get_info(payload_name(ref.sha256))
    assert planted.size == ref.size and planted.nuid == junk.nuid  # the meta lies about its chunks
    with pytest.raises(PayloadUnavailable, match="sha256"):
        await get_payload(js, reg, ref)  # a reader is never fooled: an infra error naming the object
    assert await put_payload(js, reg, data) == ref  # the writer checks the bytes and repairs the object
    assert await get_payload(js, reg, ref) == data


# ---------------------------------------------------------------- the producer side
def test_a_large_repository_travels_by_reference_and_a_huge_one_is_skipped():
    src = make_source("r1", "repo", domain_config(max_workspace_bytes=64))
    drawn = [src.make_task(None, 1, i) for i in range(4)]
    for d in drawn:
        task = load_task(d.hidden["task"]["task_id"])
        ref = d.task.workspace_ref
        assert d.task.workspace == {} and ref is not None and set(d.payloads) == {ref.sha256}
        assert unpack_files(d.payloads[ref.sha256]) == task.files and ref.size == len(d.payloads[ref.sha256])
        assert ref == payload_ref(Registry("r1"), pack_files(task.files))
        wire = encode(d.task)
        assert len(wire) < 4096 and decode(wire, Task).workspace_ref == ref
        for text in task.hidden_files.values():  # the payload is the public tree only
            assert text.encode() not in d.payloads[ref.sha256]
    assert drawn[0].task.workspace_ref == drawn[2].task.workspace_ref  # the same repository: one object
    assert make_source("r1", "repo", domain_config()).make_task(None, 1, 0).task.workspace_ref is None
    moved = rebind(drawn[0].task.workspace_ref, Registry("r2"))  # drawn as one run, published in another
    assert moved.uri.startswith("nats-object://workspaces-r2/") and moved.sha256 == drawn[0].task.workspace_ref.sha256

    capped = make_source("r1", "repo", domain_config(max_workspace_bytes=64, max_workspace_ref_bytes=128))
    with pytest.raises(TaskSkipped, match="workspace_too_large"):
        capped.make_task(None, 1, 0)
    assert capped.skipped["workspace_too_large"] == 1


# ---------------------------------------------------------------- the rollout side
async def test_rollout_resolves_a_workspace_once_and_refuses_a_corrupt_one(js, run_id, drop_run):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    src = make_source(run_id, "repo", domain_config(max_workspace_bytes=64))
    d = src.make_task(None, 1, 0)
    for blob in d.payloads.values():
        await put_payload(js, reg, blob)
    cache = PayloadCache(js, reg)
    (task,) = await resolve_workspaces([d.task], cache)
    assert task.workspace == load_task(d.hidden["task"]["task_id"]).files and task.msg_id == d.task.msg_id
    await put_blob(js, reg.workspace_bucket, payload_name(d.task.workspace_ref.sha256), b"corrupt")
    assert (await resolve_workspaces([d.task], cache))[0].workspace == task.workspace  # cached: fetched once
    with pytest.raises(PayloadMissing, match="sha256") as err:
        await resolve_workspaces([d.task], PayloadCache(js, reg))
    from rollout_workers.agent import SandboxUnavailable

    assert isinstance(err.value, SandboxUnavailable)  # the rollout worker's retry path


def _episode(task: Task, i: int, diff: bytes) -> Episode:
    return Episode(
        task=task,
        sample_index=i,
        turns=[Turn(role="prompt", text="p")],
        context=[],
        artifacts={"diff": diff, "small.txt": b"ok"},
    )


async def test_large_artifacts_leave_by_reference_once_and_small_ones_stay(js, run_id, drop_run):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    task = make_source(run_id, "repo", domain_config()).make_task(None, 1, 0).task
    big = b"--- a/x\n+++ b/x\n" + b"+line\n" * 40
    eps = [_episode(task, 0, big), _episode(task, 1, big), _episode(task, 2, b"tiny")]
    assert await offload_artifacts(js, reg, eps, inline_max=64) == 2
    trajs = [decode(encode(ep.trajectory()), Trajectory) for ep in eps]
    assert [sorted(t.artifacts) for t in trajs] == [["small.txt"], ["small.txt"], ["diff", "small.txt"]]
    assert trajs[0].artifact_refs["diff"] == trajs[1].artifact_refs["diff"] == payload_ref(reg, big, "artifact")
    assert await object_names(js, reg.artifact_bucket) == [payload_name(hashlib.sha256(big).hexdigest())]
    resolved = await resolve_artifacts(js, reg, trajs[0])
    assert resolved.artifacts["diff"] == big and resolved.artifact_refs == {} and trajs[0].artifact_refs
    with pytest.raises(ValueError, match="both inline and by reference"):
        trajs[0].model_validate({**trajs[0].model_dump(), "artifacts": {"diff": b"x"}})
    with pytest.raises(RepoSandboxInfraError, match="not resolved"):  # never scored as the final text
        verify_repo(trajs[0], {"task": load_task("fixture-clamp").to_json()})


# ---------------------------------------------------------------- the verifier side
@pytest.fixture
def diff_checker():
    """A verifier scoring 1 iff the `diff` artifact it sees is the expected bytes."""
    expected: dict[str, bytes] = {}

    def check(traj, hidden=None):
        return Verdict({"correct": float(traj.artifacts.get("diff") == expected[traj.msg_id])})

    registry.register("t_diff", check, replace=True)
    yield expected
    registry.unregister("t_diff")


def _traj(run_id: str, i: int, ref: BlobRef) -> Trajectory:
    return Trajectory(
        run_id=run_id,
        msg_id=f"tr-{i}",
        task_id=f"t{i}",
        task_msg_id=f"task-{i}",
        domain="repo",
        group_id=f"g{i}",
        group_size=1,
        sample_index=0,
        turns=[Turn(role="assistant", text="done")],
        verifier="t_diff",
        policy_version=0,
        final_text="done",
        artifact_refs={"diff": ref},
    )


@pytest.mark.e2e
async def test_verifier_resolves_diffs_by_reference_and_dead_letters_missing_or_corrupt_ones(
    js, run_id, tmp_path, drop_run, diff_checker, monkeypatch
):
    from schemas.config import VerifierSection
    from verifier_workers.worker import run

    monkeypatch.delenv("RLBUS_TOOL_SECRET", raising=False)
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    good_diff, corrupt_diff = b"+good\n" * 100, b"+corrupt\n" * 100
    good = _traj(run_id, 0, await put_payload(js, reg, good_diff, "artifact"))
    missing = _traj(run_id, 1, payload_ref(reg, b"+never stored\n", "artifact"))
    corrupt = _traj(run_id, 2, await put_payload(js, reg, corrupt_diff, "artifact"))
    await store_checks(js, reg, (good, missing, corrupt))
    await put_blob(js, reg.artifact_bucket, payload_name(corrupt.artifact_refs["diff"].sha256), b"+other\n" * 100)
    diff_checker.update({good.msg_id: good_diff, missing.msg_id: b"", corrupt.msg_id: corrupt_diff})
    await publish_many(js, [(reg.traj("repo"), t) for t in (good, missing, corrupt)])

    cfg = RunConfig(
        verifier=VerifierSection(ack_wait_s=1.0, batch=4, retry_base_s=0.05, retry_max_s=0.2, concurrency=1)
    )
    counters = await run(
        cfg, WorkerContext(run_id=run_id, nats_url=js._nc.connected_url.geturl(), run_path=tmp_path, until_idle=6.0)
    )
    rewards = [decode(d, Reward) async for _, d in iter_stream(js, reg.stream("REWARDS"), reg.rewards("repo"))]
    assert [(r.trajectory.msg_id, r.reward) for r in rewards] == [(good.msg_id, 1.0)]
    embedded = rewards[0].trajectory  # as it arrived: the ref, not the bytes
    assert embedded.artifact_refs == good.artifact_refs and "diff" not in embedded.artifacts
    letters = [decode(d, DeadLetter) async for _, d in iter_stream(js, reg.stream("DLQ"), reg.dlq("verifier"))]
    by_traj = {decode(dl.original_data, Trajectory).msg_id: dl for dl in letters}
    assert set(by_traj) == {missing.msg_id, corrupt.msg_id}
    for dl in by_traj.values():
        assert dl.error_type == "infra_error" and "PayloadUnavailable" in dl.reason
        assert dl.delivery_count == reg.verifier_consumer().max_deliver
    assert "not in the object store" in by_traj[missing.msg_id].reason and "sha256" in by_traj[corrupt.msg_id].reason
    assert counters["infra_errors"] == 2 * reg.verifier_consumer().max_deliver
    info = await settled_consumer(js, reg.stream("TRAJ"), "verifier")
    assert info.num_pending == 0 and info.num_ack_pending == 0


# ---------------------------------------------------------------- docker: sampler -> rollout -> verifier
def pipeline_config(scripts, tokenizer: str) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"path": tokenizer},
            "sampler": {
                "group_size": 2,
                "max_inflight_tasks": 8,
                "publish_batch": 2,
                "domains": {
                    "repo": {
                        "max_turns": 6,
                        "max_tokens": 2048,
                        "params": {"tasks": TASKS, "eval_tasks": [], "max_workspace_bytes": 64},
                    }
                },
            },
            "rollout": {
                "engine": "scripted",
                "scripted": {"dir": str(scripts)},
                "batch_tasks": 2,
                "max_context_tokens": 16384,
                "ack_wait_s": 120,
                "artifact_inline_bytes": 64,
            },
            "sandbox": {"backend": "docker", "memory_mb": 512, "pids": 64, "timeout_s": 60, "warm_pool": 0},
            "verifier": {"concurrency": 1, "ack_wait_s": 120},
        }
    )


@docker_only
async def test_repo_tasks_by_reference_flow_sampler_rollout_verifier_and_resolve(
    js, run_id, tmp_path, drop_run, repo_image, tokenizer_dir, monkeypatch
):
    """Both repositories (about 400 bytes) are over max_workspace_bytes = 64 and every gold diff
    over artifact_inline_bytes = 64: tasks carry workspace refs, trajectories diff refs, and every
    sample resolves; nothing is lost or dead-lettered."""
    from learner.weights import publish_version
    from producers.sampler import run as run_sampler
    from rollout_workers.engines.scripted_engine import gold_steps, write_script
    from rollout_workers.worker import run as run_rollout
    from verifier_workers.worker import run as run_verifier

    monkeypatch.delenv("RLBUS_TOOL_SECRET", raising=False)
    monkeypatch.setenv("RLBUS_REPO_SANDBOX_IMAGE", repo_image)
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    for tid in TASKS:
        write_script(tmp_path / "gold", tid, gold_steps(load_task(tid).gold_patch))
    cfg = pipeline_config(tmp_path / "gold", tokenizer_dir)
    cfg.sandbox.repo_image = repo_image
    url = js._nc.connected_url.geturl()

    def ctx(n=None, idle=None):
        return WorkerContext(
            run_id=run_id,
            nats_url=url,
            run_path=tmp_path / "run",
            max_messages=n,
            until_idle=idle,
            configured_model=tokenizer_dir,
        )

    await publish_version(js, reg, None, 0, 0, {})  # version 0: rollout takes no task before one
    published = await run_sampler(cfg, ctx(n=2))
    assert published["published"] == 2
    workspaces = {payload_name(payload_ref(reg, pack_files(load_task(t).files)).sha256) for t in TASKS}
    assert workspaces <= set(await object_names(js, reg.workspace_bucket))  # stored before publishing

    rolled = await run_rollout(cfg, ctx(n=2, idle=30.0))
    assert rolled["trajectories"] == 4 and rolled["artifacts_by_ref"] == 4
    scored = await asyncio.wait_for(run_verifier(cfg, ctx(idle=5.0)), 600)
    assert scored["rewards"] == 4 and scored.get("infra_errors", 0) == 0

    rewards = [decode(d, Reward) async for _, d in iter_stream(js, reg.stream("REWARDS"), reg.rewards("repo"))]
    assert len(rewards) == 4
    for r in rewards:
        assert r.status == "ok" and r.components["resolved"] == 1.0, r.details
        t = r.trajectory
        assert "diff" not in t.artifacts and t.artifact_refs["diff"].size > 64
        gold = load_task(t.verifier_params["repo_task"]).gold_patch.encode()
        assert await get_payload(js, reg, t.artifact_refs["diff"]) == gold
    assert len(await object_names(js, reg.workspace_bucket)) == 2  # two workspaces
    assert len(await object_names(js, reg.artifact_bucket)) == 2  # two distinct gold diffs (G samples share one)
    letters = [d async for _, d in iter_stream(js, reg.stream("DLQ"), reg.all("dlq"))]
    assert letters == []
    for stream, durable in ((reg.stream("TASKS"), "rollout"), (reg.stream("TRAJ"), "verifier")):
        info = await settled_consumer(js, stream, durable)
        assert info.num_pending == 0 and info.num_ack_pending == 0, (stream, info)


# ---------------------------------------------------------------- a corrupt workspace: retried, never published
@pytest.mark.e2e
async def test_a_corrupt_workspace_is_retried_until_its_deliveries_run_out_and_never_rolled_out(
    js, nats_url, run_id, tmp_path, drop_run, tokenizer_dir, monkeypatch
):
    """No sandbox opens and no trajectory is published; the task is naked until its deliveries run
    out, when JetStream's MAX_DELIVERIES advisory (which the scheduler turns into a dead letter) fires."""
    from bus.conn import connect
    from learner.weights import publish_version
    from rollout_workers.worker import run as run_rollout

    monkeypatch.delenv("RLBUS_TOOL_SECRET", raising=False)
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    d = make_source(run_id, "repo", domain_config(max_workspace_bytes=64)).make_task(None, 1, 0)
    await put_blob(js, reg.workspace_bucket, payload_name(d.task.workspace_ref.sha256), b"not the repository")
    await publish_version(js, reg, None, 0, 0, {})
    advisories: list = []

    async def on_advisory(msg):
        advisories.append(msg)

    nc = await connect(nats_url, name="pytest-advisories")
    sub = await nc.subscribe(
        f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{reg.stream('TASKS')}.rollout", cb=on_advisory
    )
    await publish_many(js, [(reg.tasks("repo"), d.task)])
    cfg = pipeline_config(tmp_path, tokenizer_dir)
    cfg.rollout.ack_wait_s = 1.0  # backoff 1/2/4 s: the five deliveries within about half a minute
    ctx = WorkerContext(
        run_id=run_id, nats_url=nats_url, run_path=tmp_path / "run", until_idle=12.0, configured_model=tokenizer_dir
    )
    try:
        counters = await asyncio.wait_for(run_rollout(cfg, ctx), 120)
        for _ in range(50):
            if advisories:
                break
            await asyncio.sleep(0.1)
    finally:
        await sub.unsubscribe()
        await nc.close()
    assert counters.get("trajectories", 0) == 0 and counters["retry"] == reg.rollout_consumer().max_deliver
    assert (await js.stream_info(reg.stream("TRAJ"))).state.messages == 0
    assert len(advisories) == 1
