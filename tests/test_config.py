"""Run config: every example loads, unknown keys and bad overrides fail clearly, every field is
documented; and structlog emits JSON with role/run_id/msg_id when stderr is not a TTY."""

from __future__ import annotations

import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from schemas.config import ConfigError, RunConfig, Section, load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))


def test_examples_exist():
    assert len(EXAMPLES) >= 1


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)


def _assert_applied(model, raw: dict, where: str = "") -> None:
    for key, value in raw.items():
        got = getattr(model, key)
        if isinstance(value, dict) and isinstance(got, BaseModel):
            _assert_applied(got, value, f"{where}{key}.")
        elif isinstance(value, dict) and isinstance(got, dict):  # a table of sections, e.g. sampler.domains
            assert set(got) == set(value), f"{where}{key}: file has {sorted(value)}, config has {sorted(got)}"
            for name, sub in value.items():
                if isinstance(got[name], BaseModel):
                    _assert_applied(got[name], sub, f"{where}{key}.{name}.")
                else:  # a plain mapping of values, e.g. reward_weights
                    assert got[name] == sub, f"{where}{key}.{name}: file says {sub!r}, config has {got[name]!r}"
        else:
            assert got == value, f"{where}{key}: file says {value!r}, config has {got!r}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_values_are_applied(path):
    import tomllib

    _assert_applied(load_config(path), tomllib.loads(path.read_text()))


def test_unknown_key_rejected_naming_it(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[learner]\nlr = 0.1\nlearning_rat = 0.5\n")
    with pytest.raises(ConfigError, match="learner.learning_rat"):
        load_config(p)
    p.write_text("[lerner]\nlr = 0.1\n")
    with pytest.raises(ConfigError, match="lerner"):
        load_config(p)


def test_unknown_key_via_override_rejected():
    with pytest.raises(ConfigError, match="sampler.group_sise"):
        load_config(None, ["sampler.group_sise=4"])


def test_set_overrides_typed_values(tmp_path):
    p = tmp_path / "base.toml"
    p.write_text("[learner]\nlr = 0.5\n[run]\nrun_id = \"fromfile\"\n")
    cfg = load_config(p, [
        "learner.lr=0.01",                 # float
        "sampler.group_size=3",            # int
        "learner.normalize_std=false",     # bool
        "rollout.device=cuda:1",           # bare string (not a TOML literal)
        'run.run_id="quoted"',             # TOML string literal
        "model.arch=llama",                # literal choice from a bare string
        "run.max_minutes=2",               # int literal into a float field
    ])
    assert cfg.learner.lr == 0.01 and isinstance(cfg.learner.lr, float)
    assert cfg.sampler.group_size == 3 and isinstance(cfg.sampler.group_size, int)
    assert cfg.learner.normalize_std is False
    assert cfg.rollout.device == "cuda:1"
    assert cfg.run.run_id == "quoted"
    assert cfg.model.arch == "llama"
    assert cfg.run.max_minutes == 2.0
    # untouched fields keep file values / defaults
    assert load_config(p).learner.lr == 0.5
    assert cfg.learner.clip_low == RunConfig().learner.clip_low


def test_override_later_wins_and_nested_section_created(tmp_path):
    cfg = load_config(None, ["learner.lr=0.1", "learner.lr=0.2", "sft.enabled=true"])
    assert cfg.learner.lr == 0.2 and cfg.sft.enabled is True


def test_override_with_wrong_type_rejected():
    with pytest.raises(ConfigError, match="sampler.group_size"):
        load_config(None, ["sampler.group_size=many"])


@pytest.mark.parametrize("bad", ["learner.lr", "noequals", ""])
def test_bad_override_format_raises_config_error(bad):
    with pytest.raises(ConfigError):
        load_config(None, [bad])


def test_override_into_non_section_raises_config_error():
    with pytest.raises(ConfigError, match="not a section"):
        load_config(None, ["learner.lr=0.1", "learner.lr.x=1"])
    with pytest.raises(ConfigError):
        load_config(None, ["learner.lr.x=1"])  # creates a dict where a float belongs


def test_missing_file_raises_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")


def _models_in(annotation) -> list[type[BaseModel]]:
    """Pydantic model classes inside an annotation (`X`, `X | None`, `dict[str, X]`, `list[X]`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _sections(model: type[BaseModel], prefix: str = ""):
    """(dotted name, model class) for RunConfig and every nested section."""
    yield prefix or "<root>", model
    for name, f in model.model_fields.items():
        for sub in _models_in(f.annotation):
            yield from _sections(sub, f"{prefix}{name}.")


def _all_subclasses(cls) -> set[type]:
    return {c for sub in cls.__subclasses__() for c in {sub} | _all_subclasses(sub)}


def test_every_field_is_documented():
    seen = list(_sections(RunConfig))
    assert len(seen) >= 9  # root + one section per role
    undocumented = []
    for where, model in seen:
        assert issubclass(model, Section), where
        assert model.model_config.get("extra") == "forbid", where
        for name, f in model.model_fields.items():
            if not (f.description or "").strip():
                undocumented.append(f"{where}{name}" if where != "<root>" else name)
    assert not undocumented, f"fields without a docstring: {undocumented}"


def test_every_section_subclass_is_reachable_from_run_config():
    reachable = {m for _, m in _sections(RunConfig)}
    missing = [c.__name__ for c in _all_subclasses(Section) if c not in reachable]
    assert not missing, f"Section subclasses not in RunConfig: {missing}"


LOG_SNIPPET = """
import structlog
from rlbus.log import configure_logging
from structlog.contextvars import bound_contextvars
configure_logging("rollout", "run42")
log = structlog.get_logger()
with bound_contextvars(msg_id="m-123"):
    log.info("rollout.finished", tokens=7)
log.info("rollout.idle")
"""


def test_structlog_json_when_not_a_tty():
    proc = subprocess.run([sys.executable, "-c", LOG_SNIPPET], cwd=ROOT, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 2, proc.stderr
    first, second = (json.loads(ln) for ln in lines)
    assert first["event"] == "rollout.finished" and first["tokens"] == 7
    assert first["role"] == "rollout" and first["run_id"] == "run42" and first["msg_id"] == "m-123"
    assert first["level"] == "info" and "timestamp" in first
    assert second["event"] == "rollout.idle" and second["role"] == "rollout" and "msg_id" not in second
