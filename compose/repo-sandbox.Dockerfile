# The sandbox image of repository tasks (default tag rlbus-repo-sandbox:latest), used by the
# `repo` verifier (verifier_workers/verifiers/repo.py). Build it with:
#   rlbus sandbox build-image --repo
#
# Builds offline: FROM a base image already on the engine (no pull), RUN steps without
# network. The build context holds this Dockerfile and `wheelhouse/`: wheels fetched on the
# host at build time (`pip download ... --only-binary :all: --python-version 3.11`, the
# package registry the only network). pytest and its dependencies are installed from it;
# the wheelhouse stays at /opt/wheelhouse so a task's `deps` install with --no-index.
FROM python:3.11-slim

COPY wheelhouse/ /opt/wheelhouse/
RUN set -eu; \
    python3 -m pip install --no-index --find-links /opt/wheelhouse --no-cache-dir \
        --disable-pip-version-check -q pytest; \
    python3 -c "import pytest, sys; print('pytest', pytest.__version__, 'python', sys.version.split()[0])"; \
    for tool in sh cat python3; do \
        command -v "$tool" >/dev/null || { echo "repo sandbox image: missing tool: $tool" >&2; exit 1; }; \
    done; \
    python3 -m compileall -q -j 0 "$(python3 -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')" \
        "$(python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null || true; \
    chmod -R a+rX /opt/wheelhouse; mkdir -p /work

ENV LANG=C.UTF-8 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/work \
    TMPDIR=/tmp

WORKDIR /work
# The repo verifier's execs run as uid 0 with only SETUID/SETGID/KILL (its supervisor) and drop
# the test run to 65534; see sandbox_workers/docker_fresh.py and verifier_workers/repo_harness.py.
USER 65534:65534
CMD ["sleep", "infinity"]
