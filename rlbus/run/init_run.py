"""A run without the local launcher: the one-shot `init` and what the container entry needs.

`rlbus up` prepares a run and supervises its workers on one machine. When the roles run
as containers (compose/docker-compose.yml) or on several hosts, this module does the
launcher's preparation once (`rlbus init`, or `python -m rlbus.entrypoint init`), and gives
the container entry point (`rlbus.entrypoint`: `init`, `health ROLE`, or a role) the run's
settings, the health probe and each role's `rlbus worker` arguments.

Settings come from the environment (what compose sets): RLBUS_CONFIG (TOML),
RLBUS_SET (whitespace-separated `key=value` overrides), RLBUS_RUN_ID, RLBUS_RUN_DIR,
NATS_URL, and the NATS login: RLBUS_NATS_USER / RLBUS_NATS_PASSWORD (or _FILE, or
RLBUS_NATS_CREDS), read by `bus.conn.connect`; the older NATS_USER / NATS_PASSWORD are
still put into the URL when it has no credentials.

Guarantees:
- `init_run` leaves `<run_dir>/<run_id>/config.json` (the resolved config with the
  overrides, run id and run dir), `<run>/model/start` (tiny model built and
  warm-started per the config, or `model.path` copied) and the tool-integrity secret.
  It is idempotent: an existing `model/start` is kept, so re-running init (a restarted
  stack) continues the same run. The model appears atomically: it is prepared in a
  temporary folder and renamed, so a killed init never leaves a half-written start.
- With a server URL, init also creates the run's streams and buckets (idempotently),
  so every worker finds them.
- No credential lands in `config.json` or a worker's argv (issue 27): URL passwords are
  redacted there (`schemas.redact`); the worker gets the NATS URL in env `RLBUS_NATS_URL`
  and the run store's from `RLBUS_DB_URL`.
- A role's worker reads `<run>/config.json` when it exists (one source of truth for all
  containers), else RLBUS_CONFIG with RLBUS_SET.
- `heartbeat_seen` (the container's `health ROLE`) is true only when a worker of ROLE in this container (same host name) has
  sent a telemetry heartbeat within the last few seconds: the process is alive and
  connected to NATS.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import sys
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from bus.subjects import Registry
from rlbus.run.folder import RunFolder

DEFAULT_CONFIG = "examples/demo.toml"


def env_settings(env=os.environ) -> dict:
    """The run's settings from the environment, with defaults."""
    return {
        "config": env.get("RLBUS_CONFIG") or DEFAULT_CONFIG,
        "overrides": shlex.split(env.get("RLBUS_SET", "")),
        "run_id": env.get("RLBUS_RUN_ID") or "demo",
        "run_dir": env.get("RLBUS_RUN_DIR") or "runs",
        "nats_url": nats_url_with_auth(
            env.get("NATS_URL") or "nats://127.0.0.1:4222", env.get("NATS_USER", ""), env.get("NATS_PASSWORD", "")
        ),
    }


def nats_url_with_auth(url: str, user: str = "", password: str = "") -> str:
    """`url` with `user:password@` added to each comma-separated server that has no credentials."""
    if not user:
        return url
    out = []
    for one in url.split(","):
        parts = urlsplit(one.strip())
        if "@" not in parts.netloc:
            cred = quote(user, safe="") + (":" + quote(password, safe="") if password else "")
            parts = parts._replace(netloc=f"{cred}@{parts.netloc}")
        out.append(urlunsplit(parts))
    return ",".join(out)


def run_folder_of(settings: dict) -> RunFolder:
    """The folder `<run_dir>/<run_id>` of the run the settings name."""
    return RunFolder.of(settings["run_dir"], settings["run_id"])


def init_run(
    config: str, overrides: list[str], run_id: str, run_dir: str, nats_url: str | None = None, out=print
) -> Path:
    """Prepare the run folder (config.json, model/start, secret) and, with a URL, the run's topology."""
    from rich.console import Console

    from rlbus.run.prepare import prepare_model, write_redacted_config
    from schemas.config import load_config

    cfg = load_config(config, overrides)
    cfg.run.run_id, cfg.run.run_dir = run_id, str(run_dir)  # the server URL stays out: it may hold credentials
    folder = RunFolder.of(run_dir, run_id)
    run_path = folder.path
    run_path.mkdir(parents=True, exist_ok=True)
    tmp = folder.config_json.with_name(folder.config_json.name + ".tmp")
    write_redacted_config(cfg, tmp)  # a db_url's password never lands in the run folder
    os.replace(tmp, folder.config_json)
    out(
        f"init: run {run_id} config written to {folder.config_json} (from {config}"
        + (f" with {' '.join(overrides)})" if overrides else ")")
    )
    start = folder.start_model
    if start.exists():
        out(f"init: {start} exists; keeping it (the run continues)")
    else:
        staging = RunFolder(run_path / ".init-staging")
        shutil.rmtree(staging.path, ignore_errors=True)
        prepared = prepare_model(cfg, staging.path, Console(stderr=False))
        folder.model.mkdir(exist_ok=True)
        if staging.base_model.exists() and not folder.base_model.exists():
            os.replace(staging.base_model, folder.base_model)
        os.replace(prepared, start)
        shutil.rmtree(staging.path, ignore_errors=True)
        out(f"init: model ready at {start}")
    from sandbox_workers.integrity import load_or_create_secret

    load_or_create_secret(run_path)  # before any worker: the sandbox side and verifiers share it
    if nats_url:
        asyncio.run(_ensure_topology(nats_url, run_id))
        out(f"init: streams and buckets of run {run_id} ready on the server")
    return run_path


TOPOLOGY_WAIT_S = 90.0  # a fresh cluster answers before JetStream has elected its meta leader


async def _ensure_topology(nats_url: str, run_id: str, wait_s: float = TOPOLOGY_WAIT_S) -> None:
    """Create the run's topology, retrying (bounded by `wait_s`) while JetStream is still
    unavailable or times out, as it does on a cluster whose meta leader is not elected yet;
    any other error, or the same one past the bound, propagates."""
    import nats.errors
    from nats.js.errors import ServiceUnavailableError

    from bus.conn import connect, ensure_topology
    from bus.subjects import Registry

    nc = await connect(nats_url, name="rlbus-init")
    deadline = asyncio.get_running_loop().time() + wait_s
    try:
        while True:
            try:
                await ensure_topology(nc.jetstream(timeout=30), Registry(run_id))
                return
            except (ServiceUnavailableError, nats.errors.TimeoutError) as exc:
                if asyncio.get_running_loop().time() >= deadline:
                    raise
                print(f"init: JetStream not ready yet ({type(exc).__name__}); retrying", file=sys.stderr)
                await asyncio.sleep(2.0)
    finally:
        await nc.close()


async def heartbeat_seen(nats_url: str, run_id: str, role: str, host: str, timeout: float = 5.0) -> bool:
    """True when a `metrics.<run>.<role>.*` heartbeat from `host` arrives within `timeout`."""
    from bus.conn import connect
    from bus.telemetry import Heartbeats

    # the one connect helper: the role's own NATS user (RLBUS_NATS_USER/PASSWORD) may
    # subscribe to its role's heartbeats (only those: not `metrics.<run>.>`); one try, no reconnects
    nc = await connect(
        nats_url, name="rlbus-health", connect_timeout=3, max_reconnect_attempts=0, allow_reconnect=False
    )
    beats = Heartbeats(run_id)
    try:
        await nc.subscribe(Registry(run_id).metrics(role), cb=beats.on_msg)
        return await beats.wait_for(lambda m: m.role == role and m.host == host, timeout)
    finally:
        await nc.close()


def worker_argv(role: str, settings: dict, extra: list[str]) -> list[str]:
    """`rlbus worker ROLE ...` arguments for this run."""
    config_json = run_folder_of(settings).config_json
    # the URL (it may hold NATS_USER/NATS_PASSWORD) goes by env RLBUS_NATS_URL (see `main`), never argv
    argv = ["worker", role, "--run-id", settings["run_id"], "--run-dir", settings["run_dir"]]
    if config_json.exists():
        argv += ["--config", str(config_json)]
    else:
        argv += ["--config", settings["config"]] + [f"--set={o}" for o in settings["overrides"]]
    return argv + list(extra)
