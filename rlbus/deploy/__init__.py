"""Deploying a run past one machine, as text: Kubernetes manifests (`rlbus.deploy.k8s`, `rlbus k8s
render`) and Slurm batch scripts (`rlbus.deploy.slurm`, `rlbus slurm render`).

Guarantees:
- Rendering reads the run config (`schemas.config.DeploySection` and the roles' sections) and names
  every stream and consumer through `bus.subjects.Registry` of the run id, never a literal.
- Nothing here talks to a cluster: the output is files, checked offline by the tests.
"""
