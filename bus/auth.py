"""NATS users and subject permissions of every rlbus role, and client credentials.

One function, `server_auth_config`, renders the `authorization { users = [...] }` block
that tests, `rlbus up` and `compose/` all give to nats-server, so the permission matrix
lives in exactly one place (`role_permissions`). The client side (`client_options`)
reads credentials and TLS settings from explicit arguments, then the environment.

Guarantees:
- Every role user gets allow lists only (publish and subscribe); nothing is allowed by
  default. Each user replies on its own inbox prefix `_INBOX_<user>` (`connect` sets it),
  so no role can subscribe to another role's request replies (e.g. the verifier's reads
  of hidden data).
- The policy side (`rollout`, and `monitor`) gets no subject of the hidden bucket: not
  `$KV.hidden-<run>.>`, not any `$JS.API.*` request naming stream `KV_hidden-<run>`,
  not the sandbox subjects' traffic of other clients (they carry verifier tests).
- Permissions are per run: NATS wildcards match whole tokens only, so `KV_hidden-*`
  can not be expressed; a run id must be listed to be reachable at all (a run not
  listed is denied, never open). Add a run by regenerating the config and reloading
  the server (`nats-server --signal reload`).
- `ROLE_TOPOLOGY` says which streams/buckets each role creates when missing; it drives
  both `bus.conn.ensure_topology(..., role=...)` and the CREATE rights granted here.
- Secrets are never written by this module except where asked (`write_env`), with mode 0600.
"""

from __future__ import annotations

import os
import secrets
import ssl
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from bus.roles import ROLES
from bus.subjects import Registry

MONITOR = "monitor"
ADMIN = "admin"
USERS = tuple(r.nats_user for r in ROLES) + (MONITOR, ADMIN)
"""Every NATS user rlbus knows: one per role (`bus.roles`), a read-only `monitor`, and `admin` (launcher, ops)."""

ENV_USER, ENV_PASSWORD, ENV_PASSWORD_FILE = "RLBUS_NATS_USER", "RLBUS_NATS_PASSWORD", "RLBUS_NATS_PASSWORD_FILE"
ENV_CREDS = "RLBUS_NATS_CREDS"
"""A NATS `.creds` file (user JWT + nkey seed, decentralized/operator auth); `rlbus --nats-creds FILE` sets it."""
ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY = "RLBUS_NATS_TLS_CA", "RLBUS_NATS_TLS_CERT", "RLBUS_NATS_TLS_KEY"

ROLE_TOPOLOGY: dict[str, tuple[str, ...]] = {r.name: r.creates for r in ROLES}
"""role -> the families it creates when missing (KV_/OBJ_ entries are buckets; `bus.roles.Role.creates`)."""


def inbox_prefix(user: str) -> str:
    """The reply-subject prefix of `user` (its only `_INBOX` subscribe right)."""
    return f"_INBOX_{user}"


def stream_name(reg: Registry, family: str) -> str:
    """Stream name of a ROLE_TOPOLOGY family (streams, `KV_run`, `KV_hidden`, `KV_toolrec`, `OBJ_weights`,
    `OBJ_workspaces`, `OBJ_artifacts`)."""
    return {
        "KV_run": f"KV_{reg.kv_bucket}",
        "KV_hidden": f"KV_{reg.hidden_bucket}",
        "KV_toolrec": f"KV_{reg.toolrec_bucket}",
        "OBJ_weights": f"OBJ_{reg.object_bucket}",
        "OBJ_workspaces": f"OBJ_{reg.workspace_bucket}",
        "OBJ_artifacts": f"OBJ_{reg.artifact_bucket}",
    }.get(family) or reg.stream(family)


# -- permission building blocks (JetStream API subjects as nats-py uses them) ----------
API = "$JS.API"


def _api(op: str, stream: str) -> list[str]:
    return [f"{API}.{op}.{stream}", f"{API}.{op}.{stream}.>"]


def js_info(stream: str) -> list[str]:
    """Look a stream up (`stream_info`, binding a KV/object bucket)."""
    return [f"{API}.STREAM.INFO.{stream}"]


def js_create(stream: str) -> list[str]:
    """Create a missing stream or bucket (topology)."""
    return [f"{API}.STREAM.CREATE.{stream}"]


def js_read(stream: str) -> list[str]:
    """Read stored messages by sequence or subject (KV get, object meta, `iter_stream`)."""
    return js_info(stream) + [f"{API}.STREAM.MSG.GET.{stream}", *_api("DIRECT.GET", stream)]


def js_consume(stream: str) -> list[str]:
    """Create/bind/fetch/ack/delete consumers on a stream (durable pull and ordered push)."""
    subs = js_read(stream)
    for op in ("CONSUMER.CREATE", "CONSUMER.DURABLE.CREATE", "CONSUMER.INFO", "CONSUMER.MSG.NEXT", "CONSUMER.DELETE"):
        subs += _api(op, stream)
    return subs + [f"$JS.ACK.{stream}.>"]


def js_own_consumer(stream: str, durable: str) -> list[str]:
    """Create/bind/fetch/ack/delete ONE named durable on a stream (and nothing of other readers)."""
    subs = [
        f"{API}.CONSUMER.CREATE.{stream}.{durable}",
        f"{API}.CONSUMER.CREATE.{stream}.{durable}.>",
        f"{API}.CONSUMER.DURABLE.CREATE.{stream}.{durable}",
    ]
    subs += [f"{API}.CONSUMER.{op}.{stream}.{durable}" for op in ("INFO", "MSG.NEXT", "DELETE")]
    return subs + [f"$JS.ACK.{stream}.{durable}.>"]


def _tracker_rights(reg: Registry) -> list[str]:
    """The tracker's publish rights: its own durables, stream/consumer info, KV reads; no data subject."""
    from bus.kv import CURRICULUM

    pub: list[str] = []
    for feed in ("weights", "rewards", "eval"):
        pub += js_own_consumer(reg.stream(feed), reg.tracker_consumer(feed).durable) + js_info(reg.stream(feed))
    pub += js_own_consumer(reg.kv_stream, reg.tracker_consumer("kv", CURRICULUM).durable) + js_read(reg.kv_stream)
    for fam in ("TASKS", "TRAJ", "DLQ"):  # queue depths and dead letters (stream state only)
        pub += js_info(reg.stream(fam))
    return pub + [f"{API}.CONSUMER.INFO.{reg.stream('REWARDS')}.{reg.learner_consumer().durable}"]


def _perm(
    pub: Iterable[str],
    sub: Iterable[str],
    *,
    pub_deny: Iterable[str] = (),
    sub_deny: Iterable[str] = (),
    responses: bool = False,
) -> dict:
    out: dict = {"publish": {"allow": sorted(set(pub))}, "subscribe": {"allow": sorted(set(sub))}}
    if pub_deny:
        out["publish"]["deny"] = sorted(set(pub_deny))
    if sub_deny:
        out["subscribe"]["deny"] = sorted(set(sub_deny))
    if responses:
        out["allow_responses"] = True
    return out


def _run_rights(role: str, reg: Registry) -> tuple[list[str], list[str]]:
    """(publish, subscribe) rights of `role` on one run."""
    s = lambda fam: stream_name(reg, fam)
    r = reg.run_id
    # STREAM.NAMES: js.subscribe() without a stream looks it up by subject (names only, no data)
    pub = [f"metrics.{r}.{role}.*", f"dlq.{r}.>", f"{API}.STREAM.NAMES"]
    # its own role's heartbeats: the container healthcheck (`rlbus-entrypoint health ROLE`)
    # listens for this container's worker on them, connected as the role's user
    sub: list[str] = [f"metrics.{r}.{role}.*"] if role != MONITOR else []
    for fam in ROLE_TOPOLOGY.get(role, ()):
        pub += js_info(s(fam)) + js_create(s(fam))
    kv_run, kv_hidden, kv_rec, obj = s("KV_run"), s("KV_hidden"), s("KV_toolrec"), s("OBJ_weights")
    # public payloads by reference (bus.payloads): put = chunk + meta publishes (no purge) after reading the
    # object back (a put checks the bytes, not the meta), get = ordered consumer. Workspaces are written
    # by the task publishers only, artifacts by rollout only; the verifier reads both.
    ws_put = [f"$O.{reg.workspace_bucket}.>"] + js_consume(s("OBJ_workspaces"))
    art_put = [f"$O.{reg.artifact_bucket}.>"] + js_consume(s("OBJ_artifacts"))
    ws_get, art_get = js_consume(s("OBJ_workspaces")), js_consume(s("OBJ_artifacts"))
    if role == "sampler":
        pub += [f"tasks.{r}.>", f"ledger.{r}.>", f"$KV.{reg.hidden_bucket}.>", f"$KV.{reg.kv_bucket}.>"]
        pub += js_read(kv_run) + js_info(kv_hidden) + js_info(s("DLQ")) + js_info(s("TASKS")) + ws_put
    elif role == "rollout":
        pub += [f"traj.{r}.>"] + js_consume(s("TASKS")) + js_consume(s("WEIGHTS")) + js_read(kv_run)
        pub += js_consume(obj) + js_info(s("TRAJ")) + ws_get + art_put
        sub += [reg.weights, reg.weights_prefetch]
    elif role == "verifier":
        pub += [f"rewards.{r}.>"] + js_consume(s("TRAJ")) + js_read(kv_hidden) + js_read(kv_rec) + js_read(kv_run)
        pub += js_info(s("REWARDS")) + ws_get + art_get
    elif role == "learner":
        pub += [
            f"weights.{r}",
            reg.weights_prefetch,
            f"ledger.{r}.>",
            f"$KV.{reg.kv_bucket}.>",
            f"$O.{reg.object_bucket}.>",
        ]
        pub += js_consume(s("REWARDS")) + js_consume(kv_run) + js_consume(obj) + js_read(s("LEDGER"))
        pub += js_info(s("WEIGHTS")) + [f"{API}.STREAM.PURGE.{obj}"]
    elif role == "scheduler":
        # tasks + hidden puts (no read): pipeline eval rounds publish purpose=eval tasks, and the
        # gold of a domain's own eval set (`eval_problems`) goes to the hidden bucket first
        pub += [f"eval.{r}.>", f"ledger.{r}.>", f"$KV.{reg.kv_bucket}.>", f"tasks.{r}.>", f"$KV.{reg.hidden_bucket}.>"]
        pub += ws_put  # the public repositories of eval tasks too large to travel inline
        for fam in (
            "TASKS",
            "TRAJ",
            "REWARDS",
            "WEIGHTS",
            "EVAL",
            "DLQ",
            "LEDGER",
            "KV_run",
            "OBJ_weights",
            "OBJ_workspaces",
            "OBJ_artifacts",
        ):
            pub += js_consume(s(fam))
        pub += [f"{API}.STREAM.MSG.DELETE.{s('DLQ')}"]
        sub += [f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{s(f)}.>" for f in ("TASKS", "TRAJ", "REWARDS")]
        sub += [f"metrics.{r}.>"]  # every worker's heartbeats: per-stage cost accounting in the run store
    elif role == "tracker":  # reads only: publishes nothing but its heartbeats (no dead letters either)
        pub = [p for p in pub if p != f"dlq.{r}.>"] + _tracker_rights(reg)
    elif role == "sandbox":
        pub += [f"$KV.{reg.toolrec_bucket}.>"] + js_info(kv_rec) + js_create(kv_rec) + js_read(kv_rec)
    elif role == MONITOR:
        pub = []
        for fam in ("TASKS", "TRAJ", "REWARDS", "WEIGHTS", "EVAL", "DLQ", "LEDGER", "KV_run"):
            pub += js_read(s(fam))
    if role in ("rollout", "verifier"):  # the sandbox service's clients
        pub += ["sandbox.*.open", "sandbox.*.s.*.*"]
    return pub, sub


def role_permissions(role: str, runs: Sequence[str]) -> dict:
    """The nats-server `permissions` map of `role` for the listed runs.

    Matrix (per run R; every role also publishes `metrics.R.<role>.*` heartbeats and
    `dlq.R.>` dead letters, and subscribes only to its own `_INBOX_<role>.>`):

    Every role but monitor/admin also subscribes to its own heartbeats `metrics.R.<role>.*`
    (the container healthcheck connects as the role's user).

    - sampler: publish `tasks.R.>`, `ledger.R.>`; write KV `hidden-R` (put only, no read)
      and KV `run-R`; read KV `run-R`; write object store `workspaces-R` (put, no purge: the
      public repositories of tasks too large to carry inline).
    - rollout: consume TASKS (durable `rollout`), publish `traj.R.>`, read WEIGHTS
      (ordered consumer) and its core-NATS prefetch hints `weights.R.prefetch`, KV `run-R`
      and object store `weights-R`; read object store `workspaces-R` (never write it), write
      (put, no purge) object store `artifacts-R` (large artifacts out); request the sandbox
      service. No hidden bucket, no `rewards.>`/`weights.>` publish, no write to `weights-R`.
    - verifier: consume TRAJ, publish `rewards.R.>`, read KV `hidden-R`, `toolrec-R`, `run-R`
      and object stores `workspaces-R` and `artifacts-R`; request the sandbox service.
      No right on object store `weights-R`.
    - learner: consume REWARDS, publish `weights.R`, `weights.R.prefetch` and `ledger.R.>`, write KV `run-R` and
      object store `weights-R`, read LEDGER. No hidden bucket.
    - scheduler: consume/read every stream of the run but the hidden and toolrec buckets,
      delete DLQ messages, publish `eval.R.>`, `ledger.R.>`, `tasks.R.>` (pipeline eval
      rounds), write KV `run-R` and KV `hidden-R` (put only, no read: the gold of eval sets a
      domain source draws) and object store `workspaces-R` (put, no purge), subscribe to
      MAX_DELIVERIES advisories and every heartbeat `metrics.R.>` (costs).
    - sandbox: serve `sandbox.>` (queue group), reply to requests (allow_responses),
      write KV `toolrec-R`.
    - tracker: its own durables only (`tracker-weights`, `tracker-rewards`, `tracker-eval`
      on WEIGHTS, REWARDS, EVAL; `tracker-kv-curriculum` on KV `run-R`), reads KV `run-R`,
      stream info of TASKS/TRAJ/DLQ and the learner durable's info (queue depths). Publishes
      no data subject, not even `dlq.R.>`. No hidden bucket.
    - monitor: subscribe to everything except hidden/toolrec KV subjects, the sandbox
      traffic and other users' inboxes; JS API info/list of every stream and consumer,
      read stored messages of the run's non-secret streams. Publishes nothing else.
    - admin: everything (launcher, `rlbus dlq replay`, operators).
    """
    if role not in USERS:
        raise ValueError(f"unknown NATS user {role!r}; one of {', '.join(USERS)}")
    if role == ADMIN:
        return _perm([">"], [">"], responses=True)
    regs = [Registry(r) for r in runs]
    pub: list[str] = []
    sub: list[str] = [f"{inbox_prefix(role)}.>"]
    for reg in regs:
        p, s = _run_rights(role, reg)
        pub += p
        sub += s
    if role == MONITOR:
        pub += [
            f"{API}.INFO",
            f"{API}.STREAM.NAMES",
            f"{API}.STREAM.LIST",
            f"{API}.STREAM.INFO.*",
            f"{API}.CONSUMER.NAMES.*",
            f"{API}.CONSUMER.LIST.*",
            f"{API}.CONSUMER.INFO.*.*",
        ]
        deny = [f"{inbox_prefix(u)}.>" for u in USERS if u != MONITOR] + ["sandbox.>", "_INBOX.>"]
        for reg in regs:
            deny += [f"$KV.{reg.hidden_bucket}.>", f"$KV.{reg.toolrec_bucket}.>"]
        return _perm(pub, [">"], sub_deny=deny)
    if role == "sandbox":
        return _perm(pub, sub + ["sandbox.>"], responses=True)
    if role in ("rollout", "scheduler", "learner", "verifier"):
        pub.append("$JS.FC.>")  # flow-control replies of ordered consumers (weights, objects)
    return _perm(pub, sub)


def _conf_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_conf_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_conf_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str) and value.startswith("$") and value[1:].isidentifier() and value[1:].isupper():
        return value  # an environment variable reference, resolved by nats-server
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def password_env(user: str) -> str:
    """Name of the environment variable that holds `user`'s password in compose (`.env`)."""
    return f"RLBUS_NATS_PASSWORD_{user.upper()}"


def server_auth_config(
    runs: Sequence[str], passwords: Mapping[str, str] | None = None, users: Sequence[str] = USERS
) -> str:
    """The nats-server config block `authorization { users = [...] }` for `runs`.

    `passwords` maps user -> password; a user without one gets `$RLBUS_NATS_PASSWORD_<USER>`,
    which nats-server reads from its environment at start (compose passes `.env`), so the
    rendered file itself holds no secret.
    """
    if not runs:
        raise ValueError("server_auth_config needs at least one run id (permissions are per run)")
    lines = ["authorization {", "  users = ["]
    for user in users:
        pw = (passwords or {}).get(user) or f"${password_env(user)}"
        perms = role_permissions(user, runs)
        lines.append(
            f"    {{user: {_conf_value(user)}, password: {_conf_value(pw)}, permissions: {_conf_value(perms)}}}"
        )
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def random_passwords(users: Sequence[str] = USERS) -> dict[str, str]:
    """A fresh random password per user: "pw" + 48 hex chars (192 bits, url- and shell-safe). The letter prefix
    matters: nats-server parses `$VAR` references as config values, and a value that starts
    with a digit (e.g. "9Wx...") is read as a malformed number and refused."""
    return {u: "pw" + secrets.token_hex(24) for u in users}


def write_env(path: str | os.PathLike, passwords: Mapping[str, str], extra: Mapping[str, str] | None = None) -> Path:
    """Write a docker-compose `.env` with one `RLBUS_NATS_PASSWORD_<USER>=...` per user (mode 0600)."""
    path = Path(path)
    body = "".join(f"{password_env(u)}={pw}\n" for u, pw in passwords.items())
    body += "".join(f"{k}={v}\n" for k, v in (extra or {}).items())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("# rlbus NATS credentials: generated, secret, never commit or bake into an image\n" + body)
    os.chmod(path, 0o600)
    return path


# -- client side -------------------------------------------------------------------------
def _env(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def client_credentials(user: str | None = None, password: str | None = None) -> tuple[str | None, str | None]:
    """(user, password): the arguments, else `RLBUS_NATS_USER` and `RLBUS_NATS_PASSWORD`
    (or the file named by `RLBUS_NATS_PASSWORD_FILE`, e.g. a docker/k8s secret)."""
    user = user or _env(ENV_USER)
    if password is None:
        password = _env(ENV_PASSWORD)
        pw_file = _env(ENV_PASSWORD_FILE)
        if password is None and pw_file:
            password = Path(pw_file).read_text().strip()
    if password and not user:
        raise ValueError(f"a NATS password is set but no user: set {ENV_USER}")
    return user, password


def client_creds_file(creds: str | os.PathLike | None = None) -> str | None:
    """The NATS `.creds` file to log in with: the argument, else `RLBUS_NATS_CREDS` (what
    `rlbus --nats-creds FILE` sets), else None. Standard NATS meaning: a user JWT and its
    nkey seed (operator/JWT deployments, `nsc generate creds`), passed to nats-py as
    `user_credentials`. It takes precedence over a user/password."""
    path = str(creds) if creds else _env(ENV_CREDS)
    if not path:
        return None
    if not Path(path).is_file():
        raise ValueError(f"NATS credentials file {path!r} does not exist (--nats-creds / {ENV_CREDS})")
    return path


def tls_context(ca: str | None = None, cert: str | None = None, key: str | None = None) -> ssl.SSLContext | None:
    """A client TLS context verifying the server against `ca` (default: `RLBUS_NATS_TLS_CA`),
    with a client certificate for mutual TLS when `cert`/`key` (or their env vars) are set.
    None when no CA is configured (plain TCP, unless the URL says `tls://`)."""
    ca, cert, key = ca or _env(ENV_TLS_CA), cert or _env(ENV_TLS_CERT), key or _env(ENV_TLS_KEY)
    if not ca and not cert:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert:
        if not key:
            raise ValueError("a TLS client certificate needs its key (RLBUS_NATS_TLS_KEY / run.nats_tls_key)")
        ctx.load_cert_chain(cert, key)
    return ctx


def security_options(run_section=None) -> dict:
    """`connect` keyword arguments from a config's `run` section (TLS file paths), if any.

    Usage: `await connect(url, name=..., **security_options(cfg.run))`."""
    if run_section is None:
        return {}
    return {k: getattr(run_section, f"nats_{k}", "") or None for k in ("tls_ca", "tls_cert", "tls_key")}


def topology_role(role: str, user: str | None = None) -> str | None:
    """`role` when this process connects as a restricted NATS user (arg, else
    `RLBUS_NATS_USER`, other than `admin`), else None: pass it to `ensure_topology` so a
    restricted worker only creates what it may, and an open/admin one keeps updating."""
    user = user or _env(ENV_USER)
    return role if user and user != ADMIN else None
