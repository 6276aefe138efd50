"""The built-in verifiers, one module per verifier kind: `verifier_workers.verifiers.<kind>`.

Naming rule: the module's name is the verifier's registered name (a task's `verifier`), and
it defines `verify_<kind>(traj, hidden=None) -> Verdict`; `verifier_workers.registry.BUILTINS`
lists them. Shared support (the contract `verifier_workers.verdict`, the sandbox harnesses,
`repo_diff`, the answer pool, `errors`) lives beside this package in `verifier_workers/`.
The package itself imports nothing: a verifier is imported on first use.
"""
