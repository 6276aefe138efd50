"""TLS to NATS: test certificates from the `openssl` CLI, a real nats-server with TLS
(server-only and mutual), and our `connect` with the CA (and client cert) from arguments,
the environment, or the run config's `run.nats_tls_*` fields."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import nats
import pytest

from bus.auth import random_passwords, security_options, server_auth_config, tls_context
from bus.conn import connect
from bus.server import EmbeddedNats, tls_block
from schemas.config import RunConfig

pytestmark = pytest.mark.skipif(
    shutil.which("openssl") is None, reason="needs the openssl CLI to make test certificates"
)


def _ssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A test CA, a server cert for 127.0.0.1/localhost and a client cert, all signed by the CA."""
    d = tmp_path_factory.mktemp("certs")
    _ssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=rlbus test CA",
        cwd=d,
    )
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for who in ("server", "client"):
        _ssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{who}.key",
            "-out",
            f"{who}.csr",
            "-subj",
            f"/CN=rlbus-{who}",
            cwd=d,
        )
        _ssl(
            "x509",
            "-req",
            "-in",
            f"{who}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{who}.pem",
            "-days",
            "2",
            "-extfile",
            f"{who}.ext",
            cwd=d,
        )
    return d


async def roundtrip(nc) -> bytes:
    sub = await nc.subscribe("tls.check")
    await nc.publish("tls.check", b"over tls")
    msg = await sub.next_msg(timeout=5)
    return msg.data


async def test_server_tls_with_ca_from_args_env_and_config(tmp_path, certs, monkeypatch):
    conf = tls_block(str(certs / "server.pem"), str(certs / "server.key"))
    with EmbeddedNats(tmp_path, config=conf, tls=True) as server:
        assert server.url.startswith("tls://")
        nc = await connect(server.url, name="tls-args", tls_ca=str(certs / "ca.pem"))
        assert await roundtrip(nc) == b"over tls"
        await nc.close()
        monkeypatch.setenv("RLBUS_NATS_TLS_CA", str(certs / "ca.pem"))
        nc = await connect(server.url, name="tls-env")
        assert await roundtrip(nc) == b"over tls"
        await nc.close()
        monkeypatch.delenv("RLBUS_NATS_TLS_CA")
        cfg = RunConfig()
        cfg.run.nats_tls_ca = str(certs / "ca.pem")
        nc = await connect(server.url, name="tls-config", **security_options(cfg.run))
        assert nc.is_connected and await roundtrip(nc) == b"over tls"
        await nc.close()


async def test_mutual_tls_with_auth_refuses_a_client_without_certificate(tmp_path, certs):
    passwords = random_passwords()
    conf = tls_block(
        str(certs / "server.pem"), str(certs / "server.key"), ca_file=str(certs / "ca.pem"), verify_clients=True
    ) + server_auth_config(["tlsrun"], passwords)
    with EmbeddedNats(tmp_path, config=conf, tls=True) as server:
        nc = await connect(
            server.url,
            name="mtls",
            user="admin",
            password=passwords["admin"],
            tls_ca=str(certs / "ca.pem"),
            tls_cert=str(certs / "client.pem"),
            tls_key=str(certs / "client.key"),
        )
        assert await roundtrip(nc) == b"over tls"
        await nc.close()
        for kwargs in (
            {"password": passwords["admin"], "tls": tls_context(str(certs / "ca.pem"))},  # no client cert
            {
                "password": "wrong",
                "tls": tls_context(str(certs / "ca.pem"), str(certs / "client.pem"), str(certs / "client.key")),
            },
        ):
            with pytest.raises(Exception):
                await nats.connect(
                    server.url,
                    user="admin",
                    connect_timeout=2,
                    max_reconnect_attempts=0,
                    allow_reconnect=False,
                    **kwargs,
                )
