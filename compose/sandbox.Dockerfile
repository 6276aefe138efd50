# The rlbus sandbox image (default tag rlbus-sandbox:latest), used by the `docker`
# sandbox backend. Build it with:  rlbus sandbox build-image
#
# Builds offline: FROM a base image already on the engine (no pull), and no RUN step
# downloads anything (the build runs with network_mode=none). It only checks that the
# tools the backend's wrapper scripts use are there, byte-compiles the standard
# library (the sandbox root is read-only, so Python could not cache .pyc files at run
# time and every `python3` start would recompile), and prepares /work.
FROM python:3.11-slim

RUN set -eu; \
    for tool in sh timeout kill realpath stat mkdir cat rm chmod ipcrm sleep python3; do \
        command -v "$tool" >/dev/null || { echo "sandbox image: missing tool: $tool" >&2; exit 1; }; \
    done; \
    python3 -m compileall -q -j 0 "$(python3 -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')" >/dev/null || true; \
    mkdir -p /work; chown 65534:65534 /work; chmod 0700 /work

ENV LANG=C.UTF-8 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/work \
    TMPDIR=/tmp

WORKDIR /work
# Commands run as 65534 (nobody); the backend runs init + `sleep infinity` as 65532, or,
# for one-shot runs (the code verifier), init + its resident agent as 0 with only
# SETUID/SETGID/KILL (`python3 -I -S -c <sandbox_workers/docker_agent.py>`: the agent's
# source travels in the container's command, so this image needs no project code).
USER 65534:65534
CMD ["sleep", "infinity"]
