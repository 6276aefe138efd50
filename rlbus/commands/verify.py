"""`rlbus verify`: score one answer locally with a built-in (or plugin) verifier; no NATS.

    rlbus verify --domain D [--task-id ID] [--gold G] --answer-file F [--backend docker|process]
    rlbus verify --domain rg-<dataset> --seed S --index I [--level L] [--config FILE] --answer-file F
    rlbus verify --domain repo (--task-id ID [--task-cache DIR] | --task-file T.json) --patch-file F
    rlbus verify --domain TB --config FILE --task-id NAME --script F.sh     (a harbor domain)

Guarantees:
- Prints exactly ONE JSON line on stdout: `{"reward", "components", "status", "details",
  "backend"}` and exits 0 whenever the verifier produced a verdict (whatever the reward).
  Exits 2 with the reason on stderr when the inputs are unusable (unknown problem id,
  missing --gold, a VerifierInputError), 3 when the sandbox failed (`SandboxInfraError`).
- The verdict is exactly what a verifier worker would publish for the same trajectory and
  hidden payload: the same registry function is called with `(traj, hidden)`.
- `--domain` picks the verifier (`code`, `math`, `arith`, `extract`, or any registered
  name; a config-style domain name works when it equals the verifier's name).
- `--backend` matters only for sandboxed verifiers (`code`); default: docker when an
  engine answers and the docker backend exists, else process. `backend` in the output is
  the one used (`none` for verifiers that run no sandbox).
- A task domain (`rg-<dataset>`, or any domain with `--config` and `--index`) scores the
  answer against the task `rlbus tasks show` prints for the same flags (the sampler's code
  path, `rlbus.commands.tasks.draw`), with its hidden payload, composed exactly as a verifier
  worker composes it (`verifier_workers.worker.score`: the domain's reward weights too).
  A verifier that cannot run (`VerifierInfraError`, e.g. a scorer that raises) exits 3.
- `--domain repo` scores the unified diff in `--patch-file` (then `--answer-file` is not
  needed) against a repo task: `--task-id` loads it from the task cache
  (`producers.repo_cache.load_task`, imported only here), `--task-file` reads a RepoTask
  JSON file. The trajectory carries the diff as its `diff` artifact, exactly as the
  rollout side exports it; `backend` is `docker`. The repo sandbox failing exits 3.
- A harbor domain (`--config` naming it, `--task-id NAME`, `--script FILE`) runs FILE with bash
  as the agent's actions in a fresh container of the task, then verifies it exactly as the
  `harbor` verifier does (`sandbox_workers.harbor_check.run_script`); docker failing exits 3.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EPILOG = """how each verifier reads its inputs:
  code     F holds the candidate program (complete function definitions; a ```python
           fence or a body-only completion is accepted too); --task-id is a HumanEval id
           (HumanEval/0 .. HumanEval/163) whose hidden tests are used.
  math     F holds the model's answer (\\boxed{...} or a final number); --gold is the
           gold answer (e.g. '\\frac{1}{2}').
  arith    F holds the answer; --task-id (or --gold) is the expression, e.g. '12*7+3'.
  extract  F holds the answer text with a JSON object; --gold is the gold JSON object.
  repo     --patch-file F holds a unified diff against the task's repository; --task-id is a
           cached repo task (`rlbus tasks list --domain repo`), or --task-file a RepoTask JSON.
  rg-*     F holds the model's reply (answer in <answer>...</answer>, else its last line);
           --seed/--index/--level name the task as `rlbus tasks show` does.

examples:
  rlbus verify --domain code --task-id HumanEval/0 --answer-file solution.py
  rlbus verify --domain code --task-id HumanEval/0 --answer-file solution.py --backend process
  rlbus verify --domain math --gold '\\frac{1}{2}' --answer-file answer.txt
  rlbus verify --domain arith --task-id '12*7+3' --answer-file answer.txt
  rlbus verify --domain extract --gold '{"name": "Ada", "year": 1843}' --answer-file reply.txt
  rlbus verify --domain rg-leg_counting --seed 0 --index 7 --answer-file reply.txt
  rlbus verify --domain repo --task-id fixture-calc --patch-file fix.diff

output (one JSON line):
  {"reward": 1.0, "components": {"correct": 1.0, "compiles": 1.0, "pass_rate": 1.0},
   "status": "ok", "details": "pass: 7/7 assertions; ...", "backend": "process"}
exit status: 0 verdict printed, 2 unusable input, 3 sandbox or verifier infrastructure failure.
"""


def register(sub) -> None:
    """Add `verify` to the `rlbus` subcommands."""
    p = sub.add_parser(
        "verify",
        help="score one answer locally with a verifier (no NATS)",
        description="Verify one answer file with a built-in verifier, locally, without NATS, "
        "and print one JSON line with the reward.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--domain", required=True, help="verifier / domain: code, math, arith, extract (or a plugin)")
    p.add_argument("--task-id", help="problem id: a HumanEval id for code, the expression for arith")
    p.add_argument("--gold", help="gold answer: text for math, a JSON object for extract, the expression for arith")
    p.add_argument("--answer-file", help="file with the answer to score ('-' reads stdin); optional with --patch-file")
    p.add_argument("--patch-file", help="repo: file with the candidate unified diff ('-' reads stdin)")
    p.add_argument("--task-file", help="repo: a RepoTask JSON file (instead of --task-id)")
    p.add_argument("--task-cache", help="repo: the task cache dir for --task-id (default: the shipped cache)")
    p.add_argument("--backend", choices=("docker", "process"), help="sandbox for code (default: docker if reachable)")
    p.add_argument("--timeout", type=float, help="code: seconds the candidate may run (default 10)")
    p.add_argument("--script", help="harbor domains (with --config): a bash file run as the agent's actions")
    from rlbus.commands.tasks import add_task_args

    add_task_args(p, domain=False)
    p.set_defaults(func=main)


class InputProblem(ValueError):
    """The command's inputs cannot be verified."""


def _trajectory(domain: str, answer: str, params: dict, hidden_ref: str | None):
    from schemas import Trajectory

    return Trajectory(
        run_id="cli",
        task_id=params.get("problem_id", "cli"),
        task_msg_id="cli",
        domain=domain,
        group_id="cli",
        group_size=1,
        sample_index=0,
        turns=[],
        verifier=domain,
        verifier_params=params,
        hidden_ref=hidden_ref,
        policy_version=0,
        final_text=answer,
    )


def _inputs(args) -> tuple[dict, dict | None]:
    """(verifier_params, hidden payload) for the chosen verifier."""
    d = args.domain
    if d == "code":
        if not args.task_id:
            raise InputProblem("--domain code needs --task-id, e.g. --task-id HumanEval/0")
        from producers.domains import code as he

        try:
            p = he.get(args.task_id)
        except KeyError as exc:
            raise InputProblem(str(exc.args[0])) from None
        params = {"entry_point": p.entry_point, "problem_id": p.task_id}
        if args.timeout:
            params["timeout_s"] = args.timeout
        return params, p.hidden
    if d == "arith":
        expr = args.task_id or args.gold
        if not expr:
            raise InputProblem("--domain arith needs the expression as --task-id (or --gold)")
        return {"expression": expr}, None
    if d == "extract":
        if args.gold is None:
            raise InputProblem("--domain extract needs --gold with a JSON object")
        try:
            gold = json.loads(args.gold)
        except json.JSONDecodeError as exc:
            raise InputProblem(f"--gold is not JSON: {exc}") from None
        return {}, {"gold": gold}
    if args.gold is None:
        raise InputProblem(f"--domain {d} needs --gold")
    return {}, {"gold": args.gold}


def is_task_domain(args) -> bool:
    """Whether the flags name a sampled task (`rg-*`, or `--config` with `--index`) rather than a verifier."""
    from schemas import rg_family

    return args.domain.startswith(rg_family.PREFIX) or bool(args.config and args.index is not None)


def verify_task(args, answer: str) -> int:
    """Score `answer` against the task the flags name (see the module guarantees)."""
    from producers.domains import TaskSkipped
    from rlbus.commands.tasks import draw
    from schemas import Trajectory, Turn
    from verifier_workers.errors import VerifierInfraError
    from verifier_workers.verdict import VerifierInputError
    from verifier_workers.worker import score

    try:
        _, drawn = draw(args.domain, args.seed, args.index, args.level, args.config)
        traj = Trajectory.from_task(drawn.task, 0, [Turn(role="assistant", text=answer)])
        reward = score(traj, drawn.hidden)
    except (ValueError, TaskSkipped) as exc:  # inputs, config, VerifierInputError, a domain that cannot start
        kind = "" if not isinstance(exc, VerifierInputError) else "unusable task: "
        print(f"rlbus verify: {kind}{exc}", file=sys.stderr)
        return 2
    except VerifierInfraError as exc:
        print(f"rlbus verify: verifier failure: {exc}", file=sys.stderr)
        return 3
    print(
        json.dumps(
            {
                "reward": reward.reward,
                "components": reward.components,
                "status": reward.status,
                "details": reward.details,
                "backend": "none",
            }
        )
    )
    return 0


def _repo_task(args):
    """The RepoTask the flags name (InputProblem when they name none)."""
    from schemas.repo_task import RepoTask

    if args.task_file:
        try:
            return RepoTask.from_json(Path(args.task_file).read_text())
        except (OSError, ValueError, TypeError) as exc:
            raise InputProblem(f"cannot read --task-file: {exc}") from None
    if not args.task_id:
        raise InputProblem("--domain repo needs --task-id (a cached repo task) or --task-file T.json")
    try:
        from producers.repo_cache import load_task
    except ImportError:
        raise InputProblem("no repo task cache in this install (producers.repo_cache); use --task-file") from None
    try:
        return load_task(args.task_id, args.task_cache)
    except Exception as exc:  # noqa: BLE001 - not cached, corrupt: the message says what to do
        raise InputProblem(str(exc)) from None


def verify_repo_patch(args, patch: str) -> int:
    """`--domain repo`: score the diff against the task (see the module guarantees)."""
    import dataclasses

    from verifier_workers.verdict import VerifierInputError
    from verifier_workers.verifiers.repo import RepoSandboxInfraError, verify_repo

    try:
        task = _repo_task(args)
        params = {"problem_id": task.task_id, **({"timeout_s": args.timeout} if args.timeout else {})}
        traj = _trajectory("repo", "", params, "cli").model_copy(update={"artifacts": {"diff": patch.encode()}})
        verdict = verify_repo(traj, {"task": dataclasses.asdict(task)})
    except (InputProblem, VerifierInputError) as exc:
        print(f"rlbus verify: {exc}", file=sys.stderr)
        return 2
    except RepoSandboxInfraError as exc:
        print(f"rlbus verify: sandbox failure: {exc}", file=sys.stderr)
        return 3
    print(
        json.dumps(
            {
                "reward": verdict.reward,
                "components": verdict.components,
                "status": verdict.status,
                "details": verdict.details,
                "backend": "docker",
            }
        )
    )
    return 0


def _read_input(path: str, flag: str) -> str:
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise InputProblem(f"cannot read {flag}: {exc}") from None


def main(args) -> int:
    """Run `rlbus verify`."""
    from verifier_workers import registry
    from verifier_workers.verdict import VerifierInputError

    if args.script:
        from rlbus.commands.tasks_harbor import verify_harbor_script

        return verify_harbor_script(args)
    try:
        if args.patch_file and args.domain != "repo":
            raise InputProblem("--patch-file is for --domain repo")
        if args.domain == "repo":
            if not args.patch_file:
                raise InputProblem("--domain repo needs --patch-file F (a unified diff)")
            return verify_repo_patch(args, _read_input(args.patch_file, "--patch-file"))
        if not args.answer_file:
            raise InputProblem("--answer-file is required (or --patch-file with --domain repo)")
        answer = _read_input(args.answer_file, "--answer-file")
    except InputProblem as exc:
        print(f"rlbus verify: {exc}", file=sys.stderr)
        return 2
    if is_task_domain(args):
        return verify_task(args, answer)
    try:
        params, hidden = _inputs(args)
        fn = registry.get(args.domain)
        traj = _trajectory(args.domain, answer, params, "cli" if hidden is not None else None)
        backend = "none"
        if args.domain == "code":
            from verifier_workers.verifiers.code import resolve_backend, verify_code

            backend = resolve_backend(args.backend)
            verdict = verify_code(traj, hidden, backend=backend)
        else:
            verdict = fn(traj, hidden) if hidden is not None else fn(traj)
    except (InputProblem, VerifierInputError) as exc:
        print(f"rlbus verify: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from verifier_workers.verifiers.code import SandboxInfraError

        if isinstance(exc, SandboxInfraError):
            print(f"rlbus verify: sandbox failure: {exc}", file=sys.stderr)
            return 3
        raise
    print(
        json.dumps(
            {
                "reward": verdict.reward,
                "components": verdict.components,
                "status": verdict.status,
                "details": verdict.details,
                "backend": backend,
            }
        )
    )
    return 0
