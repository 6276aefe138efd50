"""Wire messages: round trips, the envelope on the wire, packed arrays, and DecodeError fields."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from schemas import (
    SCHEMA_VERSION,
    ChatMessage,
    DeadLetter,
    DecodeError,
    EvalResult,
    Metric,
    Reward,
    Task,
    TaskFate,
    TaskFates,
    Trajectory,
    Turn,
    WeightPrefetch,
    WeightVersion,
    decode,
    encode,
    pack_f32,
    pack_i32,
    unpack_f32,
    unpack_i32,
)
from schemas.messages import KINDS

RUN = "r1"
ENVELOPE = ("kind", "schema_version", "run_id", "msg_id", "created_at")


def _traj(**kw) -> Trajectory:
    base = dict(
        run_id=RUN,
        task_id="t1",
        task_msg_id="m1",
        domain="arith",
        group_id="g1",
        group_size=2,
        sample_index=0,
        verifier="arith",
        policy_version=3,
        final_text="42",
        tokens=2,
        turns=[
            Turn(role="prompt", text="1+1=", token_ids=pack_i32([20, 15, 20, 33])),
            Turn(
                role="assistant",
                text="2",
                token_ids=pack_i32([21, 1]),
                logprobs=pack_f32([-0.5, -1.25]),
                trainable=True,
                policy_version=3,
            ),
        ],
    )
    base.update(kw)
    return Trajectory(**base)


def samples() -> list:
    """One populated instance of every message kind."""
    traj = _traj()
    return [
        Task(
            run_id=RUN,
            task_id="t1",
            domain="arith",
            group_size=4,
            verifier="arith",
            prompt=[ChatMessage(role="user", content="1+1=")],
            tools=["python"],
            verifier_params={"answer_len": 2},
            hidden_ref="gold://x",
        ),
        traj,
        Reward(run_id=RUN, trajectory=traj, reward=1.0, components={"correct": 1.0}, details="ok"),
        WeightPrefetch(run_id=RUN, version=2, step=5, uri="file:///w/v000002.safetensors", bytes=10),
        WeightVersion(
            run_id=RUN, version=2, step=5, uri="nats-object://b/v2", sha256="ab" * 32, bytes=10, metrics={"loss": 0.5}
        ),
        DeadLetter(
            run_id=RUN,
            stage="verifier",
            reason="bad",
            original_subject="traj.r1.arith",
            original_data=b"\x00\xffraw",
            original_headers={"Nats-Msg-Id": "x"},
            task_msg_id="m1",
        ),
        Metric(run_id=RUN, role="rollout", worker_id="w1", values={"tokens": 3.0}),
        EvalResult(run_id=RUN, version=1, step=1, domain="arith", score=0.5, n=10, eval_set_sha256="cd" * 32),
        TaskFates(
            run_id=RUN,
            stage="learner",
            step=1,
            fates=[TaskFate(task_msg_id="m1", fate="trained", reward_msg_ids=["a", "b"])],
        ),
    ]


def test_samples_cover_every_kind():
    assert {type(m).KIND for m in samples()} == set(KINDS)


@pytest.mark.parametrize("msg", samples(), ids=lambda m: type(m).KIND)
def test_round_trip(msg):
    data = encode(msg)
    back = decode(data)
    assert type(back) is type(msg)
    assert back == msg
    assert decode(data, type(msg)) == msg


@pytest.mark.parametrize("msg", samples(), ids=lambda m: type(m).KIND)
def test_wire_is_one_plain_msgpack_map_with_envelope(msg):
    body = msgpack.unpackb(encode(msg), raw=False)
    assert isinstance(body, dict)
    for key in ENVELOPE:
        assert key in body, key
    assert body["kind"] == type(msg).KIND
    assert body["schema_version"] == SCHEMA_VERSION
    assert body["run_id"] == RUN and body["msg_id"] == msg.msg_id
    assert isinstance(body["created_at"], float)


def test_token_arrays_are_msgpack_bin():
    body = msgpack.unpackb(encode(_traj()), raw=False)
    turn = body["turns"][1]
    assert type(turn["token_ids"]) is bytes and type(turn["logprobs"]) is bytes
    assert unpack_i32(turn["token_ids"]).tolist() == [21, 1]
    assert unpack_f32(turn["logprobs"]).tolist() == [-0.5, -1.25]
    # bin, not str: the raw msgpack type byte of a bin8 is 0xc4
    assert b"\xc4\x08" + pack_i32([21, 1]) in encode(_traj())


def test_pack_unpack_round_trip():
    ids = np.array([0, 1, -5, 2**31 - 1, -(2**31)], dtype=np.int64)
    out = unpack_i32(pack_i32(ids))
    assert out.dtype == np.int32 and out.tolist() == ids.tolist()
    assert len(pack_i32(ids)) == 4 * len(ids)
    lp = np.array([-0.0, -1.5, -123.25, 3.0e-8], dtype=np.float32)
    back = unpack_f32(pack_f32(lp.tolist()))
    assert back.dtype == np.float32 and np.array_equal(back, lp)
    assert pack_i32([]) == b"" and unpack_i32(b"").size == 0
    assert pack_i32([1]) == b"\x01\x00\x00\x00"  # little endian


def _body(msg) -> dict:
    return msgpack.unpackb(encode(msg), raw=False)


def _pack(body) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def _field_of(data: bytes) -> str:
    with pytest.raises(DecodeError) as ei:
        decode(data)
    assert ei.value.reason
    return ei.value.field


def test_decode_error_not_msgpack():
    assert _field_of(b"\xc1") == "<payload>"  # 0xc1 is never used in msgpack
    assert _field_of(b"") == "<payload>"


def test_decode_error_not_a_map():
    assert _field_of(_pack([1, 2, 3])) == "<payload>"
    assert _field_of(_pack("task")) == "<payload>"


def test_decode_error_schema_version():
    body = _body(samples()[0])
    body["schema_version"] = SCHEMA_VERSION + 1
    assert _field_of(_pack(body)) == "schema_version"
    del body["schema_version"]
    assert _field_of(_pack(body)) == "schema_version"


def test_decode_error_unknown_kind():
    body = _body(samples()[0])
    body["kind"] = "nonsense"
    assert _field_of(_pack(body)) == "kind"
    del body["kind"]
    assert _field_of(_pack(body)) == "kind"


def test_decode_error_expected_kind():
    with pytest.raises(DecodeError) as ei:
        decode(encode(samples()[0]), Reward)
    assert ei.value.field == "kind"


def test_decode_error_nested_packed_length():
    body = _body(_traj())
    body["turns"][0]["token_ids"] = b"\x01\x02\x03"  # 3 bytes: not a multiple of 4
    assert _field_of(_pack(body)) == "turns.0.token_ids"
    body = _body(_traj())
    body["turns"][1]["logprobs"] = b"\x00" * 6
    assert _field_of(_pack(body)) == "turns.1.logprobs"


def test_decode_error_nested_wrong_type():
    body = _body(samples()[2])  # reward
    body["trajectory"]["turns"][1]["trainable"] = "maybe"
    assert _field_of(_pack(body)) == "trajectory.turns.1.trainable"
    body = _body(samples()[2])
    body["trajectory"]["turns"][0]["token_ids"] = [1, 2, 3]  # a list instead of bin
    assert _field_of(_pack(body)).startswith("trajectory.turns.0.token_ids")


def test_decode_error_missing_required_field():
    body = _body(samples()[0])
    del body["verifier"]
    assert _field_of(_pack(body)) == "verifier"
    body = _body(samples()[0])
    del body["run_id"]
    assert _field_of(_pack(body)) == "run_id"


def test_decode_error_unknown_extra_field():
    body = _body(samples()[0])
    body["surprise"] = 1
    assert _field_of(_pack(body)) == "surprise"
    body = _body(_traj())
    body["turns"][0]["extra"] = True
    assert _field_of(_pack(body)) == "turns.0.extra"


def test_decode_error_is_a_value_error_with_field_in_message():
    body = _body(samples()[0])
    del body["domain"]
    with pytest.raises(ValueError, match="domain"):
        decode(_pack(body))


def test_glance_reward_reads_what_decode_reads():
    from schemas import ToolCall, glance_reward

    calls = [
        ToolCall(turn=1, tool="python", code="print(1)", duration_ms=120.0),
        ToolCall(turn=1, tool="run_tests", code="", duration_ms=30.5),
    ]
    for traj in (_traj(), _traj(difficulty=4, purpose="eval", generate_seconds=0.25, tool_calls=calls)):
        r = Reward(run_id=RUN, trajectory=traj, reward=0.5, status="invalid")
        g = glance_reward(encode(r))
        full = decode(encode(r), Reward)
        assert (g.run_id, g.reward, g.status, g.domain, g.difficulty, g.purpose, g.generate_seconds) == (
            full.run_id,
            full.reward,
            full.status,
            full.trajectory.domain,
            full.trajectory.difficulty,
            full.trajectory.purpose,
            full.trajectory.generate_seconds,
        )
        assert g.tool_calls == tuple((c.tool, c.duration_ms) for c in full.trajectory.tool_calls)
        assert g.task_id == full.trajectory.task_id and g.task_id


def test_glance_reward_refuses_what_is_not_a_reward():
    from schemas import glance_reward

    reward = Reward(run_id=RUN, trajectory=_traj(), reward=1.0)
    bad = [
        b"\xc1",
        _pack([1, 2]),
        encode(_traj()),  # not msgpack, not a map, another kind
        _pack({**_body(reward), "schema_version": SCHEMA_VERSION + 1}),
    ]
    body = _body(reward)
    body["trajectory"] = {**body["trajectory"], "domain": 7}
    bad.append(_pack(body))
    body = _body(reward)
    del body["reward"]
    bad.append(_pack(body))
    body = _body(reward)
    body["trajectory"] = {**body["trajectory"], "difficulty": "3"}
    bad.append(_pack(body))
    for data in bad:
        with pytest.raises(DecodeError):
            glance_reward(data)


def test_render_prompt_is_the_contents_in_order():
    from schemas.episode import render_prompt

    prompt = [ChatMessage(role="system", content="Answer.\n"), ChatMessage(role="user", content="1+1=")]
    assert render_prompt(prompt) == "Answer.\n1+1="
    assert render_prompt([]) == ""


def test_trajectory_from_task_derives_ids_and_copies_the_task():
    """The one builder: msg_id `<task msg_id>-<sample index>`, group_id the task's msg_id, every
    task field copied, and what the turns say (last answer, its version, generated tokens)."""
    from schemas import ToolCall

    task = Task(
        run_id=RUN,
        task_id="t7",
        domain="tool_calc",
        difficulty=3,
        purpose="eval",
        group_size=4,
        prompt=[ChatMessage(role="user", content="6*7=")],
        tools=["python"],
        verifier="tool_calc",
        verifier_params={"expression": "6*7"},
        hidden_ref="gold://7",
        pool="long",
    )
    turns = [
        Turn(role="prompt", text="6*7=", token_ids=pack_i32([1, 2, 3, 4])),
        Turn(
            role="assistant",
            text="<py>6*7</py>",
            token_ids=pack_i32([5, 6, 7]),
            logprobs=pack_f32([0.0] * 3),
            trainable=True,
            policy_version=4,
        ),
        Turn(role="tool", text="<obs>42</obs>", token_ids=pack_i32([8, 9])),
        Turn(
            role="assistant",
            text="=42",
            token_ids=pack_i32([10, 11]),
            logprobs=pack_f32([0.0] * 2),
            trainable=True,
            policy_version=5,
        ),
    ]
    calls = [ToolCall(turn=1, tool="python", code="6*7", exec_id="e1")]
    traj = Trajectory.from_task(
        task, 2, turns, finish_reason="stop", generate_seconds=0.5, tool_calls=calls, artifacts={"out.txt": b"42"}
    )
    expected = Trajectory(
        run_id=RUN,
        msg_id=f"{task.msg_id}-2",
        task_id="t7",
        task_msg_id=task.msg_id,
        domain="tool_calc",
        difficulty=3,
        purpose="eval",
        group_id=task.msg_id,
        group_size=4,
        sample_index=2,
        turns=turns,
        verifier="tool_calc",
        verifier_params={"expression": "6*7"},
        hidden_ref="gold://7",
        pool="long",
        finish_reason="stop",
        final_text="=42",
        policy_version=5,
        generate_seconds=0.5,
        tokens=5,
        tool_calls=calls,
        artifacts={"out.txt": b"42"},
    )
    assert traj.model_dump(exclude={"created_at"}) == expected.model_dump(exclude={"created_at"})
    assert decode(encode(traj)) == traj
    # another sample of the same task: its own id, the same group
    other = Trajectory.from_task(task, 0, turns[:2], finish_reason="length")
    assert (other.msg_id, other.group_id, other.sample_index) == (f"{task.msg_id}-0", task.msg_id, 0)
    assert (other.final_text, other.policy_version, other.tokens, other.finish_reason) == (
        "<py>6*7</py>",
        4,
        3,
        "length",
    )
    assert other.tool_calls == [] and other.artifacts == {}
    # no model turn at all: version -1, nothing generated
    bare = Trajectory.from_task(task, 1, turns[:1], finish_reason="error")
    assert (bare.final_text, bare.policy_version, bare.tokens) == ("", -1, 0)


def test_harbor_statuses_are_counted_per_task_in_the_summary():
    """A task whose tests leave no reward file is named in summary.json, not only its domain."""
    from rlbus.run.monitor import DomainRewards
    from schemas import glance_reward

    dr = DomainRewards()
    for task_id, status in [("a", "ok"), ("b", "no_reward_file"), ("b", "no_reward_file"), ("c", "bad_reward_file")]:
        traj = _traj(task_id=task_id, domain="tb", verifier="harbor")
        dr.add(glance_reward(encode(Reward(run_id=RUN, trajectory=traj, reward=0.0, status=status))))
    s = dr.as_dict()
    assert s["statuses"] == {"ok": 1, "no_reward_file": 2, "bad_reward_file": 1}
    assert s["task_statuses"] == {"no_reward_file": {"b": 2}, "bad_reward_file": {"c": 1}}
