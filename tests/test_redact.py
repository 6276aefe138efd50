"""Credentials never stored or logged (issue 27): `schemas.redact` and a real `rlbus up`
against a nats-server that requires a password given in the URL.

The run test plants a password in `--nats-url nats://u:PASSWORD@127.0.0.1:PORT`, runs a
short `rlbus up` (every role its own process), reads every worker's argv from /proc while
the run is live, then greps every file of the run folder (config.json, run.json, run.db,
logs, summary) and the launcher's own output for the password: it must appear nowhere.
The run must still succeed: the workers got the password by environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bus.server import EmbeddedNats
from scheduler.store import DB_URL_ENV, resolve_url
from schemas.redact import is_redacted, redact_tree, redact_url, strip_credentials

ROOT = Path(__file__).resolve().parents[1]
PLANTED = "planted-pw-7f3a9c"

TINY = """
[run]
max_steps = 3
max_minutes = 4
drain_seconds = 4
[model]
hidden_size = 32
num_layers = 1
num_heads = 2
[sft]
max_steps = 5
seconds = 10
threads = 1
[sampler]
group_size = 4
max_tokens = 4
max_inflight_tasks = 16
[rollout]
batch_tasks = 4
[learner]
groups_per_step = 2
step_window_s = 1.0
[scheduler.eval]
n = 10
every_versions = 100
"""


@pytest.mark.parametrize(
    "url, want",
    [
        ("nats://u:secret@h:4222", "nats://u:***@h:4222"),
        ("nats://u:s1@a:1,nats://u:s2@b:2", "nats://u:***@a:1,nats://u:***@b:2"),
        ("nats://TOKEN@h:4222", "nats://***@h:4222"),
        ("postgresql://rlbus:p@ss@db:5432/rlbus", "postgresql://rlbus:***@db:5432/rlbus"),
        ("postgresql://rlbus@db/rlbus", "postgresql://rlbus@db/rlbus"),  # no password: unchanged
        ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
        ("not a url @ all", "not a url @ all"),
    ],
)
def test_redact_url(url, want):
    assert redact_url(url) == want
    assert redact_url(want) == want  # idempotent
    assert "secret" not in redact_url(url) and "s1" not in redact_url(url) and "TOKEN" not in redact_url(url)


def test_redacted_urls_are_recognised_and_stripped():
    assert is_redacted("nats://u:***@h:1") and is_redacted("nats://***@h") and not is_redacted("nats://u@h")
    assert strip_credentials("nats://u:***@a:1,nats://u:***@b:2") == "nats://a:1,nats://b:2"
    tree = {"run": {"nats_url": "nats://u:pw@h"}, "l": ["postgresql://a:pw@h/db", 3], "n": None}
    assert redact_tree(tree) == {"run": {"nats_url": "nats://u:***@h"}, "l": ["postgresql://a:***@h/db", 3], "n": None}


def test_store_takes_a_redacted_db_url_from_the_environment(tmp_path, monkeypatch):
    """config.json holds `postgresql://u:***@…`: the store logs in with $RLBUS_DB_URL, never with `***`."""
    monkeypatch.delenv(DB_URL_ENV, raising=False)
    with pytest.raises(ValueError, match=DB_URL_ENV):
        resolve_url("postgresql://u:***@127.0.0.1/test", tmp_path)
    monkeypatch.setenv(DB_URL_ENV, "postgresql://u:planted@127.0.0.1/test")
    assert resolve_url("postgresql://u:***@127.0.0.1/test", tmp_path) == "postgresql+psycopg://u:planted@127.0.0.1/test"


def test_launcher_config_and_worker_env_keep_the_db_password_out(tmp_path):
    from rlbus.run.prepare import secret_env, write_redacted_config
    from schemas.config import load_config

    cfg = load_config(
        None,
        [
            "scheduler.db_url='postgresql://rlbus:planted@127.0.0.1/test'",
            "run.nats_url='nats://u:planted@127.0.0.1:4222'",
        ],
    )
    write_redacted_config(cfg, tmp_path / "config.json")
    text = (tmp_path / "config.json").read_text()
    assert "planted" not in text and "postgresql://rlbus:***@127.0.0.1/test" in text
    assert secret_env(cfg) == {DB_URL_ENV: "postgresql://rlbus:planted@127.0.0.1/test"}


def _scan_argv(needle: str) -> list[str]:
    """Command lines of the run's workers (`rlbus.cli worker`) that contain `needle` (what `ps`
    shows anyone). The operator's own `rlbus up --nats-url ...` is theirs: not counted."""
    hits = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in argv and "rlbus.cli worker" in argv:
            hits.append(argv)
    return hits


@pytest.mark.e2e
def test_up_with_a_password_in_the_url_stores_and_logs_none(tmp_path):
    conf = 'authorization { users = [ { user: "u", password: "%s" } ] }\n' % PLANTED
    with EmbeddedNats(tmp_path / "srv", config=conf) as server:
        port = server.url.rsplit(":", 1)[1]
        url = f"nats://u:{PLANTED}@127.0.0.1:{port}"
        (tmp_path / "tiny.toml").write_text(TINY)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RLBUS_NATS", "RLBUS_DB"))}
        out = tmp_path / "launcher.out"
        with open(out, "wb") as f:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "rlbus.cli",
                    "up",
                    str(tmp_path / "tiny.toml"),
                    "--run-dir",
                    str(tmp_path / "runs"),
                    "--run-id",
                    "redact",
                    "--nats-url",
                    url,
                ],
                cwd=ROOT,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        argv_hits, workers_seen = [], 0
        try:
            deadline = time.monotonic() + 420
            while proc.poll() is None and time.monotonic() < deadline:
                argv_hits += _scan_argv(PLANTED)
                workers_seen = max(workers_seen, len(_scan_argv("rlbus.cli worker")))
                time.sleep(1.0)
            assert proc.poll() is not None, "rlbus up did not finish in 420 s"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        text = out.read_text(errors="replace")
        assert proc.returncode == 0, text[-3000:]
    run_path = tmp_path / "runs" / "redact"
    assert workers_seen >= 4, "the scan never saw the workers' command lines"
    assert argv_hits == [], argv_hits[:3]
    assert PLANTED not in text
    found = [str(p) for p in run_path.rglob("*") if p.is_file() and PLANTED.encode() in p.read_bytes()]
    assert found == [], f"the planted password is stored in {found}"
    state = json.loads((run_path / "run.json").read_text())
    assert state["nats_url"] == f"nats://u:***@127.0.0.1:{port}"
    assert json.loads((run_path / "summary.json").read_text())["steps"] >= 3
    assert any("started" in p.read_text() for p in (run_path / "logs").glob("*.log"))
