"""rlbus: RL post-training over NATS JetStream."""
