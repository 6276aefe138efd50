"""Verifier registry, built-in verifiers and the verifier worker process."""
