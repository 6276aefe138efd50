"""Run config: every example loads, unknown keys and bad overrides fail clearly, every field is
documented, renamed keys fail naming their new key (in files and in `--set`), derived values
are derived once; and structlog emits JSON with role/run_id/msg_id when stderr is not a TTY."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from schemas.config import ConfigError, RunConfig, Section, apply_overrides, dump_config, load_config, parse_override

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
            extra = set(got) - set(value)  # sampler.domains also holds what a domain set expands to (rg-<dataset>)
            assert set(value) <= set(got) and all(k.startswith("rg-") for k in extra), (
                f"{where}{key}: file has {sorted(value)}, config has {sorted(got)}"
            )
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
    p.write_text('[learner]\nlr = 0.5\n[run]\nrun_id = "fromfile"\n')
    cfg = load_config(
        p,
        [
            "learner.lr=0.01",  # float
            "sampler.group_size=3",  # int
            "learner.normalize_std=false",  # bool
            "rollout.hf.device=cuda:1",  # bare string (not a TOML literal), into a nested section
            'run.run_id="quoted"',  # TOML string literal
            "model.arch=llama",  # literal choice from a bare string
            "run.max_minutes=2",  # int literal into a float field
        ],
    )
    assert cfg.learner.lr == 0.01 and isinstance(cfg.learner.lr, float)
    assert cfg.sampler.group_size == 3 and isinstance(cfg.sampler.group_size, int)
    assert cfg.learner.normalize_std is False
    assert cfg.rollout.hf.device == "cuda:1"
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


# -- renamed keys: every old spelling fails, naming the new one -----------------------------
RENAMED = {  # old --set, the new key the error must name, the same value under the new key
    "learner": [
        ("learner.lora_rank=8", "learner.lora.rank", "learner.lora.rank=8"),
        ("learner.lora_alpha=32.0", "learner.lora.alpha", "learner.lora.alpha=32.0"),
        ("learner.lora_dropout=0.1", "learner.lora.dropout", "learner.lora.dropout=0.1"),
        (
            'learner.lora_target_modules=["q_proj"]',
            "learner.lora.target_modules",
            'learner.lora.target_modules=["q_proj"]',
        ),
        ("learner.replay_share=0.5", "learner.replay.share", "learner.replay.share=0.5"),
        ("learner.replay_data=x.jsonl", "learner.replay.data", "learner.replay.data=x.jsonl"),
        ("learner.replay_batch_size=4", "learner.replay.batch_size", "learner.replay.batch_size=4"),
        ("learner.off_policy=tis", "learner.off_policy.mode", "learner.off_policy.mode=tis"),
        ("learner.tis_cap=1.5", "learner.off_policy.tis_cap", "learner.off_policy.tis_cap=1.5"),
    ],
    "rollout": [
        ("rollout.device=cuda", "rollout.hf.device", "rollout.hf.device=cuda"),
        ("rollout.threads=2", "rollout.hf.threads", "rollout.hf.threads=2"),
        ("rollout.vllm_tier=fast", "rollout.vllm.tier", "rollout.vllm.tier=fast"),
    ],
    "scheduler.eval": [
        ("scheduler.eval_n=10", "scheduler.eval.n", "scheduler.eval.n=10"),
        ("scheduler.eval_seed=7", "scheduler.eval.seed", "scheduler.eval.seed=7"),
        ("scheduler.eval_difficulty=2", "scheduler.eval.difficulty", "scheduler.eval.difficulty=2"),
        ("scheduler.eval_every_versions=3", "scheduler.eval.every_versions", "scheduler.eval.every_versions=3"),
        ("scheduler.eval_mode=pipeline", "scheduler.eval.mode", "scheduler.eval.mode=pipeline"),
        ("scheduler.eval_timeout_s=9", "scheduler.eval.timeout_s", "scheduler.eval.timeout_s=9"),
        ("scheduler.eval_floors={arith=0.5}", "scheduler.eval.floors", "scheduler.eval.floors={arith=0.5}"),
        ("scheduler.release_margin=0.1", "scheduler.eval.release_margin", "scheduler.eval.release_margin=0.1"),
        ("scheduler.general_eval=arith", "scheduler.eval.general", "scheduler.eval.general=arith"),
        ("scheduler.general_eval_level=2", "scheduler.eval.general_level", "scheduler.eval.general_level=2"),
        ("scheduler.general_eval_n=5", "scheduler.eval.general_n", "scheduler.eval.general_n=5"),
    ],
    "scheduler.curriculum": [
        ("scheduler.curriculum=false", "scheduler.curriculum.enabled", "scheduler.curriculum.enabled=false"),
        (
            "scheduler.curriculum_temperature=0.3",
            "scheduler.curriculum.temperature",
            "scheduler.curriculum.temperature=0.3",
        ),
        ("scheduler.curriculum_every_s=2", "scheduler.curriculum.every_s", "scheduler.curriculum.every_s=2"),
        ("scheduler.curriculum_ema_alpha=0.5", "scheduler.curriculum.ema_alpha", "scheduler.curriculum.ema_alpha=0.5"),
        (
            "scheduler.curriculum_promote_at=0.9",
            "scheduler.curriculum.promote_at",
            "scheduler.curriculum.promote_at=0.9",
        ),
        ("scheduler.curriculum_demote_at=0.1", "scheduler.curriculum.demote_at", "scheduler.curriculum.demote_at=0.1"),
        ("scheduler.curriculum_window=16", "scheduler.curriculum.window", "scheduler.curriculum.window=16"),
    ],
    "scheduler.forgetting": [
        ("scheduler.forgetting_margin=0.1", "scheduler.forgetting.margin", "scheduler.forgetting.margin=0.1"),
        (
            "scheduler.forgetting_replay_step=0.2",
            "scheduler.forgetting.replay_step",
            "scheduler.forgetting.replay_step=0.2",
        ),
        (
            "scheduler.forgetting_replay_max=0.5",
            "scheduler.forgetting.replay_max",
            "scheduler.forgetting.replay_max=0.5",
        ),
        (
            "scheduler.forgetting_beta_step=0.02",
            "scheduler.forgetting.beta_step",
            "scheduler.forgetting.beta_step=0.02",
        ),
        ("scheduler.forgetting_beta_max=0.3", "scheduler.forgetting.beta_max", "scheduler.forgetting.beta_max=0.3"),
    ],
    "scheduler.plateau": [
        ("scheduler.plateau_threshold=0.5", "scheduler.plateau.threshold", "scheduler.plateau.threshold=0.5"),
        ("scheduler.plateau_window=3", "scheduler.plateau.window", "scheduler.plateau.window=3"),
        ("scheduler.stop_on_plateau=true", "scheduler.plateau.stop", "scheduler.plateau.stop=true"),
    ],
}
RENAMED_CASES = [(sec, *case) for sec, cases in RENAMED.items() for case in cases]


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("section,old,new,replacement", RENAMED_CASES, ids=[c[1].split("=")[0] for c in RENAMED_CASES])
def test_renamed_key_via_override_names_the_new_key(section, old, new, replacement):
    old_key = old.split("=")[0]
    with pytest.raises(ConfigError, match=f"{re.escape(old_key)} was renamed: use {re.escape(new)}"):
        load_config(None, [old])
    cfg = load_config(None, [replacement])  # the new spelling takes the same value
    _, value = parse_override(replacement)
    assert _get(cfg, new) == value and _get(cfg, new) != _get(RunConfig(), new)


@pytest.mark.parametrize("section", sorted(RENAMED))
def test_renamed_keys_in_a_file_name_the_new_keys(tmp_path, section):
    """All of a section's old keys in one TOML file: one error naming every new key."""
    data: dict = {}
    apply_overrides(data, [old for old, _, _ in RENAMED[section]])
    p = tmp_path / "old.toml"
    p.write_text(_toml(data))
    with pytest.raises(ConfigError) as err:
        load_config(p)
    for old, new, _ in RENAMED[section]:
        assert f"{old.split('=')[0]} was renamed: use {new}" in str(err.value)


def _toml(data: dict) -> str:
    """TOML of a {section: {key: value}} dict (tables inside a section written inline)."""
    lines = []
    for section, table in data.items():
        lines += [f"[{section}]", *(f"{k} = {_value(v)}" for k, v in table.items())]
    return "\n".join(lines) + "\n"


def _value(v) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_value(x)}" for k, x in v.items()) + " }"
    return json.dumps(v)


def test_scalar_that_became_a_section_shows_the_new_form(tmp_path):
    p = tmp_path / "old.toml"
    p.write_text('[scheduler]\ncurriculum = false\n[learner]\noff_policy = "decoupled"\n')
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert "scheduler.curriculum was renamed: use scheduler.curriculum.enabled = false" in str(err.value)
    assert 'learner.off_policy was renamed: use learner.off_policy.mode = "decoupled"' in str(err.value)
    # the same names as sections are the new keys
    p.write_text('[scheduler.curriculum]\nenabled = false\n[learner.off_policy]\nmode = "decoupled"\n')
    cfg = load_config(p)
    assert cfg.scheduler.curriculum.enabled is False and cfg.learner.off_policy.mode == "decoupled"


def test_resolved_config_round_trips_through_the_launcher_json(tmp_path):
    cfg = load_config(EXAMPLES[0], ["learner.lora.rank=4", "scheduler.plateau.stop=true", "rollout.vllm.tier=fast"])
    dump_config(cfg, tmp_path / "config.json")
    again = load_config(tmp_path / "config.json")
    assert again == cfg and again.learner.lora.rank == 4 and again.sampler.inflight_caps == cfg.sampler.inflight_caps


# -- derived values ---------------------------------------------------------------------------
def test_inflight_caps_derived_from_learner_rollout_and_sampler():
    cfg = load_config(
        None,
        [
            "learner.groups_per_step=4",
            "learner.publish_every=2",
            "learner.max_staleness=3",
            "sampler.max_inflight_tasks=100",
            "rollout.pools.long.max_inflight=5",
        ],
    )
    assert cfg.sampler.inflight_caps == {"short": 4 * 2 * 3, "long": 5}
    # the sampler's own bound wins when it is the smaller one; max_staleness 0 still lets one version through
    cfg = load_config(None, ["learner.groups_per_step=4", "learner.max_staleness=0", "sampler.max_inflight_tasks=3"])
    assert cfg.sampler.inflight_caps["short"] == 3
    assert (
        load_config(None, ["learner.groups_per_step=4", "learner.max_staleness=0"]).sampler.inflight_caps["short"] == 4
    )
    # every pool gets a cap, the configured extra ones included
    cfg = load_config(None, ["rollout.pools.huge.max_inflight=1"])
    assert cfg.sampler.inflight_caps["huge"] == 1 and set(cfg.sampler.inflight_caps) == set(cfg.rollout.pools)


def test_inflight_caps_follow_a_replaced_section_and_cannot_be_set():
    cfg = RunConfig()
    cfg.learner = cfg.learner.model_copy(update={"groups_per_step": 2, "max_staleness": 1})
    assert cfg.sampler.inflight_caps["short"] == 2  # re-derived on assignment
    with pytest.raises(ConfigError, match="sampler.inflight_caps is derived.*sampler.max_inflight_tasks"):
        load_config(None, ["sampler.inflight_caps={short=3}"])
    assert "inflight_caps" not in json.dumps(cfg.model_dump(mode="json"))  # never written for the workers


def test_sampler_reads_the_derived_caps():
    from producers.sampler import pool_caps

    cfg = load_config(
        None, ["learner.groups_per_step=5", "learner.max_staleness=2", "rollout.pools.long.max_inflight=3"]
    )
    assert pool_caps(cfg) == cfg.sampler.inflight_caps == {"short": 10, "long": 3}


def test_every_renamed_key_is_tested():
    tables = {c.PLACE: c.RENAMED for _, c in _sections(RunConfig) if c.RENAMED}
    tested = {old.split("=")[0] for _, old, _, _ in RENAMED_CASES}
    declared = {f"{place}.{old}" for place, table in tables.items() for old in table}
    assert declared == tested


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
    proc = subprocess.run(
        [sys.executable, "-c", LOG_SNIPPET],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 2, proc.stderr
    first, second = (json.loads(ln) for ln in lines)
    assert first["event"] == "rollout.finished" and first["tokens"] == 7
    assert first["role"] == "rollout" and first["run_id"] == "run42" and first["msg_id"] == "m-123"
    assert first["level"] == "info" and "timestamp" in first
    assert second["event"] == "rollout.idle" and second["role"] == "rollout" and "msg_id" not in second


def test_assigning_a_field_keeps_sections_valid():
    """validate_assignment re-runs the section's checks with its built sub-sections: they are
    not old scalar keys (regression: `lc.grad_clip = x` failed on `off_policy`)."""
    from schemas.config import LearnerSection, SchedulerSection

    lc = LearnerSection()
    lc.grad_clip = 1e12
    assert lc.grad_clip == 1e12 and lc.off_policy.mode == "none"
    sc = SchedulerSection()
    sc.threads = 2
    assert sc.curriculum.enabled is True
