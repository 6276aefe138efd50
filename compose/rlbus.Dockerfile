# rlbus:latest: the project and its dependencies, one image for every role
# (`rlbus-entrypoint ROLE`: init, sampler, rollout, sandbox, verifier, learner, scheduler).
#
# Built offline by `make images` from compose/build/rlbus/, a context holding only the
# host-built wheelhouse (`make wheelhouse`: the CPU torch wheel, rlbus and every dependency),
# the example configs and the entrypoint. Nothing is pulled or downloaded: the base image
# must already be on the engine and pip runs with --no-index.
FROM python:3.11-slim AS builder
COPY wheelhouse /wheelhouse
RUN set -eu; \
    python -m venv /opt/venv; \
    /opt/venv/bin/pip install --no-index --find-links /wheelhouse --disable-pip-version-check -q rlbus; \
    /opt/venv/bin/pip uninstall -y -q pip setuptools wheel 2>/dev/null || true; \
    # headers and C++ sources are only for building extensions; never used at run time
    rm -rf /opt/venv/lib/python3.11/site-packages/torch/include \
           /opt/venv/lib/python3.11/site-packages/torch/share/cmake; \
    find /opt/venv -name '*.a' -delete; \
    mkdir -p /opt/extra; \
    if [ -f /wheelhouse/bwrap ]; then install -m 0755 /wheelhouse/bwrap /opt/extra/bwrap; fi

FROM python:3.11-slim
COPY --from=builder /opt/venv /opt/venv
# bubblewrap for the process sandbox, when the host had it (same Debian release as the base).
# Fail closed: without bwrap, or without the namespaces compose grants (x-sandbox-security), the
# process backend refuses to run commands and the sandbox service exits with the fix
COPY --from=builder /opt/extra/ /usr/local/bin/
COPY examples /app/examples
COPY entrypoint.sh /usr/local/bin/rlbus-entrypoint
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    HF_HUB_DISABLE_PROGRESS_BARS=1 \
    TRANSFORMERS_VERBOSITY=error \
    MPLCONFIGDIR=/tmp/matplotlib \
    RLBUS_RUN_DIR=/runs \
    RLBUS_CONFIG=/app/examples/demo.toml
WORKDIR /app
# the unprivileged user of the roles that open no sandbox (compose: sampler, rollout, learner)
RUN chmod 0755 /usr/local/bin/rlbus-entrypoint && mkdir -p /runs && rlbus --help >/dev/null && \
    useradd --system --uid 10001 --user-group --home-dir /tmp --no-create-home --shell /usr/sbin/nologin rlbus
VOLUME ["/runs"]
USER 10001:10001
ENTRYPOINT ["rlbus-entrypoint"]
CMD ["--help"]
