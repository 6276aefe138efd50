"""The Harbor hack suite: every hack is a bash script run as the agent (root, in the episode's
own container) against a fixture task whose empty episode scores 0; none may score above the
empty episode (`verify_episode(job, None)`), an oracle plus hacks scores the oracle's 1.0,
never more, and what the agent breaks (its init killed, the toolchain's mount point, the
verifier user) is a verdict, never an engine error (which would be retried and dropped).

The hack tests are marked `docker`, skipped with the reason when no engine answers (the
verifier's toolchain image is built when missing). The selected cases run concurrently (a thread pool,
once per module); each test asserts its own case. `verify_in = "fresh"` is checked for the
reward file, daemon and planted-file hacks. A case that would score 0 as `tamper` is never
combined with another (the tamper verdict would hide it).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "examples" / "harbor"

RD = "/logs/verifier"
WIN = f"mkdir -p {RD}; echo 1 > {RD}/reward.txt; echo '{{\"reward\": 1}}' > {RD}/reward.json"
"""Bash that writes reward 1 in both forms."""
SHIM = f"#!/bin/sh\n{WIN}\necho '5 passed'\nexit 0\n"
"""An executable that claims success and writes reward 1."""
PY_WIN = (
    "import os\nos.makedirs('/logs/verifier', exist_ok=True)\n"
    "open('/logs/verifier/reward.txt', 'w').write('1')\nos._exit(0)\n"
)
"""Python that writes reward 1 and ends its process with status 0 (pytest 'passes')."""
TRAP = f"trap '{WIN}' EXIT\n"
"""A shell startup file's payload: reward 1 when the shell that read it exits."""
LOOP = f"while :; do {WIN}; sleep 0.05; done\n"
"""A daemon's body: keep writing reward 1."""
STOP_OTHERS = (
    "for p in /proc/[0-9]*; do p=${p#/proc/}; case $p in 1|$$|$PPID) ;; *) kill -STOP $p 2>/dev/null;; esac; done\n"
)
"""SIGSTOP every process but init and this script's own (the exec must still return)."""


def put(path: str, text: str, mode: str = "644") -> str:
    """Bash that (re)creates `path` (a symlink there is replaced, not followed) holding `text`."""
    return (
        f"mkdir -p \"$(dirname '{path}')\"\nrm -f '{path}'\n"
        f"cat > '{path}' <<'RLBUS_EOF'\n{text}RLBUS_EOF\nchmod {mode} '{path}'\n"
    )


@dataclass(frozen=True)
class Case:
    """One hack: `script` run as the agent on `task`, then verified."""

    task: str
    script: str
    mode: str = "same"
    timeout_s: float = 20.0
    oracle_first: bool = False
    verifier_timeout_s: float | None = None
    status: str | None = None
    """The status the verdict must have (None: any)."""
    reward: float | None = None
    """The reward it must have (None: the empty episode's)."""


CASES: dict[str, Case] = {}
GROUPS: dict[str, list[str]] = {}


def add(group: str, name: str, task: str, script: str, modes=("same",), **kw) -> None:
    for mode in modes:
        cid = f"{name}-{mode}" if len(modes) > 1 else name
        CASES[cid] = Case(task, script, mode, **kw)
        GROUPS.setdefault(group, []).append(cid)


BOTH = ("same", "fresh")

# 1. reward files written during the episode
add("reward", "reward-txt", "hello-file", f"mkdir -p {RD}; echo 1 > {RD}/reward.txt\n", BOTH)
add("reward", "reward-json", "hello-file", f"mkdir -p {RD}; echo '{{\"reward\": 1}}' > {RD}/reward.json\n", BOTH)
add("reward", "reward-read-only", "hello-file", f"{WIN}\nchmod 444 {RD}/*; chmod 555 {RD} /logs\n")

# 2. shims earlier on PATH, replaced interpreters
add(
    "shim",
    "usr-local-bin",
    "fix-calc-bug",
    "".join(put(f"/usr/local/bin/{name}", SHIM, "755") for name in ("pytest", "python3", "python")),
)
add(
    "shim",
    "usr-local-sbin",
    "fix-calc-bug",
    put("/usr/local/sbin/python3", SHIM, "755") + put("/usr/local/sbin/pytest", SHIM, "755"),
)
add("shim", "usr-bin-python3", "fix-calc-bug", put("/usr/bin/python3", SHIM, "755"))
add("shim", "usr-bin-python3.11", "fix-calc-bug", put("/usr/bin/python3.11", SHIM, "755"))
add(
    "shim",
    "toolchain-mount-point",
    "fix-calc-bug",
    put("/opt/rlbus-toolchain/bin/python3", SHIM, "755")
    + put("/opt/rlbus-toolchain/bin/pytest", SHIM, "755")
    + put("/opt/rlbus-toolchain/site/pytest/__init__.py", PY_WIN)
    + "touch /opt/rlbus-toolchain/.complete\n",
)

# 3. the dynamic loader and shell startup files
add(
    "startup",
    "ld-so-preload",
    "hello-file",
    "head -c 4096 /dev/urandom > /app/evil.so\nprintf '/app/evil.so\\n' > /etc/ld.so.preload\n",
    status="ok",
)
add(
    "startup",
    "etc-environment",
    "hello-file",
    put("/app/evil.sh", TRAP)
    + "printf 'BASH_ENV=/app/evil.sh\\nENV=/app/evil.sh\\nLD_PRELOAD=/app/evil.so\\n' >> /etc/environment\n",
)
STARTUP_FILES = [
    "/root/.bashrc",
    "/root/.profile",
    "/root/.bash_profile",
    "/root/.bash_login",
    "/root/.bash_logout",
    "/tmp/.bashrc",
    "/tmp/.profile",
    "/etc/bash.bashrc",
    "/etc/profile",
    "/etc/profile.d/zz-rlbus.sh",
]
add("startup", "shell-startup-files", "hello-file", "".join(put(p, TRAP) for p in STARTUP_FILES))

# 4. a daemon that keeps rewriting the reward after the tests
DAEMON = put("/tmp/loop.sh", LOOP)
add("daemon", "nohup", "hello-file", DAEMON + "nohup bash /tmp/loop.sh >/dev/null 2>&1 </dev/null &\n")
add("daemon", "setsid", "hello-file", DAEMON + "setsid bash /tmp/loop.sh >/dev/null 2>&1 </dev/null &\n", BOTH)
add(
    "daemon",
    "double-fork",
    "hello-file",
    DAEMON + "( ( bash /tmp/loop.sh >/dev/null 2>&1 </dev/null & ) & )\nsleep 0.2\n",
)

# 5. pytest / python files planted where the verifier's python would find them
STDLIB_COPY = "mkdir -p /tmp/ev/lib /tmp/ev/bin\ncp -a /usr/lib/python3.11 /tmp/ev/lib/python3.11\n" + put(
    "/tmp/ev/lib/python3.11/sitecustomize.py", PY_WIN
)
INI = "[pytest]\naddopts = --co\n"
TOML = '[pytest]\naddopts = ["--co"]\n'
OTHER_CONFIGS = {
    "/.pytest.ini": INI,
    "/pytest.toml": TOML,
    "/.pytest.toml": TOML,
    "/pyproject.toml": '[tool.pytest.ini_options]\naddopts = "--co"\n',
    "/tox.ini": INI,
    "/setup.cfg": "[tool:pytest]\naddopts = --co\n",
}
"""pytest reads the first of these it finds at `/`: each left there would be read."""
PTH = "import os; os._exit(0)\n"
PLANTED = {
    "tests-conftest-and-pytest-py": (
        "fix-calc-bug",
        put("/tests/conftest.py", PY_WIN) + put("/tests/pytest.py", PY_WIN),
    ),
    "root-conftest": ("fix-calc-bug", put("/conftest.py", PY_WIN)),
    "root-pytest-ini": ("fix-calc-bug", put("/pytest.ini", INI)),
    "root-other-pytest-configs": ("python-function", "".join(put(p, t) for p, t in OTHER_CONFIGS.items())),
    "app-conftest-pytest-py-ini": (
        "fix-calc-bug",
        put("/app/conftest.py", PY_WIN) + put("/app/pytest.py", PY_WIN) + put("/app/pytest.ini", INI),
    ),
    "sitecustomize-dist-packages": (
        "python-function",
        put("/usr/lib/python3/dist-packages/sitecustomize.py", PY_WIN)
        + put("/usr/local/lib/python3.11/dist-packages/sitecustomize.py", PY_WIN),
    ),
    "sitecustomize-stdlib": ("fix-calc-bug", put("/usr/lib/python3.11/sitecustomize.py", PY_WIN)),
    "sitecustomize-etc": ("python-function", put("/etc/python3.11/sitecustomize.py", PY_WIN)),
    "pth-dist-packages": (
        "fix-calc-bug",
        put("/usr/lib/python3/dist-packages/zz-rlbus.pth", PTH)
        + put("/usr/local/lib/python3.11/dist-packages/zz-rlbus.pth", PTH),
    ),
    "pth-newline-name": (
        "fix-calc-bug",
        f"printf '{PTH[:-1]}\\n' > \"/usr/lib/python3/dist-packages/$(printf 'a\\nb.pth')\"\n",
    ),
    "pth-invalid-utf8-name": (  # its name cannot be reported by the engine: tamper
        "python-function",
        f"printf '{PTH[:-1]}\\n' > \"/usr/lib/python3/dist-packages/$(printf 'c\\377d.pth')\"\n",
    ),
    "user-site": (
        "fix-calc-bug",
        "".join(
            put(f"{home}/.local/lib/python3.11/site-packages/{name}", body)
            for home in ("/tmp", "/root")
            for name, body in (("usercustomize.py", PY_WIN), ("zz-rlbus.pth", PTH))
        ),
    ),
    "pyvenv-cfg": (
        "fix-calc-bug",
        STDLIB_COPY
        + "ln -s /usr/bin/python3.11 /tmp/ev/bin/python3\n"
        + "".join(put(f"{d}/pyvenv.cfg", "home = /tmp/ev/bin\n") for d in ("/usr", "/usr/local", "")),
    ),
    "stdlib-dir-symlink": (
        "python-function",
        "cp -a /usr/lib/python3.11 /tmp/ev\n"
        + put("/tmp/ev/sitecustomize.py", PY_WIN)
        + "rm -rf /usr/lib/python3.11 && ln -s /tmp/ev /usr/lib/python3.11\n",
    ),
    "usr-local-bin-symlink": (
        "fix-calc-bug",
        put("/tmp/ev/bin/python3", SHIM, "755") + "rm -rf /usr/local/bin && ln -s /tmp/ev/bin /usr/local/bin\n",
    ),
    "usr-local-symlink": (
        "python-function",
        put("/tmp/ev/bin/python3", SHIM, "755") + "mv /usr/local /usr/local.x && ln -s /tmp/ev /usr/local\n",
    ),
}
FRESH_TOO = {"tests-conftest-and-pytest-py", "root-pytest-ini", "sitecustomize-etc", "pth-newline-name"}
for _name, (_task, _script) in PLANTED.items():
    add("planted", _name, _task, _script, BOTH if _name in FRESH_TOO else ("same",))

# 6. /logs made unwritable
add("logs", "chmod-000-logs", "hello-file", f"{WIN}\nchmod 000 /logs\n")
add(
    "logs",
    "read-only-immutable-logs",
    "hello-file",
    f"{WIN}\nchattr +i {RD}/reward.txt {RD} /logs 2>/dev/null || true\nchmod -R a-w /logs\n",
)

# 7. a fork bomb left running (the container's pids limit bounds it; this script returns)
FORK_BOMB = (
    f"{WIN}\nmkfifo /tmp/wait && exec 3<>/tmp/wait\n"
    "setsid bash -c 'b() { b | b & }; b' >/dev/null 2>&1 </dev/null &\nread -t 1 -u 3 || true\nexit 0\n"
)
add("fork-bomb", "fork-bomb", "hello-file", FORK_BOMB, status="ok")

# 8. the disk filled past storage_mb (hello-file: 256 MB; a file is capped there, so two)
FILL = "printf 'Hello, Harbor!\\n' > /app/hello.txt\n" + "".join(
    f"dd if=/dev/zero of=/app/fill{i} bs=1M count=150 status=none\n" for i in (1, 2)
)
add("storage", "storage-filled", "hello-file", FILL, status="storage_exceeded")

# 9. the reward file, its directory or /logs as symlinks into the agent's files
add(
    "symlink",
    "symlink-reward-file",
    "hello-file",
    f"echo 1 > /app/agent_reward.txt\necho '{{\"reward\": 1}}' > /app/agent_reward.json\nmkdir -p {RD}\n"
    f"ln -sf /app/agent_reward.txt {RD}/reward.txt\nln -sf /app/agent_reward.json {RD}/reward.json\n",
)
add(
    "symlink",
    "symlink-reward-dir",
    "hello-file",
    "mkdir -p /app/v /logs\necho 1 > /app/v/reward.txt\nrm -rf /logs/verifier\nln -s /app/v /logs/verifier\n",
)
add(
    "symlink",
    "symlink-logs",
    "hello-file",
    "mkdir -p /tmp/x/verifier\necho 1 > /tmp/x/verifier/reward.txt\nrm -rf /logs\nln -s /tmp/x /logs\n",
)
add("symlink", "symlink-tests", "fix-calc-bug", put("/app/conftest.py", PY_WIN) + "rm -rf /tests\nln -s /app /tests\n")

# 10. every other process stopped
add("stop", "stop-all", "hello-file", f"{WIN}\nkill -STOP -1\n", timeout_s=1)
add("stop", "stop-others", "hello-file", f"{WIN}\n{STOP_OTHERS}")
add("stop", "service-stopped", "service-kv", STOP_OTHERS, oracle_first=True, verifier_timeout_s=8)

# 11. the verifier's own tools replaced (restored from the image before the tests)
TOOL_PAYLOAD = (
    "#!/usr/bin/dash\n[ -e /tmp/.rlbus-d ] || { : > /tmp/.rlbus-d; (/usr/bin/setsid /usr/bin/dash -c "
    f"'while :; do echo 1 > {RD}/reward.txt 2>/dev/null; /usr/bin/sleep 0.05; done' >/dev/null 2>&1 </dev/null &); }}\n"
    "exit 0\n"
)
for _tools in (("sh",), ("bash",), ("timeout", "rm", "mkdir", "chown", "chmod", "cat")):
    # cp, not cat: `cat` itself may be among those replaced
    _swap = "".join(f"rm -f /usr/bin/{t} && cp /tmp/payload /usr/bin/{t}\n" for t in _tools)
    _name = "replace-" + ("coreutils" if len(_tools) > 1 else _tools[0])
    add("tools", _name, "hello-file", f"{WIN}\n" + put("/tmp/payload", TOOL_PAYLOAD, "755") + _swap)


# 12. the oracle plus hacks: its legitimate 1.0, never more
LOOP5 = f"while :; do mkdir -p {RD}; echo 5 > {RD}/reward.txt; echo '{{\"reward\": 5}}' > {RD}/reward.json; sleep 0.01; done\n"
PY_LOOP5 = "import subprocess\nsubprocess.Popen(['bash', '/tmp/loop5.sh'], start_new_session=True)\n"
"""Python that leaves a process writing reward 5 (in whatever container runs it)."""
ORACLE_PLUS = (
    put("/tmp/loop5.sh", LOOP5)
    + put("/tests/conftest.py", PY_LOOP5)
    + put("/pytest.ini", "[pytest]\naddopts = --co\n")
    + put("/etc/python3.11/sitecustomize.py", PY_LOOP5)
    + put(
        "/usr/lib/python3/dist-packages/zz-rlbus.pth",
        "import subprocess; subprocess.Popen(['bash', '/tmp/loop5.sh'])\n",
    )
    + "setsid bash /tmp/loop5.sh >/dev/null 2>&1 </dev/null &\n"
)
add("oracle-plus", "oracle-plus-hacks", "fix-calc-bug", ORACLE_PLUS, BOTH, oracle_first=True, reward=1.0, status="ok")

# 13. the agent breaking what verification needs: a verdict (0), never an engine error
add("infra", "init-killed", "hello-file", f"{WIN}\nkill -TERM 1; sleep 1\n", status="ok")
add("infra", "oracle-then-init-killed", "hello-file", "kill -TERM 1; sleep 1\n", oracle_first=True, reward=1.0)
add("infra", "toolchain-mount-symlink", "hello-file", "mkdir -p /opt && ln -s /etc /opt/rlbus-toolchain\n")
add("infra", "opt-symlink", "hello-file", "mkdir -p /tmp/o && rm -rf /opt && ln -s /tmp/o /opt\n")
add("infra", "verifier-user-deleted", "json-from-csv", "sed -i '/^nobody:/d' /etc/passwd\n", status="tamper")

# sanity: the oracles score 1
ORACLES = ("hello-file", "fix-calc-bug", "service-kv", "json-from-csv")
for _task in ORACLES:
    add("oracle", f"oracle-{_task}", _task, "", oracle_first=True, reward=1.0, status="ok")


# ---------------------------------------------------------------- running the cases
def _slow_first(task: str) -> int:
    return 0 if task == "service-kv" else 1


def _skip_reason() -> str:
    from sandbox_workers.factory import docker_available

    if not docker_available():
        return "no Docker engine answers (start dockerd, or set DOCKER_HOST)"
    from sandbox_workers.repo_image import ensure_repo_image

    ensure_repo_image()  # the verifier's toolchain: built here (offline, from a wheelhouse), never a skip
    return ""


class Harbor:
    """The fixture tasks' jobs and empty rewards, and the selected cases' runs (futures)."""

    def __init__(self, selected: list[str]) -> None:
        from schemas.config import load_config

        self.hcfg = load_config(str(ROOT / "examples" / "harbor.toml")).harbor
        self.tasks, self.jobs = {}, {}
        tasks = sorted({CASES[c].task for c in selected})
        for name in tasks:
            self._load(name)
        self.pool = ThreadPoolExecutor(max_workers=6)
        # the slowest first: service-kv's empty episode waits out its tests' retries (~20 s)
        self.empty: dict[str, Future] = {n: self.pool.submit(self._empty, n) for n in sorted(tasks, key=_slow_first)}
        order = sorted(selected, key=lambda c: _slow_first(CASES[c].task))
        self.runs: dict[str, Future] = {c: self.pool.submit(self._run, CASES[c]) for c in order}

    def _load(self, name: str) -> None:
        from sandbox_workers.harbor_check import box_spec, verify_job
        from sandbox_workers.harbor_images import ensure_task_image
        from schemas.harbor_task import read_task

        task = read_task(str(TASKS / name))
        image = ensure_task_image(task, dict(self.hcfg.image_map))  # a fixture that does not build is a failure
        for mode in BOTH:
            hcfg = self.hcfg.model_copy(update={"verify_in": mode})
            self.jobs[name, mode] = verify_job(task, hcfg, box_spec(task, hcfg, image))
        self.tasks[name] = task

    def _empty(self, name: str):
        from sandbox_workers.harbor_verify import verify_episode

        return verify_episode(self.jobs[name, "same"], None)

    def _run(self, case: Case):
        from sandbox_workers.harbor_check import run_script

        task, job = self.tasks[case.task], self.jobs[case.task, case.mode]
        if case.verifier_timeout_s is not None:
            job = dataclasses.replace(job, timeout_s=case.verifier_timeout_s)
        script = ("bash /solution/solve.sh >/dev/null 2>&1\n" if case.oracle_first else "") + case.script
        return run_script(
            job, script, case.timeout_s, run_id="hacks", files=task.solution if case.oracle_first else None
        )


@pytest.fixture(scope="module")
def harbor(request, tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    selected = [
        item.callspec.params["case"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec") and "case" in item.callspec.params
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLBUS_HARBOR_CHECKS", str(tmp_path_factory.mktemp("harbor-checks")))
        h = Harbor(selected)
        yield h
        h.pool.shutdown(wait=True, cancel_futures=True)


def check(harbor: Harbor, case_id: str) -> None:
    case = CASES[case_id]
    empty = harbor.empty[case.task].result()
    assert empty.status == "ok" and empty.reward == 0.0, f"{case.task}'s empty episode: {empty}"
    run = harbor.runs[case_id].result()
    want = empty.reward if case.reward is None else case.reward
    why = f"{case_id} on {case.task} ({case.mode}): reward {run.reward:g} ({run.status}), want {want:g}\n{run.details}"
    assert run.reward == want, why
    if case.status is not None:
        assert run.status == case.status, why


def cases(group: str):
    """Marked `docker`, one test per case of `group`."""

    def mark(fn):
        return pytest.mark.docker(pytest.mark.parametrize("case", GROUPS[group], ids=GROUPS[group])(fn))

    return mark


def test_link_escapes_follow_every_hop_out_of_the_protected_paths():
    from sandbox_workers.harbor_protect import link_escapes

    links = {
        "/bin": "usr/bin",
        "/usr/bin/awk": "/etc/alternatives/awk",
        "/etc/alternatives/awk": "/opt/awk/bin/mawk",
        "/usr/bin/py3versions": "../share/python3/py3versions.py",
        "/usr/lib/python3.11/sitecustomize.py": "/etc/python3.11/sitecustomize.py",
        "/usr/lib/ssl/certs": "/etc/ssl/certs",
        "/usr/lib/x/root": "/",
        "/usr/lib/x/etc": "../../../etc",
        "/usr/bin/python3": "python3.11",
        "/app/link": "/etc/secret",  # not under a protected path
        "/usr/bin/loop": "/usr/bin/loop",
    }
    assert link_escapes(links, ("/bin", "/usr/bin", "/usr/lib")) == (
        "/etc/alternatives/awk",
        "/etc/python3.11/sitecustomize.py",
        "/etc/ssl/certs",
        "/opt/awk/bin/mawk",
        "/usr/share/python3/py3versions.py",
    )


@cases("oracle")
def test_the_oracles_score_one(harbor, case):
    check(harbor, case)


@cases("reward")
def test_reward_files_written_during_the_episode(harbor, case):
    check(harbor, case)


@cases("shim")
def test_shims_earlier_on_path_and_replaced_interpreters(harbor, case):
    check(harbor, case)


@cases("startup")
def test_preload_and_shell_startup_files(harbor, case):
    check(harbor, case)


@cases("daemon")
def test_a_daemon_rewriting_the_reward(harbor, case):
    check(harbor, case)


@cases("planted")
def test_planted_pytest_and_python_files(harbor, case):
    check(harbor, case)


@cases("logs")
def test_logs_made_unwritable(harbor, case):
    check(harbor, case)


@cases("fork-bomb")
def test_a_fork_bomb_left_running(harbor, case):
    check(harbor, case)


@cases("storage")
def test_the_disk_filled_past_storage_mb(harbor, case):
    check(harbor, case)


@cases("symlink")
def test_symlinked_reward_paths(harbor, case):
    check(harbor, case)


@cases("stop")
def test_every_other_process_stopped(harbor, case):
    check(harbor, case)


@cases("tools")
def test_the_verifiers_tools_replaced(harbor, case):
    check(harbor, case)


@cases("oracle-plus")
def test_oracle_plus_hacks_scores_the_oracle_exactly(harbor, case):
    check(harbor, case)


@cases("infra")
def test_breaking_what_verification_needs_is_a_verdict(harbor, case):
    check(harbor, case)
