"""NATS connection, embedded server, subject registry, typed publish/pull, objects and KV."""
