"""`rlbus k8s render`: a run's Kubernetes manifests as a kustomize tree (the work: `rlbus.deploy.k8s`).

Registered in `rlbus.cli.COMMANDS`.
"""

from __future__ import annotations

EPILOG = """examples:
  rlbus k8s render examples/demo.toml --run-id exp-7 --out deploy/k8s --image registry.example/rlbus:1.0
  rlbus k8s render run.toml --run-id exp-7 --out deploy/k8s --namespace rl --set deploy.rollout.max_replicas=32
then:
  kubectl kustomize deploy/k8s/overlays/exp-7            # read what will be applied
  kubectl apply -k deploy/k8s/overlays/exp-7             # NATS, the init Job, every role, KEDA's ScaledObjects
  kubectl -n rlbus scale deployment exp-7-verifier --replicas 4   # by hand, when KEDA is not installed

The tree: base/ (namespace, service account) and overlays/<run-id>/ (NATS StatefulSet + Secret +
config, the run config ConfigMap, the run folder PVC, the init Job, a Deployment per role, the
learner StatefulSet (one pod with its checkpoint PVC; with learner.world_size > 1 one pod per
rank, meeting at pod 0 through a headless Service, checkpoints on the run folder PVC), KEDA ScaledObjects for rollout and verifier, and
values.yaml for the official NATS Helm chart). nats-auth.yaml and nats-passwords.env hold the
NATS passwords (mode 0600; rendering again keeps them): never commit them.

Names: every object is <run-id>-<part>, so the run id must be a DNS label (lowercase letters,
digits, '-'; at most 40 characters). Stream and consumer names of the ScaledObjects come from the
run id (TASKS_<run-id>/rollout, TRAJ_<run-id>/verifier): render per run, never copy a tree to
another run (KEDA scales to the maximum on a consumer it cannot find). Settings: [deploy] in the
config (`rlbus config-help deploy`). docs/deploy.md, "Kubernetes".
"""


def register(sub) -> None:
    """Add `rlbus k8s` (with `render`) to the CLI."""
    import argparse

    p = sub.add_parser(
        "k8s",
        help="render a run's Kubernetes manifests (kustomize tree, KEDA autoscaling of rollout/verifier)",
        description="Kubernetes deployment of a run. `render` writes the manifests; nothing talks to a cluster.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbs = p.add_subparsers(dest="k8s_cmd", required=True, metavar="VERB")
    r = verbs.add_parser(
        "render",
        help="write base/ and overlays/<run-id>/ for this config and run id",
        description="Render the run's kustomize tree: per-role Deployments, the learner StatefulSet, a "
        "3-node JetStream StatefulSet with per-role users, Secrets, probes, GPU requests and KEDA "
        "ScaledObjects named after the run's consumers.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("config", metavar="CONFIG", help="run config TOML, e.g. examples/demo.toml")
    r.add_argument("--run-id", required=True, help="the run id (a DNS label: a-z, 0-9, '-'; at most 40)")
    r.add_argument("--out", required=True, metavar="DIR", help="folder to write base/ and overlays/<run-id>/ under")
    r.add_argument("--image", default="", help="the rlbus image every role runs (default: deploy.image; required)")
    r.add_argument("--namespace", default="", help="Kubernetes namespace (default: deploy.namespace, `rlbus`)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    r.set_defaults(func=_render)


def _render(args) -> int:
    from pathlib import Path

    from rlbus.deploy.k8s import RenderError, render
    from schemas.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.set)
        files = render(cfg, args.run_id, Path(args.out), image=args.image, namespace=args.namespace)
    except (ConfigError, RenderError) as exc:
        raise SystemExit(f"rlbus k8s render: {exc}") from None
    out = Path(args.out)
    for path in files:
        print(path.relative_to(out))
    print(f"wrote {len(files)} files under {out}; apply with: kubectl apply -k {out / 'overlays' / args.run_id}")
    return 0
