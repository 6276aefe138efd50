"""Message factories shared by the bus and stage tests: one arith task ("2+3=") and its
trajectories, always built from the same values so tests can assert on them."""

from __future__ import annotations

from schemas import ChatMessage, Task, Trajectory, Turn, pack_f32, pack_i32


def make_task(run_id: str, task_id: str = "arith-1-0", *, group_size: int = 4, **kw) -> Task:
    """The arith task "2+3=" (verifier "arith", expression "2+3"); `kw` sets any other field."""
    return Task(
        run_id=run_id,
        task_id=task_id,
        domain="arith",
        group_size=group_size,
        prompt=[ChatMessage(role="user", content="2+3=")],
        verifier="arith",
        verifier_params={"expression": "2+3"},
        **kw,
    )


def make_trajectory(run_id: str, task: Task, index: int = 0, text: str = "5") -> Trajectory:
    """Sample `index` of `task`'s group: the prompt turn and one trainable assistant turn
    answering `text` at policy version 3 (msg id "<task msg id>-<index>")."""
    turns = [
        Turn(role="prompt", text="2+3=", token_ids=pack_i32([50, 43, 51, 61])),
        Turn(
            role="assistant",
            text=text,
            token_ids=pack_i32([53, 1]),
            logprobs=pack_f32([-0.5, -0.25]),
            trainable=True,
            policy_version=3,
        ),
    ]
    return Trajectory(
        run_id=run_id,
        msg_id=f"{task.msg_id}-{index}",
        task_id=task.task_id,
        task_msg_id=task.msg_id,
        domain="arith",
        group_id=task.msg_id,
        group_size=task.group_size,
        sample_index=index,
        turns=turns,
        verifier="arith",
        verifier_params=task.verifier_params,
        final_text=text,
        policy_version=3,
        tokens=2,
    )


async def store_checks(js, reg, tasks) -> None:
    """Store the tasks' checks as their publisher does (`bus.checks.put_checks`): the verifier
    scores a trajectory only by its task's check, so tests that publish tasks or trajectories
    themselves must store it first."""
    from bus.checks import put_checks

    await put_checks(js, reg, list(tasks), {})
