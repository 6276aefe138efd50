#!/bin/sh
# Entry of every rlbus container: `init`, `health ROLE`, or a role (see rlbus/init_run.py).
exec python -m rlbus.init_run "$@"
