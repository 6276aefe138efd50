"""rlbus's repository tasks written as Harbor task directories (`rlbus tasks export harbor`).

`export_repo_task(task, out)` writes `out/<task_id>/`:
- `instruction.md`: the issue, and where the repository is (`/app`);
- `task.toml` (version 1.0): metadata (source, the rlbus task id), timeouts and limits;
- `environment/Dockerfile` FROM the repo sandbox image (`rlbus-repo-sandbox:latest`, built by
  `rlbus sandbox build-image --repo`), with the public repository under `environment/repo/`
  copied to `/app`;
- `tests/`: the hidden test files, `expected.json` (target and regression test ids) and
  `test.sh`, which copies the hidden files over the agent's, runs pytest on exactly those ids
  and writes `reward.json` with `reward` (1 iff every target and regression test passed),
  `target_pass_rate` and `regression_pass_rate`;
- `solution/solve.sh`: writes the files the gold patch changes (base64, exact bytes) and
  deletes the ones it deletes.

Guarantees: reading the directory back (`schemas.harbor_task.read_task`) gives the issue as
the instruction and the hidden tests under `tests/`; the gold solution resolves and an
empty episode does not (the round trip test). The repo domain's own verifier is stricter (it
rewrites the tests to compare plain data, refuses shadowing modules): the Harbor form runs
the hidden tests as they are, as Harbor does.
"""

from __future__ import annotations

import base64
import json
import shlex
from pathlib import Path

from schemas.repo_task import RepoTask

BASE_IMAGE = "rlbus-repo-sandbox:latest"
TEST_SH = r"""#!/bin/bash
# Copy the hidden test files over whatever the agent left, run exactly the expected ids.
cd /app || exit 1
python3 - <<'PY'
import os, shutil
root = "/tests/hidden"
for d, _, files in os.walk(root):
    for f in files:
        src = os.path.join(d, f)
        dst = os.path.join("/app", os.path.relpath(src, root))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(src, dst)
PY
ids=$(python3 -c 'import json; e = json.load(open("/tests/expected.json")); print("\n".join(e["targets"] + e["regression"]))')
mapfile -t args <<< "$ids"
# the trusted toolchain's PYTHONSAFEPATH keeps cwd off sys.path: name the repository explicitly
export PYTHONPATH="/tests/plugin:/app:/app/src${PYTHONPATH:+:$PYTHONPATH}"
rm -f /tmp/rlbus-outcomes.json
python3 -m pytest -q -p no:cacheprovider -p rlbus_outcomes --rootdir=/app "${args[@]}" > /tmp/rlbus-pytest.log 2>&1
tail -n 20 /tmp/rlbus-pytest.log
python3 - <<'PY'
import json
e = json.load(open("/tests/expected.json"))
try:
    outcome = json.load(open("/tmp/rlbus-outcomes.json"))
except (OSError, ValueError):
    outcome = {}
t = [i for i in e["targets"] if outcome.get(i) is True]
r = [i for i in e["regression"] if outcome.get(i) is True]
tr = len(t) / len(e["targets"]) if e["targets"] else 1.0
rr = len(r) / len(e["regression"]) if e["regression"] else 1.0
reward = 1.0 if tr == 1.0 and rr == 1.0 else 0.0
json.dump({"reward": reward, "target_pass_rate": tr, "regression_pass_rate": rr}, open("/logs/verifier/reward.json", "w"))
PY
"""
OUTCOMES_PLUGIN = """# Records each test id's outcome (True: passed; False: failed, errored or skipped).
import json

outcomes = {}


def pytest_runtest_logreport(report):
    if report.failed or report.skipped:
        outcomes[report.nodeid] = False
    elif report.when == "call" and report.passed:
        outcomes.setdefault(report.nodeid, True)


def pytest_sessionfinish(session):
    with open("/tmp/rlbus-outcomes.json", "w") as f:
        json.dump(outcomes, f)
"""


def _task_toml(task: RepoTask) -> str:
    return (
        'version = "1.0"\n\n[metadata]\n'
        f'source = {json.dumps(task.source)}\nrlbus_task_id = {json.dumps(task.task_id)}\ncategory = "repository"\n\n'
        "[verifier]\ntimeout_sec = 300\n\n[agent]\ntimeout_sec = 900\n\n"
        "[environment]\nbuild_timeout_sec = 300\ncpus = 1\nmemory_mb = 1024\nstorage_mb = 512\nallow_internet = false\n"
    )


def _solve_sh(task: RepoTask) -> str:
    from verifier_workers.repo_diff import apply_diff

    patch = apply_diff(task.files, task.gold_patch, lambda _p: False)
    if not patch.applied:
        raise ValueError(f"{task.task_id}: the gold patch does not apply: {patch.errors}")
    lines = ["#!/bin/bash", "# The gold patch, as the exact new bytes of each file it changes.", "set -e", "cd /app"]
    for path in sorted(set(task.files) | set(patch.files)):
        if path not in patch.files:
            lines.append(f"rm -f -- {shlex.quote(path)}")
        elif task.files.get(path) != patch.files[path]:
            b64 = base64.b64encode(patch.files[path].encode()).decode()
            lines.append(f'mkdir -p "$(dirname {shlex.quote(path)})"')
            lines.append(
                f"python3 -c 'import base64,sys; open(sys.argv[1],\"wb\").write(base64.b64decode(sys.argv[2]))' {shlex.quote(path)} {b64}"
            )
    return "\n".join(lines) + "\n"


def export_repo_task(task: RepoTask, out: Path) -> Path:
    """Write `task` as a Harbor task directory under `out` (see the module docstring); its path."""
    root = out / task.task_id
    files: dict[str, str] = {
        "instruction.md": f"# {task.task_id}\n\nThe Python repository at /app has this issue; fix it.\n\n{task.issue.strip()}\n",
        "task.toml": _task_toml(task),
        "environment/Dockerfile": f"FROM {BASE_IMAGE}\nCOPY repo/ /app/\nWORKDIR /app\n",
        "tests/test.sh": TEST_SH,
        "tests/plugin/rlbus_outcomes.py": OUTCOMES_PLUGIN,
        "tests/expected.json": json.dumps(
            {
                "targets": list(task.target_tests),
                "regression": [t for t in task.regression_tests if t not in task.target_tests],
            },
            indent=1,
        )
        + "\n",
        "solution/solve.sh": _solve_sh(task),
    }
    files |= {f"environment/repo/{p}": text for p, text in task.files.items()}
    files |= {f"tests/hidden/{p}": text for p, text in task.hidden_files.items()}
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        if rel.endswith(".sh"):
            path.chmod(0o755)
    return root
