"""`rlbus slurm render`: one sbatch script that runs a whole run on N nodes of an allocation.

Guarantees:
- nats-server (JetStream, monitoring port) runs on the first node of the allocation; every role runs
  as one `srun --nodes=1 --ntasks=1 -w <node>` step of `rlbus worker ROLE`, placed per
  `deploy.slurm_placement` (else round-robin, GPU roles from the last node down).
- The NATS URL reaches every step by environment (`RLBUS_NATS_URL`), never argv; with
  `deploy.nats_auth` (the default) each step logs in as its role's user, its password from a file of
  the run folder that only the job's user reads (`rlbus.natsauth write-env`).
- The run folder (`--run-dir`) must be a filesystem every node shares; `rlbus init` prepares it once.
- A learner larger than one node (`learner.world_size` > `deploy.slurm_gpus_per_node` with
  `learner.launch = "auto"`, or `learner.launch = "external"`) is one srun step of `world_size` tasks,
  one rank each (`learner.launch = "external"`, written into the run's config by `rlbus init`): block
  distribution over `learner_nodes` consecutive nodes, rank = SLURM_PROCID, device = SLURM_LOCALID,
  MASTER_ADDR = the step's first node (where task 0 runs), MASTER_PORT = `deploy.learner_master_port`,
  WORLD_SIZE exported to the step. Otherwise the learner is one task that spawns its ranks (one node).
- The script is text only: nothing here talks to Slurm.
"""

from __future__ import annotations

import shlex

from bus.roles import ROLES
from schemas.config import RunConfig

GPU_ROLES = ("rollout", "learner")


def roles_of(cfg: RunConfig) -> list[str]:
    """Roles the script starts: every role, the tracker only with a tracking backend (sandbox always:
    rollout workers send tool calls to the sandbox service across nodes)."""
    return [r.name for r in ROLES if r.name != "tracker" or cfg.tracking.backends]


def external_learner(cfg: RunConfig) -> bool:
    """The learner runs as one srun task per rank (see the module guarantees)."""
    lc, gpn = cfg.learner, cfg.deploy.slurm_gpus_per_node
    if lc.world_size == 1 or lc.launch == "spawn":
        return False
    return lc.launch == "external" or bool(gpn and lc.world_size > gpn)


def learner_nodes(cfg: RunConfig) -> int:
    """Nodes the learner's step spans: ceil(world_size / slurm_gpus_per_node) for an external learner
    with GPUs per node set, else 1."""
    gpn = cfg.deploy.slurm_gpus_per_node
    return -(-cfg.learner.world_size // gpn) if external_learner(cfg) and gpn else 1


def placement(cfg: RunConfig, nodes: int) -> dict[str, int]:
    """Role -> node index (0..nodes-1); the learner's is the first of its `learner_nodes` nodes."""
    fixed = dict(cfg.deploy.slurm_placement)
    bad = {r: i for r, i in fixed.items() if not 0 <= i < nodes}
    unknown = sorted(set(fixed) - set(roles_of(cfg)))
    if bad or unknown:
        raise ValueError(
            f"deploy.slurm_placement: {'unknown roles ' + ', '.join(unknown) if unknown else ''}"
            f"{' ' if bad and unknown else ''}{f'node indexes {bad} outside 0..{nodes - 1}' if bad else ''}"
        )
    out: dict[str, int] = {}
    gpu_next, cpu_next, span = nodes - 1, 0, learner_nodes(cfg)
    for role in roles_of(cfg):
        if role in fixed:
            out[role] = fixed[role]
        elif role == "learner" and span > 1:  # the last `span` nodes not yet taken by a GPU role
            out[role], gpu_next = max(0, gpu_next - span + 1), gpu_next - span
        elif role in GPU_ROLES:
            out[role], gpu_next = gpu_next % nodes, gpu_next - 1
        else:
            out[role], cpu_next = cpu_next % nodes, cpu_next + 1
    if "learner" in out and out["learner"] + span > nodes:
        raise ValueError(
            f"the learner's {cfg.learner.world_size} ranks need {span} nodes of {cfg.deploy.slurm_gpus_per_node} "
            f"GPUs from node {out['learner']}, but the job has {nodes}: raise --nodes to at least "
            f"{out['learner'] + span} or lower learner.world_size"
        )
    return out


def _header(cfg: RunConfig, run_id: str, nodes: int) -> list[str]:
    d = cfg.deploy
    lines = [
        "#!/bin/bash",
        f"# rendered by `rlbus slurm render` for run {run_id}: nats-server on the first node, one srun per role",
        f"#SBATCH --job-name=rlbus-{run_id}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=8",
        f"#SBATCH --time={d.slurm_time}",
        "#SBATCH --output=rlbus-%j.out",
    ]
    if d.slurm_partition:
        lines.append(f"#SBATCH --partition={d.slurm_partition}")
    if d.slurm_gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={d.slurm_gpus_per_node}")
    return lines


def _server(cfg: RunConfig, run_id: str, run_dir: str) -> list[str]:
    q = shlex.quote
    auth = cfg.deploy.nats_auth
    lines = [
        "set -euo pipefail",
        f"RUN_ID={q(run_id)}",
        f"RUN_DIR={q(run_dir)}",
        f"CONFIG={q(run_dir)}/$RUN_ID/config.json",
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'NATS_HOST="${NODES[0]}"',
        'export RLBUS_NATS_URL="nats://${NATS_HOST}:4222"   # by environment, never argv',
        "export RLBUS_STREAM_REPLICAS=1",
        'mkdir -p "$RUN_DIR/$RUN_ID/nats"',
    ]
    conf = '"$RUN_DIR/$RUN_ID/nats/nats.conf"'
    if auth:
        lines += [
            'AUTH="$RUN_DIR/$RUN_ID/secrets/nats.env"     # one password per role, mode 0600',
            'mkdir -p "$RUN_DIR/$RUN_ID/secrets" && chmod 700 "$RUN_DIR/$RUN_ID/secrets"',
            'python -m rlbus.natsauth write-env "$AUTH"',
            f'python -m rlbus.natsauth write-conf {conf} --run-id "$RUN_ID"',
        ]
    else:
        lines.append(f"printf 'listen: 0.0.0.0:4222\\n' > {conf}   # deploy.nats_auth = false: no users")
    # only the server's step sees every password (it resolves $RLBUS_NATS_PASSWORD_<USER>)
    env = '(set -a; . "$AUTH"; set +a; exec ' if auth else "("
    lines += [
        env + 'srun --nodes=1 --ntasks=1 -w "$NATS_HOST" --export=ALL nats-server -c ' + conf + " -js -m 8222 \\",
        '    -sd "$RUN_DIR/$RUN_ID/nats/store" -l "$RUN_DIR/$RUN_ID/nats/server.log") &',
        "SERVER_PID=$!",
        'for _ in $(seq 60); do (echo > "/dev/tcp/$NATS_HOST/4222") 2>/dev/null && break; sleep 1; done',
    ]
    return lines


def login(user: str, auth: bool) -> str:
    """A subshell prefix that exports only `user`'s NATS login (the file's other passwords stay unexported)."""
    if not auth:
        return "("
    return f'(. "$AUTH"; export RLBUS_NATS_USER={user} RLBUS_NATS_PASSWORD="$RLBUS_NATS_PASSWORD_{user.upper()}"; exec '


def _role_step(role: str, node: int, auth: bool) -> list[str]:
    return [
        f"# {role} on node {node}",
        f'{login(role, auth)}srun --nodes=1 --ntasks=1 -w "${{NODES[{node}]}}" --export=ALL \\',
        f'    rlbus worker {role} --config "$CONFIG" --run-id "$RUN_ID" --run-dir "$RUN_DIR") \\',
        f'    > "$RUN_DIR/$RUN_ID/{role}.$SLURM_JOB_ID.log" 2>&1 &',
        "PIDS+=($!)",
    ]


def _learner_step(cfg: RunConfig, node: int, auth: bool) -> list[str]:
    """The srun step of an external learner: one task per rank on `learner_nodes` nodes from `node`."""
    lc, span = cfg.learner, learner_nodes(cfg)
    hosts = ",".join(f"${{NODES[{node + i}]}}" for i in range(span))
    per_node = -(-lc.world_size // span)
    env = f"ALL,MASTER_ADDR=${{NODES[{node}]}},MASTER_PORT={cfg.deploy.learner_master_port},WORLD_SIZE={lc.world_size}"
    return [
        f"# learner: {lc.world_size} ranks, one task each (rank = SLURM_PROCID), on nodes {node}..{node + span - 1};"
        f" rank 0 on node {node} (MASTER_ADDR)",
        f"{login('learner', auth)}srun --nodes={span} --ntasks={lc.world_size} --ntasks-per-node={per_node}"
        f' --distribution=block -w "{hosts}" --export={env} \\',
        '    rlbus worker learner --config "$CONFIG" --run-id "$RUN_ID" --run-dir "$RUN_DIR") \\',
        '    > "$RUN_DIR/$RUN_ID/learner.$SLURM_JOB_ID.log" 2>&1 &',
        "PIDS+=($!)",
    ]


def render(
    cfg: RunConfig, run_id: str, nodes: int, config_path: str, overrides: list[str] | None = None, run_dir: str = "runs"
) -> str:
    """The sbatch script of the run on `nodes` nodes, preparing it from `config_path` with `overrides`
    (see the module guarantees)."""
    from bus.subjects import check_token

    check_token("run_id", run_id)
    if nodes < 1:
        raise ValueError(f"--nodes {nodes}: at least 1")
    places = placement(cfg, nodes)
    auth = cfg.deploy.nats_auth
    lines = _header(cfg, run_id, nodes) + [""] + _server(cfg, run_id, run_dir) + [""]
    forced = ["sandbox.remote=true"] + (["learner.launch=external"] if external_learner(cfg) else [])
    sets = "".join(f" --set {shlex.quote(o)}" for o in [*forced, *(overrides or [])])
    lines += [
        "# once: config.json, model/start, the tool secret and the run's streams (as admin)",
        f'{login("admin", auth)}rlbus init {shlex.quote(config_path)} --run-id "$RUN_ID" --run-dir "$RUN_DIR"{sets}'
        ' --nats-url "$RLBUS_NATS_URL")',
        "PIDS=()",
    ]
    from bus.roles import start_order

    started = [r for r in start_order(cfg) if r in places]
    started += [r for r in places if r not in started]
    for role in started:
        if role == "learner" and external_learner(cfg):
            lines += _learner_step(cfg, places[role], auth)
        else:
            lines += _role_step(role, places[role], auth)
    lines += [
        "",
        "# the run ends when the learner does (run.max_steps / run.max_minutes); then stop the rest",
        'wait "${PIDS[' + str(started.index("learner")) + ']}" || true',
        'kill "${PIDS[@]}" 2>/dev/null || true',
        "wait || true",
        'kill "$SERVER_PID" 2>/dev/null || true',
    ]
    return "\n".join(lines) + "\n"
