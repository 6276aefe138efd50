"""The compose stack for real (issue #7): images built offline, every role a container.

`make images` (which also writes compose/.env, the NATS passwords), then `docker compose up`
of compose/docker-compose.yml with the smoke config, 2 rollout and 2 verifier replicas,
NATS authentication on (one user per role): the learner steps, `rlbus status` sees both
rollout workers, `rlbus tail` prints rewards, a frozen rollout container's tasks are
redelivered to the other replica and the container is then SIGKILLed, rollout scales
1 -> 3 -> 1 mid-run, and the drained run's accounting has lost = 0. The stack is torn down (no containers, no volumes) whatever happens.

Every host-side check logs in as the read-only `monitor` user from compose/.env (as
`set -a; . compose/.env; set +a` would); the test also shows that a login without
credentials is refused, that the monitor's publish to `rewards.<run>.x` is denied with a
clear permission error, and that no role of the stack hit a permission violation
(nats-server logs each one).

Figures (image sizes, stack start, learner samples/s with 1 vs 2 rollout replicas) are
printed and written to runs/compose_figures.json.

Set RLBUS_SKIP_IMAGE_BUILD=1 to reuse images already built by `make images`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose" / "docker-compose.yml"
ENV_FILE = ROOT / "compose" / ".env"
CLUSTER = ROOT / "compose" / "docker-compose.cluster.yml"
RLBUS = str(Path(sys.executable).parent / "rlbus")
# small and fast: the smoke model, a short SFT, short ack_wait so a killed worker's tasks come back soon
FAST_SET = "sft.seconds=20 sft.max_steps=60 rollout.ack_wait_s=10 learner.step_window_s=0.5 scheduler.eval.n=20"

# test_compose_stack needs a Docker engine (marked docker, slow); the file checks parse the YAML only
RUN_DIR = "/runs/${RLBUS_RUN_ID:-demo}"
ROLE_UID = "10001:10001"
# what each role may mount from the run folder (issue 27): target -> read-only?
MOUNTS = {
    "init": {"/runs": False, f"{RUN_DIR}/checkpoints": False, f"{RUN_DIR}/secrets": False},
    "learner": {"/runs": True, f"{RUN_DIR}/checkpoints": False},
    "scheduler": {"/runs": True, f"{RUN_DIR}/secrets": True, "/var/lib/rlbus": False},
    "sampler": {"/runs": True},
    "rollout": {"/runs": True},
    "sandbox": {"/runs": True, f"{RUN_DIR}/secrets": True},
    "verifier": {"/runs": True, f"{RUN_DIR}/secrets": True},
}
ROOT_ROLES = {"init", "scheduler", "sandbox", "verifier", "nats-auth"}  # each says why in the compose file


def engine_problem() -> str | None:
    """Why the compose tests cannot run here, or None."""
    if not shutil.which("docker"):
        return "no docker CLI on PATH"
    if subprocess.run(["docker", "info"], check=False, capture_output=True, timeout=30).returncode != 0:
        return "no Docker engine answers (docker info failed); run ../shared/tools/docker-engine or start dockerd"
    if subprocess.run(["docker", "compose", "version"], check=False, capture_output=True, timeout=30).returncode != 0:
        return "the docker compose v2 plugin is missing"
    if (
        subprocess.run(["docker", "image", "inspect", "python:3.11-slim"], check=False, capture_output=True).returncode
        != 0
    ):
        return "base image python:3.11-slim is not on the engine (images build offline, nothing is pulled)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def image_sizes() -> dict[str, float]:
    """MB of each image `make images` builds."""
    out = {}
    for tag in ("rlbus:latest", "rlbus-nats:latest", "rlbus-sandbox:latest"):
        r = subprocess.run(
            ["docker", "image", "inspect", "-f", "{{.Size}}", tag], check=False, capture_output=True, text=True
        )
        if r.returncode == 0:
            out[tag] = round(int(r.stdout.strip()) / 1e6, 1)
    return out


@pytest.fixture(scope="session")
def images():
    """The images, built once per session by `make images` (unless RLBUS_SKIP_IMAGE_BUILD=1)."""
    why = engine_problem()
    if why:
        pytest.skip(why)
    t0 = time.monotonic()
    if os.environ.get("RLBUS_SKIP_IMAGE_BUILD") != "1":
        r = subprocess.run(["make", "images"], cwd=ROOT, check=False, capture_output=True, text=True, timeout=1500)
        assert r.returncode == 0, f"make images failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        assert ENV_FILE.exists() and ENV_FILE.stat().st_mode & 0o777 == 0o600, "make images did not write compose/.env"
    else:
        from rlbus.natsauth import write_env_file

        write_env_file(ENV_FILE)  # what `make images` does: passwords kept if present
    sizes = image_sizes()
    assert set(sizes) == {"rlbus:latest", "rlbus-nats:latest", "rlbus-sandbox:latest"}, sizes
    return {"sizes_mb": sizes, "build_s": round(time.monotonic() - t0, 1)}


class Stack:
    """One compose project (unique name), its host ports and helpers."""

    def __init__(self, files: list[Path], run_id: str, extra_env: dict[str, str] | None = None):
        self.project = f"rlbustest{uuid.uuid4().hex[:8]}"
        self.files, self.run_id = files, run_id
        self.port, self.monitor = free_port(), free_port()
        self.env = dict(
            os.environ,
            NATS_HOST_PORT=str(self.port),
            NATS_MONITOR_HOST_PORT=str(self.monitor),
            RLBUS_RUN_ID=run_id,
            RLBUS_CONFIG="/app/examples/smoke.toml",
            RLBUS_SET=FAST_SET,
            **(extra_env or {}),
        )
        self.url = f"nats://127.0.0.1:{self.port}"
        self.login = monitor_login()
        # the host CLI's environment after `set -a; . compose/.env; set +a`: the monitor user
        self.cli_env = {**{k: v for k, v in os.environ.items() if not k.startswith("RLBUS_NATS_")}, **self.login}

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        cmd = ["docker", "compose", "-p", self.project]
        for f in self.files:
            cmd += ["-f", str(f)]
        r = subprocess.run(cmd + list(args), env=self.env, check=False, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        return r

    def containers(self, service: str | None = None, all_states: bool = False) -> list[str]:
        cmd = ["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={self.project}"]
        if service:
            cmd += ["--filter", f"label=com.docker.compose.service={service}"]
        if all_states:
            cmd.append("-a")
        return subprocess.run(cmd, check=False, capture_output=True, text=True).stdout.split()

    def status(self, url: str | None = None, listen: float = 2.5) -> dict | None:
        r = subprocess.run(
            [
                RLBUS,
                "status",
                "--nats-url",
                url or self.url,
                "--run-id",
                self.run_id,
                "--json",
                "--listen",
                str(listen),
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
            env=self.cli_env,
        )
        return json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else None

    def wait_step(self, step: int, timeout: float, url: str | None = None) -> dict:
        deadline = time.monotonic() + timeout
        st = None
        while time.monotonic() < deadline:
            st = self.status(url, listen=1.0)
            if st and st["step"] >= step:
                return st
            time.sleep(3)
        raise AssertionError(f"learner did not reach step {step} in {timeout}s; last status {st}\n{self.logs()}")

    def wait_workers(self, role: str, n: int, timeout: float, url: str | None = None) -> dict:
        deadline = time.monotonic() + timeout
        st = None
        while time.monotonic() < deadline:
            st = self.status(url)
            if st and sum(w["role"] == role for w in st["workers"]) == n:
                return st
            time.sleep(2)
        raise AssertionError(f"expected {n} {role} workers within {timeout}s; last status {st}")

    def learner_rate(self, seconds: float, url: str | None = None) -> float:
        """Trained samples/s measured from the learner's counter over `seconds`."""
        st = self.status(url, listen=seconds)
        return st["stages"]["learner"]["rate_per_s"] if st else 0.0

    def permission_violations(self) -> list[str]:
        """nats-server's log lines about refused publishes/subscriptions (every node)."""
        out = self.compose("logs", "--no-color", "--no-log-prefix", *self.nats_services(), check=False).stdout
        return [ln for ln in out.splitlines() if "Violation" in ln and "Authorization Violation" not in ln]

    def nats_services(self) -> list[str]:
        return ["nats", "nats-2", "nats-3"] if CLUSTER in self.files else ["nats"]

    def logs(self, tail: int = 40) -> str:
        return self.compose("logs", "--no-color", "--tail", str(tail), check=False).stdout[-6000:]

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "-t", "20", check=False, timeout=300)


def monitor_login() -> dict[str, str]:
    """RLBUS_NATS_USER / RLBUS_NATS_PASSWORD of compose/.env (the read-only monitor)."""
    from rlbus.natsauth import read_env

    env = read_env(ENV_FILE)
    assert env.get("RLBUS_NATS_USER") == "monitor" and env.get("RLBUS_NATS_PASSWORD"), (
        "compose/.env lacks the monitor login (make images writes it)"
    )
    return {"RLBUS_NATS_USER": env["RLBUS_NATS_USER"], "RLBUS_NATS_PASSWORD": env["RLBUS_NATS_PASSWORD"]}


def check_auth(stack: Stack) -> dict:
    """No credentials: refused. The monitor: may read status, may not publish a reward."""
    from bus.conn import NatsAuthError, PermissionDenied, connect, publish_checked

    anon_env = {k: v for k, v in stack.cli_env.items() if not k.startswith("RLBUS_NATS_")}
    t0 = time.monotonic()
    r = subprocess.run(
        [RLBUS, "status", "--nats-url", stack.url, "--run-id", stack.run_id, "--json"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=anon_env,
    )
    assert r.returncode != 0 and "refused the login without credentials" in r.stderr, (r.returncode, r.stderr[-2000:])
    out = {"anonymous_status_refused_in_s": round(time.monotonic() - t0, 2)}

    async def go():
        with pytest.raises(NatsAuthError):
            await connect(stack.url, name="test-anon", user="monitor", password="pwnot-the-password")
        nc = await connect(stack.url, name="test-monitor", user="monitor", password=stack.login["RLBUS_NATS_PASSWORD"])
        try:
            with pytest.raises(PermissionDenied) as denied:
                await publish_checked(nc, f"rewards.{stack.run_id}.x", b"{}")
            return str(denied.value)
        finally:
            await nc.close()

    out["monitor_publish_denied"] = asyncio.run(go())
    assert "monitor" in out["monitor_publish_denied"] and f"rewards.{stack.run_id}.x" in out["monitor_publish_denied"]
    assert "publish" in out["monitor_publish_denied"].lower()
    # the server logs the refusal too
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(
        f"rewards.{stack.run_id}.x" in ln for ln in stack.permission_violations()
    ):
        time.sleep(0.5)
    assert any("user:monitor" in ln and f"rewards.{stack.run_id}.x" in ln for ln in stack.permission_violations())
    return out


def role_violations(stack: Stack) -> list[str]:
    """Permission violations by anyone but the test's own monitor probe: must be none."""
    return [ln for ln in stack.permission_violations() if f"rewards.{stack.run_id}.x" not in ln]


def consumer_state(url: str, run_id: str) -> dict:
    """Redelivery and pending counts of the rollout and verifier durables."""
    from bus.conn import connect
    from bus.subjects import Registry

    async def go():
        nc = await connect(url, name="test-compose", **monitor_credentials())
        try:
            js, reg = nc.jetstream(timeout=10), Registry(run_id)
            out = {}
            for fam, durable in (("TASKS", "rollout"), ("TRAJ", "verifier")):
                ci = await js.consumer_info(reg.stream(fam), durable)
                # every delivery, redeliveries included, takes a consumer sequence; the stream
                # sequence only grows with new messages: the difference counts redeliveries so far
                out[durable] = {
                    "redeliveries_total": ci.delivered.consumer_seq - ci.delivered.stream_seq,
                    "redelivered_now": ci.num_redelivered,
                    "ack_pending": ci.num_ack_pending,
                    "pending": ci.num_pending,
                }
            return out
        finally:
            await nc.close()

    return asyncio.run(go())


def monitor_credentials() -> dict[str, str]:
    login = monitor_login()
    return {"user": login["RLBUS_NATS_USER"], "password": login["RLBUS_NATS_PASSWORD"]}


def run_accounting(url: str, run_id: str) -> dict:
    """rlbus.run.accounting over the run's streams: fates of every published task."""
    from bus.conn import connect
    from bus.subjects import Registry
    from rlbus.run.accounting import account

    async def go():
        nc = await connect(url, name="test-compose-accounting", **monitor_credentials())
        try:
            acc = await account(nc.jetstream(timeout=30), Registry(run_id))
            return {"published": len(acc.published), **acc.counts(), "trained_twice": acc.trained_twice}
        finally:
            await nc.close()

    return asyncio.run(go())


def drain_and_stop(stack: Stack, url: str | None = None, timeout: float = 180) -> dict:
    """The launcher's stop order: sampler, then wait for empty queues, then the rest; return the last status."""
    stack.compose("stop", "-t", "30", "sampler")
    deadline = time.monotonic() + timeout
    st = None
    while time.monotonic() < deadline:
        st = stack.status(url, listen=1.0)
        if st and all(st["stages"][r].get("queue_depth", 0) == 0 for r in ("rollout", "verifier", "learner")):
            break
        time.sleep(3)
    stack.compose("stop", "-t", "40", "rollout", "verifier")
    stack.compose("stop", "-t", "60", "learner")
    return st


def _services(path: Path = COMPOSE) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())["services"]


def _mounts(service: dict) -> dict[str, bool]:
    """target -> read-only, of a service's short-syntax volumes."""
    out = {}
    for v in service.get("volumes", []):
        parts = v.split(":")
        ro = parts[-1] == "ro"
        target = parts[-2] if ro else parts[-1]
        if target.startswith("-demo}"):  # ${RLBUS_RUN_ID:-demo} holds a ':' of its own
            target = ":".join(parts[1:-1] if ro else parts[1:])
        out[target] = ro
    return out


def test_every_role_mounts_only_what_it_needs():
    """Issue 27: the rollout cannot rewrite config.json, model/, checkpoints/, secrets/ or run.db:
    /runs is read-only to every role but init; checkpoints/ is the learner's; secrets/ only
    in the roles that sign or check tool records."""
    services = _services()
    for role, want in MOUNTS.items():
        assert _mounts(services[role]) == want, (role, services[role].get("volumes"))
    assert not any("secrets" in t or "checkpoints" in t for t in _mounts(services["rollout"]))
    assert "RLBUS_DB_URL" in services["scheduler"]["environment"]  # run.db lives in the scheduler's volume


def test_roles_run_unprivileged_unless_they_say_why():
    services = _services()
    text = COMPOSE.read_text()
    for role in ("learner", "sampler", "rollout"):
        assert services[role]["user"] == ROLE_UID, role
    for role in ROOT_ROLES:
        assert services[role]["user"] == "0:0", role
    for role, svc in services.items():
        if role.startswith(("nats", "postgres")) and role != "nats-auth":
            continue
        assert svc.get("user") in (ROLE_UID, "0:0"), f"{role} has no explicit user"
    # every root service carries its reason next to `user: "0:0"`
    assert text.count('user: "0:0"') == len(ROOT_ROLES)
    assert "USER 10001:10001" in (ROOT / "compose" / "rlbus.Dockerfile").read_text()


def test_init_hands_out_the_run_folder():
    """The entry point gives checkpoints/ to the role uid and keeps secrets/ root-only (0700)."""
    text = (ROOT / "compose" / "entrypoint.sh").read_text()
    assert 'chown "${RLBUS_ROLE_UID:-10001}:${RLBUS_ROLE_UID:-10001}" "$run/checkpoints"' in text
    assert 'chmod 0700 "$run/secrets"' in text and 'chmod -R go-w,a+rX "$run/config.json" "$run/model"' in text


def test_cluster_file_keeps_the_mounts():
    """The cluster overlay changes environments only: no role gains a mount there."""
    for role, svc in _services(CLUSTER).items():
        if role in MOUNTS:
            assert "volumes" not in svc and "user" not in svc, role


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_compose_stack(images):
    """2 rollout + 2 verifier replicas; status, tail, kill -9, elastic 1->3->1, lost = 0, clean teardown."""
    stack = Stack([COMPOSE], run_id="composetest")
    figures = {"image_sizes_mb": images["sizes_mb"], "images_build_s": images["build_s"]}
    try:
        t0 = time.monotonic()
        stack.compose("up", "-d", "--scale", "rollout=2", "--scale", "verifier=2", timeout=900)
        figures["compose_up_s"] = round(time.monotonic() - t0, 1)  # includes init: tiny model + SFT
        stack.wait_step(1, 600)
        figures["stack_start_to_first_step_s"] = round(time.monotonic() - t0, 1)

        st = stack.wait_step(5, 600)
        st = stack.wait_workers("rollout", 2, 120)
        assert sum(w["role"] == "verifier" for w in st["workers"]) == 2, st["workers"]
        assert len({w["host"] for w in st["workers"] if w["role"] == "rollout"}) == 2  # two containers

        figures["auth"] = check_auth(stack)
        tail = subprocess.run(
            [RLBUS, "tail", "rewards.>", "--nats-url", stack.url, "--json", "--max", "3", "--timeout", "120"],
            check=False,
            capture_output=True,
            text=True,
            timeout=180,
            env=stack.cli_env,
        )
        lines = [ln for ln in tail.stdout.splitlines() if ln.strip()]
        figures["tail_max_3_lines"] = len(lines)
        # bus/tail.py keeps printing the messages already in flight when --max is reached
        # (its callback does not check the count first); at least 3 rewards must appear
        assert len(lines) >= 3, (tail.stdout, tail.stderr)
        assert all(json.loads(ln)["kind"] == "reward" and "reward" in json.loads(ln) for ln in lines[:3]), lines[0]

        figures["learner_samples_per_s_2_rollout"] = stack.learner_rate(20)

        # A rollout container that stops mid-run loses nothing: freeze one (docker pause: it can
        # neither ack nor extend its tasks), and the tasks it holds come back to the other replica
        # after ack_wait (10 s); then SIGKILL it. Whether a worker holds tasks at a given instant
        # is chance (a tiny batch is generated in ~0.1 s and the sampler's gate keeps the queue
        # short), so a freeze that shows no redelivery means the victim held nothing: it is thawed
        # and the freeze tried again. Only a frozen holder's tasks can be redelivered (the live
        # replica extends its own with in_progress), so a redelivery proves the victim held some.
        redelivered, attempts = 0, 0
        victim = stack.containers("rollout")[0]
        while redelivered == 0 and attempts < 10:
            attempts += 1
            before = consumer_state(stack.url, stack.run_id)["rollout"]
            subprocess.run(["docker", "pause", victim], check=True, capture_output=True)
            deadline = time.monotonic() + 10 + 12
            while time.monotonic() < deadline and redelivered == 0:
                time.sleep(1)
                now = consumer_state(stack.url, stack.run_id)["rollout"]
                redelivered = now["redeliveries_total"] - before["redeliveries_total"]
            if redelivered == 0:
                subprocess.run(["docker", "unpause", victim], check=True, capture_output=True)
                time.sleep(2)
        figures["rollout_freeze_attempts"] = attempts
        figures["rollout_tasks_redelivered_from_frozen"] = redelivered
        assert redelivered >= 1, f"no task of a frozen rollout worker was redelivered in {attempts} tries"
        # SIGKILL while frozen: its redelivered tasks are never acked by it (no duplicates below)
        subprocess.run(["docker", "kill", victim], check=True, capture_output=True)
        step_at_kill = stack.status()["step"]
        stack.wait_step(step_at_kill + 3, 300)  # the pipeline keeps going on the other replica

        # elastic: 1 -> 3 -> 1 rollout replicas during the run
        stack.compose("up", "-d", "--no-deps", "--no-recreate", "--scale", "rollout=1", "rollout")
        stack.wait_workers("rollout", 1, 120)
        figures["learner_samples_per_s_1_rollout"] = stack.learner_rate(20)
        stack.compose("up", "-d", "--no-deps", "--no-recreate", "--scale", "rollout=3", "rollout")
        stack.wait_workers("rollout", 3, 300)
        step = stack.status()["step"]
        stack.wait_step(step + 3, 300)
        stack.compose("up", "-d", "--no-deps", "--no-recreate", "--scale", "rollout=1", "rollout")
        stack.wait_workers("rollout", 1, 120)
        step = stack.status()["step"]
        stack.wait_step(step + 2, 300)

        drain_and_stop(stack)
        acc = run_accounting(stack.url, stack.run_id)
        figures["accounting"] = acc
        assert acc["published"] > 0 and acc["trained"] > 0, acc
        assert acc["lost"] == 0, acc
        assert acc["trained_twice"] == 0, acc
        violations = role_violations(stack)
        assert violations == [], "roles hit NATS permission violations:\n" + "\n".join(violations[:20])
    finally:
        print(json.dumps(figures, indent=1))
        out = ROOT / "runs"
        out.mkdir(exist_ok=True)
        (out / "compose_figures.json").write_text(json.dumps(figures, indent=1))
        stack.down()
    assert stack.containers(all_states=True) == [], "containers left after docker compose down"
    vols = subprocess.run(
        ["docker", "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={stack.project}"],
        check=False,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert vols == [], vols
