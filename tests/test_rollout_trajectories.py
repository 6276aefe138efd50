"""The rollout worker's single-turn trajectories (`rollout_workers.worker.single_turn_trajectories`):
one per engine sample, built by `Trajectory.from_task`, with exactly the fields and derived ids
the rollout worker has always published (docs/architecture.md "Messages")."""

from __future__ import annotations

from rollout_workers.engines.null_engine import NullEngine
from rollout_workers.worker import single_turn_trajectories
from schemas import ChatMessage, Task, Trajectory, Turn, decode, encode, pack_f32, pack_i32
from schemas.episode import render_prompt


def test_one_trajectory_per_sample_with_derived_ids():
    task = Task(
        run_id="r1",
        task_id="arith-3-9",
        domain="arith",
        difficulty=3,
        group_size=3,
        pool="long",
        prompt=[ChatMessage(role="system", content="Be brief. "), ChatMessage(role="user", content="2+3=")],
        verifier="arith",
        verifier_params={"expression": "2+3"},
        max_tokens=4,
    )
    [samples] = NullEngine().generate([render_prompt(task.prompt)], task.group_size, task.max_tokens, 1.0)
    trajs = single_turn_trajectories(task, samples, 7, 0.25)
    assert len(trajs) == 3
    for i, (traj, s) in enumerate(zip(trajs, samples, strict=True)):
        expected = Trajectory(
            run_id="r1",
            msg_id=f"{task.msg_id}-{i}",
            task_id="arith-3-9",
            task_msg_id=task.msg_id,
            domain="arith",
            difficulty=3,
            purpose="train",
            group_id=task.msg_id,
            group_size=3,
            sample_index=i,
            turns=[
                Turn(role="prompt", text="Be brief. 2+3=", token_ids=pack_i32(s.prompt_ids)),
                Turn(
                    role="assistant",
                    text="0",
                    token_ids=pack_i32(s.token_ids),
                    logprobs=pack_f32(s.logprobs),
                    trainable=True,
                    policy_version=7,
                ),
            ],
            verifier="arith",
            verifier_params={"expression": "2+3"},
            hidden_ref=None,
            pool="long",
            finish_reason="stop",
            final_text="0",
            policy_version=7,
            generate_seconds=0.25,
            tokens=2,
        )
        assert traj.model_dump(exclude={"created_at"}) == expected.model_dump(exclude={"created_at"})
        assert decode(encode(traj)) == traj
    # the prompt turn holds the ids the engine read, which are the rendered prompt's
    assert NullEngine().decode(samples[0].prompt_ids) == "Be brief. 2+3="
