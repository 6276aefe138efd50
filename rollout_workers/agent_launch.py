"""The in-sandbox launcher of an agent harness (stdlib only; run by the sandbox's `python3`).

    python3 agent_launch.py --sock /run/rlbus-endpoint.sock -- CMD ...   # bwrap: no network
    python3 agent_launch.py --url http://127.0.0.1:PORT/v1 -- CMD ...     # host processes

Guarantees:
- `--sock`: a relay listens on 127.0.0.1 (an ephemeral port of the sandbox's own network
  namespace, which nothing else shares) and copies bytes both ways to the endpoint's Unix
  socket, bound into the sandbox; `OPENAI_BASE_URL` points at it. `--url`: used as given.
- The harness is CMD with the launcher's environment plus `OPENAI_BASE_URL`; its stdout and
  stderr are the launcher's. The launcher exits with the harness's status (128 + signal when
  a signal ended it).
- A harness that cannot be started (no such file, not executable) makes the launcher print
  `NOT_STARTED` and the reason on stderr and exit with `NOT_STARTED_CODE`: an infrastructure
  error for the rollout worker, never the policy's outcome.
"""

from __future__ import annotations

import asyncio
import os
import sys

NOT_STARTED = "rlbus-agent: the harness could not start:"
NOT_STARTED_CODE = 125


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            writer.close()
        except OSError:
            pass


def _relay(sock: str):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(sock)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    return handle


async def main(argv: list[str]) -> int:
    if "--" not in argv or len(argv) < 4 or argv[0] not in ("--sock", "--url"):
        print("usage: agent_launch.py --sock PATH | --url URL -- CMD ...", file=sys.stderr)
        return 2
    mode, where, cmd = argv[0], argv[1], argv[argv.index("--") + 1 :]
    env = dict(os.environ)
    server = None
    if mode == "--sock":
        server = await asyncio.start_server(_relay(where), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        env["OPENAI_BASE_URL"] = f"http://127.0.0.1:{port}/v1"
    else:
        env["OPENAI_BASE_URL"] = where
    try:
        proc = await asyncio.create_subprocess_exec(*cmd, env=env)
    except OSError as exc:
        print(f"{NOT_STARTED} {cmd[0]!r}: {exc}", file=sys.stderr, flush=True)
        return NOT_STARTED_CODE
    rc = await proc.wait()
    if server is not None:
        server.close()
    return 128 - rc if rc < 0 else rc


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
