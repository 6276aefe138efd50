"""One run's life: its folder, start-up checks, the launcher (`rlbus up`) and what it watches,
resume, `rlbus init`'s preparation, and reading a finished or live run back.

Never imports `rlbus.commands` or `rlbus.cli` (tests/test_layers.py)."""
