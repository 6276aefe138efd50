"""The `docker` sandbox backend against a real engine (marked `docker`).

Skipped, with the reason, when no Docker engine answers. The image is built from
compose/sandbox.Dockerfile through `sandbox_workers.images` (offline, cached).

Every hostile-command test checks the result flags, then that only docker-init and
`sleep` are left in the container, and after `close` that the container is gone (by
label and owner) and no host process sits in its cgroup.
"""

from __future__ import annotations

import os
import socket

import pytest

from sandbox_workers.base import Limits
from sandbox_workers.docker_backend import DockerSandbox
from sandbox_workers.docker_engine import LABEL, OWNER, OWNER_LABEL, get_client, reap
from sandbox_workers.docker_pool import (
    DEFAULT_IMAGE,
    RUN_USER,
    ContainerUnusable,
    SandboxImageMissing,
    clean_container,
    get_pool,
    shutdown_pools,
)
from sandbox_workers.factory import docker_available
from tests import sandbox_contract as contract
from tests.sandbox_contract import py

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(not docker_available(), reason="no Docker engine answers (start dockerd, or set DOCKER_HOST)"),
]

CLEAN = ["docker-init", "sleep"]


@pytest.fixture(scope="module")
def sandbox_image():
    """The sandbox image built; pools removed at the end."""
    from sandbox_workers import images

    images.ensure_image()
    yield
    shutdown_pools()


def own_containers() -> list[dict]:
    """Labelled containers of this test process, any state."""
    return get_client().api.containers(all=True, filters={"label": [f"{LABEL}=1", f"{OWNER_LABEL}={OWNER}"]})


def host_pids_in(container_id: str) -> list[int]:
    """Host processes whose cgroup path names the container."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cgroup") as f:
                    if container_id in f.read():
                        found.append(int(name))
            except OSError:
                pass
    return found


def names(sbx) -> list[str]:
    return sorted(name for _, name in sbx.processes())


@pytest.fixture
def sbx(sandbox_image):
    """A sandbox with no warm pool (close removes its container); checked after the test."""
    box = DockerSandbox(warm_pool=0)
    box.start(limits=Limits(), timeout=10)
    yield box
    cid = box.container_id
    assert names(box) == CLEAN, "processes left in the container"
    box.close()
    assert [c["Id"] for c in own_containers() if c["Id"] == cid] == []
    assert host_pids_in(cid) == []


# -- hostile commands ---------------------------------------------------------------


def test_ok_command_unprivileged_read_only(sbx):
    r = sbx.execute("id -u; pwd; touch /x 2>/dev/null || echo ro; echo err >&2; exit 3")
    assert r.exit_code == 3 and r.isolation == "docker" and not (r.timed_out or r.oom or r.truncated)
    assert r.stdout.split() == ["65534", "/work", "ro"] and r.stderr == "err\n"


def test_infinite_loop_times_out(sbx):
    contract.infinite_loop_times_out(sbx)


def test_fork_bomb_contained(sbx):
    contract.fork_bomb_contained(sbx)
    assert names(sbx) == CLEAN
    code = (
        "import os\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
        "            import time; time.sleep(30); os._exit(0)\n        n += 1\n"
        "except OSError as e:\n    print(n, e.errno)\n"
    )
    r = sbx.execute(py(code), timeout=10)
    forked, err = map(int, r.stdout.split())
    assert forked < Limits().pids and err == 11, r  # EAGAIN at the pids limit


def test_big_allocation_is_oom(sbx):
    r = sbx.execute(py("b = b'x' * (4 << 30); print('allocated')"), timeout=10)
    assert r.exit_code != 0 and r.oom and "allocated" not in r.stdout and not r.timed_out, r


def test_stdout_flood_is_capped(sbx):
    contract.stdout_flood_is_capped(sbx)


def test_host_loopback_unreachable(sbx):
    with contract.host_listener() as port:
        code = (
            "import os, socket\nprint(sorted(os.listdir('/sys/class/net')))\ntry:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')\n"
            "except OSError as e:\n    print('blocked', type(e).__name__)\n"
        )
        r = sbx.execute(py(code), timeout=10)
        assert r.exit_code == 0 and r.stdout.split("\n")[:2] == ["['lo']", "blocked ConnectionRefusedError"], r


def test_write_outside_work_fails(sbx):
    for cmd in ("echo x >> /etc/passwd", "touch /etc/rlbus-x", "touch /usr/rlbus-x", "mkdir /root/x"):
        r = sbx.execute(cmd)
        assert r.exit_code != 0, (cmd, r)
    assert sbx.execute("grep -c rlbus /etc/passwd; ls /etc/rlbus-x").exit_code != 0


def test_child_ignoring_sigterm_killed(sbx):
    contract.child_ignoring_sigterm_killed(sbx)


def test_double_forked_daemon_gone(sbx):
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        time.sleep(300)\n    os._exit(0)\n"
        "os.wait(); print('parent done')\n"
    )
    r = sbx.execute(py(code), timeout=10)
    assert r.exit_code == 0 and not r.timed_out and r.stdout == "parent done\n", r
    assert r.duration_ms < 5000


def test_signal_exit_code_and_killed_wrapper(sbx):
    r = sbx.execute("sleep 5", timeout=0)
    assert r.timed_out and r.duration_ms < 3000, r  # 0 is the shortest limit, not "no limit"
    r = sbx.execute("kill -TERM $$")
    assert r.exit_code == 143 and r.stderr == "", r  # the wrapper's own "Terminated" is not shown
    # the command kills the wrapper around it and leaves a daemon: the host sweeps
    code = (
        "import os, signal, time\n"
        "if os.fork() == 0:\n    os.setsid(); os.closerange(0, 3); time.sleep(300)\n"
        "for p in os.listdir('/proc'):\n"
        "    if p.isdigit() and ('rlbus-' + 'exec').encode() in open(f'/proc/{p}/cmdline', 'rb').read():\n"
        "        os.kill(int(p), signal.SIGKILL)\n"
    )
    r = sbx.execute(py(code), timeout=5)
    assert r.exit_code == 137 and not r.timed_out, r
    assert names(sbx) == CLEAN


def test_container_removed_behind_our_back_is_replaced(sbx, sandbox_image):
    get_client().api.remove_container(sbx.container_id, force=True)
    r = sbx.execute("echo alive")
    assert r.stdout == "alive\n"


# -- files and reset ----------------------------------------------------------------


def test_files_and_reset(sbx):
    sbx.write_file("src/a.py", b"print(6 * 7)\n")
    assert sbx.execute(["python3", "src/a.py"]).stdout == "42\n"
    r = sbx.execute("printf made > out.txt && ln -s /etc/passwd link && mkfifo fifo")
    assert r.exit_code == 0, r
    assert sbx.read_file("out.txt") == b"made"
    assert sbx.read_file("/work/src/a.py") == b"print(6 * 7)\n"
    sbx.write_file("out.txt", b"\x00\xff" * 1000)
    assert sbx.read_file("out.txt") == b"\x00\xff" * 1000
    for bad in ("../x", "/etc/passwd", "a/../../x"):
        with pytest.raises(ValueError):
            sbx.read_file(bad)
    for op in (
        lambda: sbx.read_file("link"),
        lambda: sbx.write_file("link", b"x"),
        lambda: sbx.write_file("link/x", b"x"),
        lambda: sbx.read_file("fifo"),
    ):
        with pytest.raises(OSError):
            op()
    sbx.reset()
    r = sbx.execute("ls -A /work /tmp")
    assert r.exit_code == 0 and r.stdout.split() == ["/tmp:", "/work:"], r
    with pytest.raises(FileNotFoundError):
        sbx.read_file("out.txt")


# -- warm pool, proof of cleanliness, reaper ------------------------------------------


def test_warm_pool_hands_out_only_fresh_containers(sandbox_image):
    """Containers come back through the pool; nothing of one user is seen by the next."""
    api = get_client().api
    box = DockerSandbox(warm_pool=2)
    box.start(limits=Limits(tmp_mb=48), timeout=10)  # its own pool
    seen = []
    try:
        for i in range(6):
            seen.append(box.container_id)
            r = box.execute("ls -A /work /tmp; ls /dev/mqueue")
            assert r.stdout.split() == ["/tmp:", "/work:"], (i, r)
            assert names(box) == CLEAN, i
            box.write_file("secret.txt", f"secret {i}".encode())
            box.execute(f"echo {i} > /tmp/t; mkdir -p d/e && chmod 000 d")
            # a process that escaped execute (started by a raw exec, not our wrapper)
            ex = api.exec_create(box.container_id, ["sleep", "300"], user=RUN_USER)
            api.exec_start(ex["Id"], detach=True)
            box.reset()
    finally:
        box.close()
    assert len(set(seen)) < len(seen), f"no container was recycled: {seen}"


def test_concurrent_sandboxes_share_the_pool(sandbox_image):
    """Threads acquire, run and return at once; none sees another's files or container."""
    from concurrent.futures import ThreadPoolExecutor

    def worker(i: int) -> list[str]:
        seen = []
        for j in range(3):
            with DockerSandbox(warm_pool=2, concurrency=4) as box:
                box.start(limits=Limits(tmp_mb=56), timeout=10)
                r = box.execute(f"ls -A; echo {i}-{j} > mine; cat mine")
                assert r.exit_code == 0 and r.stdout == f"{i}-{j}\n", r
                seen.append(box.container_id)
        return seen

    with ThreadPoolExecutor(4) as ex:
        runs = list(ex.map(worker, range(4)))
    assert sum(map(len, runs)) == 12  # every sandbox started empty (`ls -A` printed nothing)


def test_unclean_container_is_never_reused(sandbox_image):
    """A process the sandbox user cannot kill (here: root's) fails the proof."""
    pool = get_pool(DEFAULT_IMAGE, Limits(tmp_mb=40), 1.0, 0, None)
    box = pool.acquire()
    api = pool.api
    try:
        ex = api.exec_create(box.id, ["sleep", "300"], user="0:0")
        api.exec_start(ex["Id"], detach=True)
        with pytest.raises(ContainerUnusable, match="sleep"):
            clean_container(api, box.id)
    finally:
        pool.remove(box)


def test_reaper_removes_created_and_orphaned(sandbox_image):
    api = get_client().api
    dead = f"{socket.gethostname()}:999999999:0"
    ids = [
        api.create_container(DEFAULT_IMAGE, ["true"], labels=labels)["Id"]
        for labels in ({LABEL: "1"}, {LABEL: "1", OWNER_LABEL: dead})
    ]
    assert {api.inspect_container(i)["State"]["Status"] for i in ids} == {"created"}
    live = DockerSandbox(warm_pool=0)
    live.start(timeout=10)
    try:
        removed = reap()
        assert set(ids) <= set(removed) and live.container_id not in removed
        assert live.execute("true").exit_code == 0
    finally:
        live.close()
    left = api.containers(all=True, filters={"label": f"{LABEL}=1"})
    assert not {c["Id"] for c in left} & set(ids)


def test_missing_image_names_the_build_command(sandbox_image):
    box = DockerSandbox(warm_pool=0)
    with pytest.raises(SandboxImageMissing, match="rlbus sandbox build-image --tag rlbus-nope:1"):
        box.start(image="rlbus-nope:1")


def test_no_own_container_left_after_shutdown(sandbox_image):
    box = DockerSandbox(warm_pool=2)
    box.start(timeout=10)
    box.execute("true")
    box.close()
    shutdown_pools()
    assert own_containers() == []
