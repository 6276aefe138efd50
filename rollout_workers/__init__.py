"""Inference engines and the rollout worker process."""
