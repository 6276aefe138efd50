"""The reasoning-gym domain family: what the `reasoning_gym` domain kind (producers), its
verifier (verifier_workers) and the config expansion (`sampler.domain_sets.reasoning_gym`)
share, so none imports another.

Every dataset of `reasoning_gym.factory.DATASETS` can be a domain `rg-<dataset>`. The
`reasoning_gym` package is imported on first use, never when this module is imported.

Guarantees:
- `domain_name(dataset)` is `rg-` + the dataset name with every character outside
  `[A-Za-z0-9_-]` replaced by `_`: one NATS subject token. Two datasets that would map to
  the same name both get a suffix of 8 hex digits of their name's sha256, so the mapping
  is deterministic and one-to-one; `dataset_of(domain)` inverts it (None when unknown).
- Difficulty: a domain level L (1-based) is the L-th curriculum level of the dataset
  whose config validates in the chosen range mode (`curriculum.set_global_level`, each
  attribute clamped to its own last level; ranges `inclusive` of every easier level, the
  library's default, or `upper_bound`: only the level's own segment). Levels whose config
  the dataset itself rejects are skipped, so `levels(...)` may be fewer than the
  curriculum defines; a dataset without a curriculum has one level (its default config).
- `dataset_config(...)` is a pure function of (dataset, level, range mode, extra config
  fields, seed, size): the generator and the scorer rebuild the very same config.
- `pack(x)` turns entry metadata into JSON/msgpack-safe data that `unpack` turns back into
  what the scorer expects: tuples, sets, frozensets and dicts with non-string keys travel
  tagged (`{"__rg__": kind, "v": ...}`) and come back as themselves; numpy scalars and
  arrays become plain numbers and lists, bytes text, anything else its `repr` (one way).
  `jsonable(x)` is the plain view for people: tuples and sets as lists (sets sorted by
  repr), keys as strings.
- `content_hash(question)` is the sha256 of the question text; the eval slice is the
  hashes for which `producers.eval_set.in_eval_slice` holds: the eval problems of a domain
  come only from that slice and training never draws from it, so the two are disjoint by
  content whatever the process, seed or generator.
- `NEEDS_CARE` documents every dataset of reasoning-gym 0.1.25 that does not simply build
  and score its own gold answer at 1.0 (tests hold the list current); `EXPLICIT_ONLY` are
  never matched by a glob (they must be named).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from functools import lru_cache
from typing import Any

PREFIX = "rg-"
"""Prefix of every reasoning-gym domain name."""

RANGE_MODES = ("inclusive", "upper_bound")
"""How a curriculum level turns a range attribute into bounds (see the module docstring)."""

EXPLICIT_ONLY: dict[str, str] = {
    "composite": "mixes other datasets: needs its own dataset list, not a family member",
    "sokoban": "slow generator (up to several seconds per puzzle): name it to include it",
}
"""Datasets a glob in `include` never matches (naming one exactly still includes it)."""

NEEDS_CARE: dict[str, str] = {
    **EXPLICIT_ONLY,
    "boxnet": "no single gold answer (any valid plan scores): RL only, no SFT demonstrations",
    "graph_color": "no single gold answer (any valid colouring scores): RL only, no SFT demonstrations",
    "propositional_logic": "no single gold answer (any valid conclusion scores): RL only, no SFT demonstrations",
    "rubiks_cube": "no single gold answer (any solving sequence scores): RL only, no SFT demonstrations; "
    "its top curriculum level fails its own config check and is skipped",
    "rush_hour": "no single gold answer (any solving sequence scores): RL only, no SFT demonstrations",
    "knight_swap": "no curriculum level validates in range_mode inclusive (4-square boards < its minimum 6), "
    "and in upper_bound its generator fails to find a puzzle (the domain is disabled at start)",
    "caesar_cipher": "curriculum levels 3-4 fail its own config check (rotation > 25) and are skipped",
    "modulo_grid": "curriculum level 2 fails its own config check (max_target 0) and is skipped",
    "survo": "curriculum levels 3-4 fail its own config check in range_mode inclusive and are skipped",
    "codeio": "generation depends on str hash order: reproducible across processes only with a fixed PYTHONHASHSEED",
    "isomorphic_strings": "generation depends on str hash order: reproducible across processes only with a "
    "fixed PYTHONHASHSEED",
    "polynomial_multiplication": "generation depends on str hash order: reproducible across processes only with "
    "a fixed PYTHONHASHSEED",
    "ransom_note": "generation depends on str hash order: reproducible across processes only with a fixed "
    "PYTHONHASHSEED",
    "word_ladder": "generation depends on str hash order: reproducible across processes only with a fixed "
    "PYTHONHASHSEED",
}
"""Dataset -> why it needs care (the family still serves it unless it is EXPLICIT_ONLY)."""

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def _factory():
    from reasoning_gym import factory

    return factory


def dataset_names() -> list[str]:
    """Every registered reasoning-gym dataset, sorted."""
    return sorted(_factory().DATASETS)


@lru_cache(maxsize=1)
def _names() -> tuple[dict[str, str], dict[str, str]]:
    names = dataset_names()
    plain = {n: PREFIX + _UNSAFE.sub("_", n) for n in names}
    taken: dict[str, int] = {}
    for d in plain.values():
        taken[d] = taken.get(d, 0) + 1
    forward = {n: d if taken[d] == 1 else f"{d}-{hashlib.sha256(n.encode()).hexdigest()[:8]}" for n, d in plain.items()}
    return forward, {d: n for n, d in forward.items()}


def domain_name(dataset: str) -> str:
    """The subject-safe domain name of `dataset` (see the module docstring)."""
    forward, _ = _names()
    if dataset in forward:
        return forward[dataset]
    return PREFIX + _UNSAFE.sub("_", dataset)


def dataset_of(domain: str) -> str | None:
    """The dataset behind domain name `domain`, or None when it names none."""
    if not domain.startswith(PREFIX):
        return None
    return _names()[1].get(domain)


def is_known(dataset: str) -> bool:
    """Whether `dataset` is registered in the installed reasoning-gym."""
    return dataset in _factory().DATASETS


def _context(range_mode: str):
    from reasoning_gym.coaching.base_curriculum import DefaultCurriculumContext, RangeAttributeMode

    if range_mode not in RANGE_MODES:
        raise ValueError(f"range_mode {range_mode!r} is not one of {list(RANGE_MODES)}")
    mode = RangeAttributeMode.INCLUSIVE if range_mode == "inclusive" else RangeAttributeMode.UPPER_BOUND
    return DefaultCurriculumContext(mode=mode)


def _raw_config(dataset: str, curriculum_level: int | None, range_mode: str, extra: dict, seed: int, size: int):
    f = _factory()
    _, config_cls = f.DATASETS[dataset]
    base = {**extra, "seed": seed, "size": size}
    if curriculum_level is None:
        config = config_cls(**base)
    else:
        cur = f.create_curriculum(dataset)
        cur.set_global_level(curriculum_level)
        config = cur.generate_configuration(base, context=_context(range_mode))
        for key, value in extra.items():  # extra fields win over the curriculum's
            setattr(config, key, value)
    if hasattr(config, "validate"):
        config.validate()
    return config


def _extra_key(extra: dict | None) -> str:
    return json.dumps(extra or {}, sort_keys=True, default=repr)


@lru_cache(maxsize=1024)
def _levels(dataset: str, range_mode: str, extra_key: str) -> tuple[tuple[int | None, ...], str]:
    f = _factory()
    extra = json.loads(extra_key)
    if dataset not in f.CURRICULA:
        candidates: list[int | None] = [None]
    else:
        attrs = f.create_curriculum(dataset).attributes.values()
        candidates = list(range(max((len(a.levels) for a in attrs), default=1)))
    valid, reason = [], ""
    for lvl in candidates:
        try:
            _raw_config(dataset, lvl, range_mode, extra, seed=0, size=1)
        except Exception as exc:  # noqa: BLE001 - any failure of the dataset's own check skips that level
            reason = reason or f"{type(exc).__name__}: {exc}"
        else:
            valid.append(lvl)
    return tuple(valid), reason


def levels(dataset: str, range_mode: str = "inclusive", extra: dict | None = None) -> tuple[int | None, ...]:
    """The curriculum levels (0-based; `None`: no curriculum) that domain levels 1, 2, ...
    stand for: those whose config validates, in order. Empty when none does."""
    return _levels(dataset, range_mode, _extra_key(extra))[0]


def level_problem(dataset: str, range_mode: str = "inclusive", extra: dict | None = None) -> str:
    """Why the first skipped level of `dataset` was skipped ("" when none was)."""
    return _levels(dataset, range_mode, _extra_key(extra))[1]


def curriculum_level(dataset: str, level: int, range_mode: str = "inclusive", extra: dict | None = None) -> int | None:
    """The curriculum level of domain level `level` (ValueError outside 1..len(levels))."""
    valid = levels(dataset, range_mode, extra)
    if not 1 <= level <= len(valid):
        raise ValueError(
            f"reasoning-gym dataset {dataset!r} has levels 1..{len(valid)} in range_mode {range_mode!r}, not {level}"
        )
    return valid[level - 1]


def dataset_config(
    dataset: str, level: int, range_mode: str = "inclusive", extra: dict | None = None, seed: int = 0, size: int = 1
):
    """The dataset's config at domain `level` (see the module guarantees)."""
    return _raw_config(
        dataset, curriculum_level(dataset, level, range_mode, extra), range_mode, dict(extra or {}), seed, size
    )


def build(
    dataset: str, level: int, range_mode: str = "inclusive", extra: dict | None = None, seed: int = 0, size: int = 1
):
    """The dataset object at domain `level`, seeded (what generator and scorer both use)."""
    cls, _ = _factory().DATASETS[dataset]
    return cls(config=dataset_config(dataset, level, range_mode, extra, seed, size))


def config_summary(config: Any) -> dict[str, Any]:
    """A dataset config as JSON-safe fields (seed and size left out)."""
    if dataclasses.is_dataclass(config):
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    else:
        fields = dict(vars(config))
    return jsonable({k: v for k, v in fields.items() if k not in ("seed", "size")})


TAG = "__rg__"
"""Key of a tagged value in packed metadata."""


def pack(x: Any) -> Any:
    """`x` as JSON/msgpack-safe data that `unpack` restores (see the module guarantees)."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x) and TAG not in x:
            return {k: pack(v) for k, v in x.items()}
        return {TAG: "dict", "v": [[pack(k), pack(v)] for k, v in x.items()]}
    if isinstance(x, list):
        return [pack(v) for v in x]
    if isinstance(x, tuple):
        return {TAG: "tuple", "v": [pack(v) for v in x]}
    if isinstance(x, (set, frozenset)):
        return {TAG: "frozenset" if isinstance(x, frozenset) else "set", "v": [pack(v) for v in sorted(x, key=repr)]}
    if isinstance(x, (bytes, bytearray)):
        return bytes(x).decode("utf-8", errors="replace")
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return pack(dataclasses.asdict(x))
    if hasattr(x, "tolist") and callable(x.tolist):  # numpy scalars and arrays
        return pack(x.tolist())
    return repr(x)


_UNPACK = {"tuple": tuple, "set": set, "frozenset": frozenset}


def unpack(x: Any) -> Any:
    """The value `pack` was given (tagged tuples, sets and non-string-keyed dicts restored)."""
    if isinstance(x, list):
        return [unpack(v) for v in x]
    if isinstance(x, dict):
        kind = x.get(TAG)
        if kind == "dict":
            return {_hashable(unpack(k)): unpack(v) for k, v in x["v"]}
        if kind in _UNPACK:
            items = [unpack(v) for v in x["v"]]
            return _UNPACK[kind](_hashable(v) for v in items) if kind != "tuple" else tuple(items)
        return {k: unpack(v) for k, v in x.items()}
    return x


def _hashable(x: Any) -> Any:
    return tuple(_hashable(v) for v in x) if isinstance(x, list) else x


def jsonable(x: Any) -> Any:
    """`x` as JSON/msgpack-safe data (see the module guarantees)."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (set, frozenset)):
        return [jsonable(v) for v in sorted(x, key=repr)]
    if isinstance(x, (bytes, bytearray)):
        return bytes(x).decode("utf-8", errors="replace")
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return jsonable(dataclasses.asdict(x))
    if hasattr(x, "tolist") and callable(x.tolist):  # numpy scalars and arrays
        return jsonable(x.tolist())
    return repr(x)


def derive_seed(*parts: Any) -> int:
    """A 31-bit seed from `parts` (stable across processes and Python versions)."""
    key = "\0".join(map(str, parts)).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "big") & 0x7FFFFFFF


def content_hash(question: str) -> str:
    """The sha256 (hex) of a question's text."""
    return hashlib.sha256(question.encode()).hexdigest()
