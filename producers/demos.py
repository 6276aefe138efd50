"""SFT demonstrations from the configured domains, as an endless iterator of batches.

The domains that make tasks also make their worked demonstrations; this module mixes
them for the SFT warm start (`learner.sft.run_sft` takes any iterator of demo batches
and knows nothing of domains).

Guarantees:
- `sft_batches(cfg, batch_size)` draws each batch from ONE domain, chosen by its static
  weight (`sft_weight`, else `weight`): short arith and long tool episodes are never
  padded together, so each step costs what its domain costs.
- arith demonstrates at `sft.difficulty`, every other domain at its starting level;
  held-out eval problems are never demonstrated (each source excludes its own), nor is
  any `heldout` (zero-shot) domain.
- A domain whose source cannot start (`DomainUnavailable`) or says it is not
  `demonstrable` (e.g. a reasoning-gym dataset without single gold answers) is left out.
- A domain whose `demonstration` raises ValueError mid-stream (none demonstrable at its level)
  is dropped from the mix with a warning; the others go on.
- The same seed and config give the same stream of batches.
- A config where no domain can demonstrate itself is a clear error naming the fix.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import structlog

from producers.domains import DomainUnavailable, make_source
from schemas.config import RunConfig

log = structlog.get_logger()


class DomainDemos:
    """Demonstrations of several domains mixed by weight, one domain per batch."""

    def __init__(self, sources: list, weights: list[float], levels: list[int]) -> None:
        self.sources, self.weights, self.levels = sources, weights, levels

    def batches(self, seed: int, batch_size: int) -> Iterator[list]:
        """An endless stream of batches of `batch_size` demos, each from one domain."""
        rng, weights = random.Random(seed), list(self.weights)
        while True:
            if not any(weights):
                raise ValueError(
                    "no configured domain could demonstrate itself (see the warnings); set sft.enabled=false"
                )
            k = rng.choices(range(len(self.sources)), weights=weights)[0]
            try:
                yield [self.sources[k].demonstration(rng, self.levels[k]) for _ in range(batch_size)]
            except ValueError as exc:  # e.g. every prompt of the level skipped as too long: none to show
                log.warning("sft.domain_dropped", reason=str(exc))
                weights[k] = 0.0


def domain_demos(cfg: RunConfig) -> DomainDemos:
    """Every configured domain that can demonstrate itself, by static weight."""
    sources, weights, levels = [], [], []
    for name, dc in cfg.sampler.domains.items():
        if dc.heldout:
            continue  # a zero-shot domain: no demonstrations either
        try:
            src = make_source("sft", name, cfg)
        except DomainUnavailable:
            continue  # disabled here as in the sampler (which logs why)
        share = dc.weight if dc.sft_weight is None else dc.sft_weight
        if hasattr(src, "demonstration") and getattr(src, "demonstrable", True) and share > 0:
            sources.append(src)
            weights.append(share)
            levels.append(cfg.sft.difficulty if name == "arith" else dc.initial_level)
    if not sources:
        raise ValueError("sft.enabled but no configured domain has demonstrations; set sft.enabled=false")
    return DomainDemos(sources, weights, levels)


def sft_batches(cfg: RunConfig, batch_size: int) -> Iterator[list]:
    """The run's SFT batches (see the module guarantees), seeded by `run.seed`."""
    return domain_demos(cfg).batches(cfg.run.seed, batch_size)


def batches_of(demo: Callable[[random.Random], object], seed: int, batch_size: int) -> Iterator[list]:
    """An endless stream of batches from a one-demo function `demo(rng)`."""
    rng = random.Random(seed)
    while True:
        yield [demo(rng) for _ in range(batch_size)]
