"""The learner: supervised warm start and policy updates."""
