"""Experiment tracking: the tracker role (`rlbus worker tracker`, `rlbus.tracking.tracker`),
its backends (TensorBoard, wandb) and the points it writes."""
