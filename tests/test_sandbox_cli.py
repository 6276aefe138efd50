"""`rlbus sandbox exec|build-image|reap` as a real `rlbus` process.

The process-backend tests need bubblewrap (skipped with the reason where it cannot
create namespaces); the docker ones are marked `docker` and skipped without an engine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox_workers.factory import docker_available
from sandbox_workers.process import ProcessSandbox

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {"exit_code", "stdout", "stderr", "timed_out", "oom", "truncated", "duration_ms", "isolation"}


def _bwrap_ok() -> bool:
    sbx = ProcessSandbox(isolation="auto", allow_degraded=True)  # only to learn which one we get
    try:
        sbx.start()
        return sbx.isolation == "bwrap"
    finally:
        sbx.close()


needs_bwrap = pytest.mark.skipif(
    not _bwrap_ok(), reason="bwrap missing or cannot create namespaces (apt-get install -y bubblewrap)"
)
needs_docker = pytest.mark.skipif(
    not docker_available(), reason="no Docker engine answers (start dockerd, or set DOCKER_HOST)"
)


def rlbus(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlbus.cli", "sandbox", *args],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_json_line(p: subprocess.CompletedProcess) -> dict:
    lines = p.stdout.splitlines()
    assert p.returncode == 0 and len(lines) == 1, (p.returncode, p.stdout, p.stderr)
    row = json.loads(lines[0])
    assert set(row) == FIELDS
    return row


@needs_bwrap
def test_exec_process_backend():
    row = one_json_line(rlbus("exec", "--", "python3", "-c", "import sys; print(6 * 7); sys.exit(3)"))
    assert row["exit_code"] == 3 and row["stdout"] == "42\n" and row["isolation"] == "bwrap"
    assert not (row["timed_out"] or row["oom"] or row["truncated"])


@needs_bwrap
def test_exec_process_backend_limits():
    row = one_json_line(
        rlbus("exec", "--backend", "process", "--timeout", "1", "--", "sh", "-c", "while :; do :; done")
    )
    assert row["timed_out"] and row["exit_code"] == 137
    row = one_json_line(rlbus("exec", "--memory-mb", "64", "--", "python3", "-c", "b = bytearray(1 << 30)"))
    assert row["exit_code"] != 0 and row["oom"]


def test_exec_needs_a_command_and_help_has_examples():
    p = rlbus("exec")
    assert p.returncode == 2 and "after `--`" in p.stderr and p.stdout == ""
    p = rlbus("exec", "--help")
    assert p.returncode == 0 and "examples:" in p.stdout and "--backend docker" in p.stdout


@pytest.mark.docker
@needs_docker
def test_exec_docker_backend_leaves_nothing():
    from sandbox_workers import images
    from sandbox_workers.docker_engine import LABEL, get_client

    images.ensure_image()
    api = get_client().api
    before = {c["Id"] for c in api.containers(all=True, filters={"label": f"{LABEL}=1"})}
    row = one_json_line(
        rlbus(
            "exec", "--backend", "docker", "--timeout", "5", "--", "sh", "-c", "id -u; (setsid sleep 300 &); echo done"
        )
    )
    assert row["isolation"] == "docker" and row["exit_code"] == 0
    assert row["stdout"].split() == ["65534", "done"]
    after = {c["Id"] for c in api.containers(all=True, filters={"label": f"{LABEL}=1"})}
    assert after <= before, "the one-shot exec left a container"
    row = one_json_line(
        rlbus("exec", "--backend", "docker", "--timeout", "1", "--", "python3", "-c", "while True: pass")
    )
    assert row["timed_out"] and row["exit_code"] == 137


@pytest.mark.docker
@needs_docker
def test_build_image_and_missing_image():
    p = rlbus("build-image", timeout=300)
    assert p.returncode == 0 and p.stdout.startswith("built rlbus-sandbox:latest"), p.stderr
    p = rlbus("exec", "--backend", "docker", "--image", "rlbus-nope:1", "--", "true")
    assert p.returncode == 1 and p.stdout == ""
    assert "rlbus sandbox build-image --tag rlbus-nope:1" in p.stderr


def _build_args(message: str) -> argparse.Namespace:
    """The `rlbus sandbox build-image ...` command a missing-image message names, parsed by the real parser."""
    from sandbox_workers.cli import register

    command = message.split("build it with: ", 1)[1].split()
    assert command[:3] == ["rlbus", "sandbox", "build-image"], message
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(command[1:])


def test_missing_plain_image_names_the_plain_build_command():
    from sandbox_workers.docker_pool import DEFAULT_IMAGE, missing_image_message

    message = missing_image_message(DEFAULT_IMAGE)
    assert message.endswith("build it with: rlbus sandbox build-image"), message
    args = _build_args(message)
    assert not args.repo and args.tag is None  # builds rlbus-sandbox:latest from sandbox.Dockerfile


def test_missing_repo_image_names_build_image_repo():
    from sandbox_workers.docker_pool import missing_image_message
    from sandbox_workers.repo_image import REPO_TAG

    message = missing_image_message(REPO_TAG)
    assert message.endswith("build it with: rlbus sandbox build-image --repo"), message
    args = _build_args(message)
    assert args.repo and args.tag is None  # builds rlbus-repo-sandbox:latest from repo-sandbox.Dockerfile
