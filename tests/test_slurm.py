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
