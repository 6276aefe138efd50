"""Preparing a run folder: the model every role starts from, and the config the workers read.

Guarantees:
- `prepare_model(cfg, run_path, console)` leaves the warm-started model at
  `<run>/model/start` (`RunFolder.start_model`): the configured `model.path`, or a tiny
  model built at `<run>/model/base` (`rlbus.model.tiny_model`), then SFT on the domains'
  demonstrations when `sft.enabled`. An existing `model/start` is kept as it is (a resumed
  or re-initialised run continues with it).
- `write_redacted_config(cfg, path)` writes the resolved config with every URL's password
  replaced by `***` (schemas.redact): the run folder never holds a credential.
- `secret_env(cfg)` is the environment that hands workers what config.json redacted (the
  run store's URL); empty when nothing was redacted.
- `new_run_id(config_path)` is `<config stem>-<UTC time>`.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from rich.console import Console

from rlbus.run.folder import RunFolder
from schemas.config import RunConfig, dump_config


def new_run_id(config_path: str) -> str:
    """`<config stem>-<UTC time>`."""
    return f"{Path(config_path).stem}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"


def prepare_model(cfg: RunConfig, run_path: Path, console: Console) -> Path:
    """Build (or take) the base model, warm-start it with SFT, leave it at <run>/model/start."""
    folder = RunFolder(run_path)
    start = folder.start_model
    if start.exists():
        return start
    base = Path(cfg.model.path) if cfg.model.path else folder.base_model
    if not cfg.model.path:
        from rlbus.model.tiny_model import build_tiny_model, parse_rope_scaling

        build_tiny_model(
            base,
            arch=cfg.model.arch,
            hidden_size=cfg.model.hidden_size,
            num_layers=cfg.model.num_layers,
            num_heads=cfg.model.num_heads,
            seed=cfg.run.seed,
            tokenizer=cfg.model.tokenizer,
            max_position_embeddings=cfg.model.max_position_embeddings,
            rope_scaling=parse_rope_scaling(cfg.model.rope_scaling) if cfg.model.rope_scaling else None,
        )
        console.print(f"built tiny {cfg.model.arch} model ({cfg.model.tokenizer} tokenizer) at {base}")
    if not cfg.sft.enabled:
        shutil.copytree(base, start)
        return start
    from learner.sft import run_sft
    from producers.demos import sft_batches

    batches = sft_batches(cfg, cfg.sft.batch_size)
    console.print(f"SFT warm start for up to {cfg.sft.seconds:.0f}s ...")
    stats = run_sft(
        base,
        start,
        batches,
        seconds=cfg.sft.seconds,
        max_steps=cfg.sft.max_steps,
        lr=cfg.sft.lr,
        seed=cfg.run.seed,
        threads=cfg.sft.threads,
        progress=console.is_terminal,
    )
    console.print(f"SFT done: {stats}")
    return start


def write_redacted_config(cfg: RunConfig, path: Path) -> None:
    """`dump_config` with every URL's password replaced by `***` (schemas.redact): the run
    folder never holds a credential; workers get the real URLs by environment (`secret_env`)."""
    from schemas.redact import redact_tree

    dump_config(cfg, path)
    path.write_text(json.dumps(redact_tree(json.loads(path.read_text())), indent=2))


def secret_env(cfg: RunConfig) -> dict[str, str]:
    """Environment for the workers holding what config.json has redacted: the run store's URL."""
    from scheduler.store import DB_URL_ENV
    from schemas.redact import is_redacted, redact_url

    url = cfg.scheduler.db_url
    return {DB_URL_ENV: url} if url and redact_url(url) != url and not is_redacted(url) else {}
