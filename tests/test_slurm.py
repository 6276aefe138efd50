"""`rlbus slurm render` checked as text (issue 34, item 5): the sbatch script parses (`bash -n`),
starts nats-server on the first node, runs one `srun` step of `rlbus worker ROLE` per role on its
node, and hands the NATS URL over by environment. Nothing here runs Slurm."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlbus.deploy import slurm
from schemas.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.toml"


def _script(nodes: int, *sets: str) -> str:
    return slurm.render(load_config(DEMO, list(sets)), "exp7", nodes, str(DEMO), list(sets), "/shared/runs")


def _bash_n(text: str, tmp_path: Path) -> None:
    path = tmp_path / "run.sbatch"
    path.write_text(text)
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_script_parses_and_starts_every_role(tmp_path, nodes):
    text = _script(nodes)
    _bash_n(text, tmp_path)
    assert f"#SBATCH --nodes={nodes}" in text
    assert re.search(r'srun --nodes=1 --ntasks=1 -w "\$NATS_HOST" .*nats-server .* -js -m 8222', text)
    assert 'NATS_HOST="${NODES[0]}"' in text
    steps = re.findall(r'srun --nodes=1 --ntasks=1 -w "\$\{NODES\[(\d+)\]\}".*\n\s+rlbus worker (\w+) ', text)
    roles = {role: int(node) for node, role in steps}
    assert sorted(roles) == sorted(slurm.roles_of(load_config(DEMO)))
    assert {"sampler", "rollout", "sandbox", "verifier", "learner", "scheduler"} <= set(roles)
    assert all(0 <= n < nodes for n in roles.values())
    assert 'export RLBUS_NATS_URL="nats://${NATS_HOST}:4222"' in text
    assert "--nats-url" not in "".join(line for line in text.splitlines() if "rlbus worker" in line)
    if nodes == 4:
        assert {roles["rollout"], roles["learner"]} == {3, 2}  # GPU roles from the last node down


def test_each_step_sees_only_its_own_password(tmp_path):
    text = _script(2)
    assert "set -a" not in text.split("nats-server")[0].split("(set -a")[0]  # no global export of the file
    for role in ("rollout", "verifier", "learner"):
        line = next(x for x in text.splitlines() if f"RLBUS_NATS_USER={role} " in x)
        assert f'RLBUS_NATS_PASSWORD="$RLBUS_NATS_PASSWORD_{role.upper()}"' in line and line.startswith("(")
    assert "RLBUS_NATS_USER=admin" in next(x for x in text.splitlines() if "rlbus init" in x)


def test_placement_and_auth_off(tmp_path):
    text = _script(3, "deploy.slurm_placement.learner=1", "deploy.nats_auth=false", "deploy.slurm_gpus_per_node=2")
    _bash_n(text, tmp_path)
    assert re.search(r'NODES\[1\]\}".*\n\s+rlbus worker learner ', text)
    assert "RLBUS_NATS_USER" not in text and "#SBATCH --gpus-per-node=2" in text
    assert "--set deploy.slurm_placement.learner=1" in text  # init resolves the same config
    with pytest.raises(ValueError, match="outside 0..1"):
        _script(2, "deploy.slurm_placement.learner=5")
    with pytest.raises(ValueError, match="unknown roles"):
        _script(2, "deploy.slurm_placement.learnr=0")


def test_cli(tmp_path):
    # a process of its own: the CLI configures this process's logging once (to the stderr of the moment)
    cli = [sys.executable, "-m", "rlbus.cli", "slurm", "render", str(DEMO)]
    out = tmp_path / "x.sbatch"
    done = subprocess.run([*cli, "--nodes", "2", "--run-id", "exp7", "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    _bash_n(out.read_text(), tmp_path)
    refused = subprocess.run([*cli, "--nodes", "0"], capture_output=True, text=True)
    assert refused.returncode != 0 and "at least 1" in refused.stderr


def test_a_learner_larger_than_a_node_is_one_task_per_rank(tmp_path):
    """world_size 4 on nodes of 2 GPUs: one srun step of 4 tasks (learner.launch = external) over 2 nodes,
    MASTER_ADDR the step's first node (task 0 there: block distribution), WORLD_SIZE 4; `rlbus init`
    writes learner.launch = external into the run's config; each task's env resolves to its rank."""
    from learner.rendezvous import resolve

    sets = ("learner.world_size=4", "deploy.slurm_gpus_per_node=2")
    text = _script(4, *sets)
    _bash_n(text, tmp_path)
    assert slurm.learner_nodes(load_config(DEMO, list(sets))) == 2
    step = re.search(r"srun (--nodes=\d+ --ntasks=\d+ .*)\\\n\s+rlbus worker learner ", text)
    assert step, text
    args = step.group(1)
    first, second = map(int, re.search(r'-w "\$\{NODES\[(\d+)\]\},\$\{NODES\[(\d+)\]\}"', args).groups())
    assert second == first + 1 and first + 1 < 4
    assert "--nodes=2 --ntasks=4 --ntasks-per-node=2 --distribution=block" in args
    assert f"--export=ALL,MASTER_ADDR=${{NODES[{first}]}},MASTER_PORT=29500,WORLD_SIZE=4" in args
    assert "--set learner.launch=external" in next(x for x in text.splitlines() if "rlbus init" in x)
    steps = re.findall(r'srun --nodes=1 --ntasks=1 -w "\$\{NODES\[(\d+)\]\}".*\n\s+rlbus worker (\w+) ', text)
    assert "learner" not in {role for _, role in steps}  # not also a one-task learner
    lc = load_config(DEMO, [*sets, "learner.launch=external"]).learner
    for procid in range(4):  # what srun gives task `procid` (block: 2 per node)
        env = {"MASTER_ADDR": "node1", "MASTER_PORT": "29500", "WORLD_SIZE": "4"}
        env.update(SLURM_PROCID=str(procid), SLURM_LOCALID=str(procid % 2))
        rv = resolve(lc, env, hostname="node1")
        assert (rv.rank, rv.local_rank, rv.world) == (procid, procid % 2, 4)


def test_a_learner_within_a_node_stays_one_spawning_task_and_too_few_nodes_is_an_error(tmp_path):
    text = _script(2, "learner.world_size=2", "deploy.slurm_gpus_per_node=2")
    assert re.search(r'srun --nodes=1 --ntasks=1 -w "\$\{NODES\[\d\]\}".*\n\s+rlbus worker learner ', text)
    assert "learner.launch=external" not in text and "MASTER_ADDR" not in text
    with pytest.raises(ValueError, match="need 4 nodes .* raise --nodes to at least"):
        _script(2, "learner.world_size=8", "deploy.slurm_gpus_per_node=2")
