"""rlbus: RL post-training over NATS JetStream: the application on top of the roles.

The package is arranged in rooms; imports between them run one way (tests/test_layers.py):

- `rlbus.log`, `rlbus.natsauth`: neutral leaves, importing no other rlbus module
  (per-process logging set-up; `python -m rlbus.natsauth`, the compose stack's NATS users).
- `rlbus.model` (tiny model, BPE tokenizer, tokenizer check), `rlbus.tracking` (the
  tracker role and its backends), `rlbus.report` (a run's report and plots), `rlbus.deploy`
  (Kubernetes manifests and Slurm scripts of a run, as text): each imports only the leaves,
  never another room.
- `rlbus.run`: one run's life: its folder (`rlbus.run.folder.RunFolder`), start-up checks,
  the launcher, supervisor, watchdog, monitor, resume, `rlbus init`'s preparation, reading a
  run back. May import model, tracking and report.
- `rlbus.commands`: one module per `rlbus` command, each with `register(subparsers)`.
  May import every room above, never `rlbus.cli`.
- `rlbus.cli`: parser assembly and dispatch; `rlbus.entrypoint` (the container entry
  point, `python -m rlbus.entrypoint`) above it, which hands a role to `rlbus.cli.main`.
  Nothing else in rlbus imports either.
"""
