"""Config section of experiment tracking (the `tracker` role: TensorBoard and wandb).

Empty `backends` (the default) means no tracker process: `rlbus up` starts one only when a
backend is listed. Every field is read only by the tracker (`rlbus/tracking/tracker.py`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from schemas.config.base import Section

Backend = Literal["tensorboard", "wandb"]


class TrackingSection(Section):
    """Experiment tracking: which backends the tracker writes, and how the run is named there."""

    PLACE = "tracking"

    backends: list[Backend] = Field(default_factory=list)
    """Where the tracker writes: `tensorboard` (event files under `<run>/tensorboard/`) and/or `wandb`
    (offline under `<run>/wandb/` when no WANDB_API_KEY is set, online when one is). Empty = no tracker.
    Both need the optional extra: `pip install -e '.[tracking]'`."""
    project: str = "rlbus"
    """wandb project of the run (TensorBoard has none)."""
    entity: str = ""
    """wandb entity (team or user); empty = the API key's default entity."""
    run_name: str = ""
    """Display name of the run in wandb; empty = the run id. The wandb run id is always the run id, so a
    resumed or restarted tracker continues the same wandb run."""
    tags: list[str] = Field(default_factory=list)
    """wandb tags of the run."""
    samples_every_n_steps: int = Field(default=10, ge=1)
    """Every N learner steps, a table of a few scored samples (prompt, completion, reward, components):
    TensorBoard text `samples`, wandb table `samples`."""
    samples_per_table: int = Field(default=4, ge=1, le=64)
    """How many samples that table shows (the first ones scored in the step's window)."""
    sample_chars: int = Field(default=400, ge=40)
    """Prompt and completion are cut to this many characters in the samples table."""

    @field_validator("backends")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"tracking.backends lists a backend twice: {value}")
        return value
