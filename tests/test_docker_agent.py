"""The docker sandbox's resident agent (`run_isolated`) and the code verifier through it (marked `docker`).

Against a real engine, no mocks: hostile commands end as result flags and leave nothing
for the next run of the same container; the command cannot reach the agent (signals,
/proc, its stream); a container that cannot be proven clean or whose agent died is
never handed out again; the steady state makes no docker API call; and every tamper
attempt of `tests/test_code_verifier.py` scores 0 with status `tamper` through it.
Skipped, with the reason, when no Docker engine answers.
"""

from __future__ import annotations

import textwrap
import threading
import time

import pytest

from producers.domains import code as he
from sandbox_workers.base import Limits
from sandbox_workers.docker_engine import get_client
from sandbox_workers.docker_pool import DEFAULT_IMAGE, ContainerUnusable
from sandbox_workers.factory import docker_available

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(not docker_available(), reason="no Docker engine answers (start dockerd, or set DOCKER_HOST)"),
]

# every test that reuses a container has a pool of its own (the pool key includes the limits)
LIM = Limits(memory_mb=128, cpu_seconds=10, pids=32, tmp_mb=24)


@pytest.fixture(scope="module")
def db():
    """`sandbox_workers.docker_oneshot`, with the sandbox image built; pools removed at the end."""
    from sandbox_workers import docker_oneshot, images
    from sandbox_workers.docker_pool import shutdown_pools

    images.ensure_image()
    yield docker_oneshot
    shutdown_pools()


def run(db, cmd, files=(), limits=LIM, timeout=10.0, **kw):
    argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else cmd
    return db.run_isolated(list(files), argv=argv, timeout=timeout, limits=limits, warm_pool=1, **kw)


def py(code: str) -> list[str]:
    return ["python3", "-c", textwrap.dedent(code)]


PROBE = (
    'n=0; for p in /proc/[0-9]*; do [ "${p#/proc/}" = "$$" ] || n=$((n + 1)); done; echo procs=$n; '
    "ls -A /work /tmp /dev/mqueue | tr '\\n' ' '; echo; tail -n +2 /proc/sysvipc/shm | wc -l"
)


def probe(db, limits=LIM):
    """procs seen by a fresh command (docker-init, the agent), the listing of the wiped dirs, SysV segments."""
    r = run(db, PROBE, limits=limits)
    lines = r.result.stdout.splitlines()
    return lines[0], lines[1].split(), int(lines[2]), r.container


# -- the basics ------------------------------------------------------------------------


def test_files_user_caps_and_report(db):
    code = (
        "id -u; id -g; pwd; ls -A; cat a/b.txt; grep -E '^(CapEff|CapPrm|NoNewPrivs)' /proc/self/status; "
        "touch /x 2>/dev/null || echo ro; echo err >&2; rm a/b.txt; exit 3"
    )
    r = run(db, code, files=[("in.txt", b"1"), ("a/b.txt", b"hello\n")], report=("a/b.txt", "in.txt", "nope"))
    out = r.result.stdout.split()
    assert r.result.exit_code == 3 and r.result.isolation == "docker" and r.clean, r.result
    assert out[:7] == ["65534", "65534", "/work", "a", "in.txt", "hello", "CapPrm:"], out
    assert out[7:] == ["0000000000000000", "CapEff:", "0000000000000000", "NoNewPrivs:", "1", "ro"], out
    assert r.result.stderr == "err\n" and r.exists == {"in.txt"}


def test_python_mode_is_a_fresh_main(db):
    code = (
        "import sys\nprint(__name__, sys.argv, 'resource' in sys.modules, 'docker_agent' in repr(sys.modules),"
        " sys.flags.isolated, sys.flags.no_site)\nprint(sorted(k for k in globals() if not k.startswith('__')))"
        "\nraise SystemExit(4)\n"
    )
    r = db.run_isolated([("m.py", code.encode())], python="m.py", timeout=10, limits=LIM, warm_pool=1)
    assert r.result.exit_code == 4, r.result
    assert r.result.stdout.splitlines() == ["__main__ ['m.py'] False False 1 1", "['sys']"]
    r = db.run_isolated(
        [("m.py", b"import os\nprint(os.getuid())\n1/0\n")], python="m.py", timeout=10, limits=LIM, warm_pool=1
    )
    assert r.result.exit_code == 1 and r.result.stdout == "65534\n" and "ZeroDivisionError" in r.result.stderr


def test_bad_paths_are_refused_before_anything_runs(db):
    for bad in ("../x", "/etc/passwd", "a/../../x"):
        with pytest.raises(ValueError):
            run(db, "true", files=[(bad, b"x")])


# -- hostile commands -----------------------------------------------------------------


def test_timeout_kills_everything_and_the_next_run_is_clean(db):
    t0 = time.monotonic()
    code = """
        import os, signal, time
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN); os.setsid()
            if os.fork() == 0:
                time.sleep(300)
            os._exit(0)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True: pass
    """
    r = run(db, py(code), timeout=1)
    assert r.result.timed_out and r.result.exit_code == 137 and r.clean, r.result
    assert time.monotonic() - t0 < 5
    procs, listing, segs, cid = probe(db)
    assert (procs, listing, segs, cid) == ("procs=2", ["/dev/mqueue:", "/tmp:", "/work:"], 0, r.container)


def test_daemon_files_and_ipc_do_not_reach_the_next_run(db):
    code = """
        import ctypes, os, time
        libc = ctypes.CDLL(None)
        assert libc.shmget(0x5EC, 4096, 0o1600) >= 0  # IPC_CREAT | 0600: a SysV segment
        os.makedirs('d/e'); open('d/e/secret', 'w').write('s'); os.chmod('d', 0)
        open('/tmp/secret', 'w').write('s'); os.chmod('/work', 0o500)
        if os.fork() == 0:
            os.setsid(); os.closerange(0, 3)
            if os.fork() == 0:
                time.sleep(300)
            os._exit(0)
        print('left')
    """
    r = run(db, py(code))
    assert r.result.exit_code == 0 and r.result.stdout == "left\n" and r.clean, r.result
    procs, listing, segs, cid = probe(db)
    assert (procs, listing, segs, cid) == ("procs=2", ["/dev/mqueue:", "/tmp:", "/work:"], 0, r.container)


def test_fork_bomb_flood_oom_and_signals(db):
    r = run(db, "f() { f | f & }; f; sleep 30", timeout=2)
    assert (r.result.timed_out or r.result.exit_code != 0) and r.clean, r.result
    code = (
        "import os\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
        "            import time; time.sleep(30); os._exit(0)\n        n += 1\n"
        "except OSError as e:\n    print(n, e.errno)\n"
    )
    r = run(db, py(code))
    forked, err = map(int, r.result.stdout.split())
    assert forked < LIM.pids and err == 11 and r.clean, r.result  # EAGAIN at the pids limit
    r = run(
        db,
        py("import sys\nb = b'x' * (1 << 20)\nfor _ in range(50): sys.stdout.buffer.write(b)\n"),
        limits=Limits(memory_mb=128, cpu_seconds=10, pids=32, tmp_mb=24, output_cap_bytes=4096),
    )
    assert r.result.truncated and len(r.result.stdout) < 4200 and "truncated" in r.result.stdout
    r = run(db, py("b = b'x' * (1 << 30); print('allocated')"))
    assert r.result.oom and r.result.exit_code != 0 and "allocated" not in r.result.stdout, r.result
    r = run(db, "kill -TERM $$")
    assert r.result.exit_code == 143 and not r.result.timed_out
    r = run(db, "yes | head -c 3")  # SIGPIPE has its default action in commands
    assert r.result.exit_code == 0 and r.result.stdout == "y\ny" and r.result.stderr == ""
    assert probe(db)[:3] == ("procs=2", ["/dev/mqueue:", "/tmp:", "/work:"], 0)


def test_command_cannot_reach_the_agent(db):
    code = """
        import os, signal
        agent = [p for p in os.listdir('/proc') if p.isdigit() and p not in ('1', str(os.getpid()))
                 and open(f'/proc/{p}/status').read().split('Uid:')[1].split()[0] == '0']
        print(len(agent), flush=True)
        for pid in agent + ['1']:
            for sig in (signal.SIGKILL, signal.SIGSTOP, 0):
                try:
                    os.kill(int(pid), sig); print('signalled', pid, sig)
                except PermissionError:
                    pass
            for f in ('environ', 'mem', 'fd/0', 'fd/1', 'root/proc/self/status'):  # cmdline is public
                try:
                    open(f'/proc/{pid}/{f}', 'r+b' if f.startswith('fd') else 'rb').read(1); print('opened', pid, f)
                except OSError:
                    pass
        # a forged reply on our own stdout is only output
        os.write(1, b'\\x00\\x00\\x00\\x2a' + b'\\x01' * 42)
    """
    r = run(db, py(code))
    assert r.result.exit_code == 0 and r.clean, r.result
    lines = r.result.stdout.split("\n")
    assert lines[0] == "1" and not [ln for ln in lines if ln.startswith(("signalled", "opened"))], r.result.stdout
    assert probe(db)[0] == "procs=2"


# -- unusable containers -----------------------------------------------------------------


def test_unclean_container_is_discarded(db):
    """A file the sandbox user cannot remove (root's, made behind the agent's back) fails the proof."""
    lim = Limits(memory_mb=128, cpu_seconds=10, pids=32, tmp_mb=20)
    first = run(db, "true", limits=lim)
    api = get_client().api
    ex = api.exec_create(first.container, ["sh", "-c", "touch /tmp/root-file"], user="0:0")
    api.exec_start(ex["Id"])
    r = run(db, "ls /tmp", limits=lim)
    assert r.container == first.container and r.result.stdout == "root-file\n" and not r.clean
    assert run(db, "ls -A /tmp", limits=lim).container != first.container
    deadline = time.monotonic() + 20
    while api.containers(all=True, filters={"id": first.container}) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not api.containers(all=True, filters={"id": first.container})


def test_dead_agent_is_an_infra_error_and_replaced(db):
    lim = Limits(memory_mb=128, cpu_seconds=10, pids=32, tmp_mb=22)
    first = run(db, "true", limits=lim)
    get_client().api.kill(first.container)
    with pytest.raises(ContainerUnusable):
        run(db, "true", limits=lim)
    r = run(db, "echo alive", limits=lim)
    assert r.result.stdout == "alive\n" and r.container != first.container


# -- the pool: concurrency, and no API call in the steady state -------------------------


def test_concurrent_runs_and_zero_api_calls_in_steady_state(db):
    lim = Limits(memory_mb=128, cpu_seconds=10, pids=32, tmp_mb=26)
    pool = db.get_agent_pool(DEFAULT_IMAGE, lim, 1.0, 3, None)

    def one(i: int) -> str:
        r = db.run_isolated(
            [("mine", str(i).encode())], argv=["/bin/sh", "-c", "ls -A; cat mine"], timeout=10, limits=lim, warm_pool=3
        )
        assert r.result.stdout == f"mine\n{i}" and r.clean, r.result
        return r.container

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.monotonic() + 30
    while (len(pool.idle) < 3 or pool.pending) and time.monotonic() < deadline:
        time.sleep(0.1)

    calls = []
    real = pool.api

    class Counting:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real, name)

    pool.api = Counting()
    try:
        seen = set()
        for i in range(12):
            seen.add(one(i))
    finally:
        pool.api = real
    assert calls == [] and len(seen) <= 3, (calls, seen)


# -- the code verifier through the agent ---------------------------------------------------


def docker_score(text: str, hidden: dict | None = None, **params):
    from test_code_verifier import HIDDEN_ADD, traj

    from verifier_workers.verifiers.code import verify_code

    hidden = hidden or HIDDEN_ADD
    return verify_code(traj(text, hidden["entry_point"], **params), hidden, backend="docker")


@pytest.mark.parametrize("pid", ["HumanEval/0", "HumanEval/38", "HumanEval/32", "HumanEval/162"])
def test_code_canonical_pass_and_mutated_fail(db, pid):
    p = he.get(pid)
    v = docker_score(p.prompt + p.canonical_solution, p.hidden)
    assert (v.reward, v.status) == (1.0, "ok") and "backend=docker/docker" in v.details, v.details
    v = docker_score(p.prompt + "    return None\n", p.hidden)
    assert (v.reward, v.status) == (0.0, "ok"), v.details


def _tamper_names():
    from test_code_verifier import TAMPER

    return sorted(TAMPER)


@pytest.mark.parametrize("name", _tamper_names())
def test_code_tamper_attempts_score_zero(db, name):
    from test_code_verifier import TAMPER

    v = docker_score(TAMPER[name])
    assert (v.reward, v.status) == (0.0, "tamper"), v.details


def test_code_tamper_with_a_correct_answer_and_loops(db):
    from test_code_verifier import GOOD_ADD

    for pre in (
        "import sys\nsys.exit = lambda *a: None\n",
        "import atexit, os\natexit.register(lambda: os._exit(0))\n",
    ):
        v = docker_score(pre + GOOD_ADD)
        assert (v.reward, v.status) == (0.0, "tamper"), v.details
    # a daemon that rewrites tests.py after the harness is gone is dead before the check
    v = docker_score("def add(a, b):\n    print('computing')\n    return a + b\n")
    assert (v.reward, v.status) == (1.0, "ok") and "computing" in v.details
    t0 = time.monotonic()
    v = docker_score("def add(a, b):\n    while True:\n        pass\n", timeout_s=1)
    assert (v.reward, v.status) == (0.0, "timeout") and time.monotonic() - t0 < 8, v.details


def test_harness_supervisor_is_non_dumpable_in_the_agent(db):
    """The supervisor runs as 65534 after a setuid: non-dumpable without importing ctypes."""
    import hashlib
    import marshal

    from test_code_verifier import ADD, GOOD_ADD

    from verifier_workers.harness_programs import code_harness
    from verifier_workers.verifiers.code import counted_tests

    job = marshal.dumps({"nonce": "ab" * 32, "entry_point": "add", "prompt": "", "timeout_s": 5.0}, 4)
    tests = counted_tests(ADD).encode()
    r = db.run_isolated(
        [
            ("candidate.py", GOOD_ADD.encode()),
            ("tests.py", tests),
            ("job.marshal", job),
            ("harness.py", code_harness()),
        ],
        python="harness.py",
        timeout=10,
        limits=Limits(memory_mb=256, cpu_seconds=12, pids=32),
        report=("tests.py", "job.marshal"),
    )
    assert "'nondumpable': True" in r.result.stdout and "RLBUS-PASS " in r.result.stdout, r.result
    assert f"'tests_sha256_before': '{hashlib.sha256(tests).hexdigest()}'" in r.result.stdout
    assert r.exists == frozenset() and r.clean


def test_agent_container_privileges(db):
    """uid 0 with only SETUID/SETGID/KILL; the rest of the isolation as for exec containers."""
    kw = db.agent_container_kwargs(DEFAULT_IMAGE, LIM, 1.0)
    hc = kw["host_config"]
    assert kw["user"] == "0:0" and kw["stdin_open"] and not kw["tty"] and kw["network_disabled"]
    assert hc["cap_drop"] == ["ALL"] and sorted(hc["cap_add"]) == ["KILL", "SETGID", "SETUID"]
    assert hc["security_opt"] == ["no-new-privileges"] and hc["read_only"] and hc["network_mode"] == "none"
    assert hc["pids_limit"] == LIM.pids + db.AGENT_PID_HEADROOM and hc["init"] and hc["ipc_mode"] == "none"
    assert {u["Name"] for u in hc["ulimits"]} == {"nofile", "fsize", "core"}
    # init and the agent: KILL (5), SETGID (6), SETUID (7) and nothing else; the command: none
    r = run(db, "for p in /proc/[0-9]*; do echo $(grep -E '^(Uid|CapPrm|CapBnd|NoNewPrivs)' $p/status); done | sort")
    lines = [" ".join(line.split()) for line in r.result.stdout.splitlines()]
    root = "Uid: 0 0 0 0 CapPrm: 00000000000000e0 CapBnd: 00000000000000e0 NoNewPrivs: 1"
    user = "Uid: 65534 65534 65534 65534 CapPrm: 0000000000000000 CapBnd: 00000000000000e0 NoNewPrivs: 1"
    assert lines.count(root) == 2 and set(lines) == {root, user}, r.result  # (the pipeline: several 65534s)
