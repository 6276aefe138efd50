"""Verifier failures that are not the policy's fault.

Guarantees:
- `VerifierInfraError` (and every subclass, e.g. the code verifier's sandbox errors)
  means "this attempt could not verify the trajectory": the verifier worker retries it
  with backoff and dead-letters it after the consumer's last delivery. It never becomes
  a reward, least of all a reward of 0.
- `VerifierInputError` (in `verdict`) is the other kind: the task itself is unusable,
  so it is dead-lettered at once.
"""

from __future__ import annotations


class VerifierInfraError(RuntimeError):
    """Verification could not run (sandbox down, model missing on this node, timeout); retry it."""


class VerifierCrash(VerifierInfraError):
    """A verifier raised something unexpected (a bug or a resource failure): retried like infra."""
