#!/bin/sh
# Entry of every rlbus container: `init`, `health ROLE`, or a role (see rlbus/entrypoint.py).
# `init` run as root (compose does) then hands out the run folder (issue 27, docs/deploy.md):
# checkpoints/ to the learner's uid, secrets/ root-only, config.json and model/ readable, not writable.
set -e
if [ "$1" = init ] && [ "$(id -u)" = 0 ]; then
    python -m rlbus.entrypoint init
    run="${RLBUS_RUN_DIR:-/runs}/${RLBUS_RUN_ID:-demo}"
    mkdir -p "$run/checkpoints" "$run/secrets"
    chown "${RLBUS_ROLE_UID:-10001}:${RLBUS_ROLE_UID:-10001}" "$run/checkpoints"
    chown -R 0:0 "$run/secrets"
    chmod 0700 "$run/secrets"
    chmod -R go-w,a+rX "$run/config.json" "$run/model"
    exit 0
fi
exec python -m rlbus.entrypoint "$@"
