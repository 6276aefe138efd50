"""Task data from the files users have: JSONL, Parquet, or a local HF `datasets` directory.

One loader for every file-backed domain (`math`, `extract`, `jsonl`, `judge`; `files`
reads all rows in the default columns). A domain kind describes its default format as a
`Spec` (field -> column, the fields every row needs, and how a row becomes a
`TaskLine`); `DomainConfig.field_map` renames columns over those defaults.

Guarantees:
- Formats: `.jsonl`/`.ndjson`/`.json` (JSON lines, read line by line so one bad line is
  one skipped row), `.parquet` (`datasets.load_dataset("parquet", data_files=...,
  streaming=True)`: no cache copy), and directories: a `save_to_disk` dir
  (`datasets.load_from_disk`, a DatasetDict by `split`) or split-named files
  (`<split>.jsonl`, `<split>.parquet`, `<split>-*.parquet`, `data/<split>-*.parquet`).
  Only local paths: `datasets` runs offline (`HF_DATASETS_OFFLINE=1` before its import,
  its offline config switch after), and no hub name is ever passed.
- The same rows in any format give the same tasks (Arrow stores a missing key of a
  nested object as null, so nulls inside objects are dropped). Without an `id` column a
  row's id is its content hash (16 hex digits), the same every load.
- A malformed row (not JSON, not an object, a needed value missing, a wrong type, a
  duplicate id, gold in public params) is skipped: counted by reason in
  `DataSplit.skipped`, each of the first few logged with its place, and a summary logged.
- A config error is a `ValueError` naming the file: no rows at all, no usable row (with
  the skip counts), a mapped or needed column absent (naming the column, the field_map
  key that asked for it, and the columns present), a split absent (naming those present).
- Held-out rows are chosen by a hash of each row's prompt as the policy sees it
  (`prompt_key`): `heldout_fraction` of the split plus every row of `heldout_split`;
  training rows whose prompt is held out are dropped. `DataSplit.check()` proves the
  two sets share no prompt hash (run on every load); `heldout_sha256` pins the held-out
  set's content (comparable across runs only when equal).
- Loads are cached per (file or directory and its mtime and size, split settings, mapping, spec).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import structlog

from schemas import ChatMessage

log = structlog.get_logger()

ROOT = Path(__file__).resolve().parents[1]

JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
LOGGED_SKIPS = 5
"""Skipped rows logged one by one (the rest only in the summary)."""


class RowError(ValueError):
    """A malformed row: `reason` is its category (the skip counter's key), `detail` the specifics."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class TaskLine:
    """One task row: public prompt and params, verifier-only hidden payload, optional level."""

    id: str
    prompt: tuple[ChatMessage, ...]
    hidden: dict[str, Any] | None
    params: dict[str, Any]
    level: int | None


@dataclass(frozen=True)
class Spec:
    """A kind's default format: field -> column, the fields every row needs, and the row builder."""

    name: str
    defaults: tuple[tuple[str, str], ...]
    required: tuple[str, ...]
    build: Callable[[str, dict[str, Any]], TaskLine]
    """(id, record with prompt/hidden/params/level) -> TaskLine; raises RowError."""


def prompt_key(prompt) -> str:
    """sha256 of a prompt as the policy sees it (any sequence of ChatMessage)."""
    return hashlib.sha256(json.dumps([[m.role, m.content] for m in prompt]).encode()).hexdigest()


def content_hash(t: TaskLine) -> str:
    """sha256 of everything a task line holds (id, prompt, hidden, params, level)."""
    body = [t.id, [[m.role, m.content] for m in t.prompt], t.hidden, t.params, t.level]
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def is_heldout(key: str, fraction: float) -> bool:
    """Whether a prompt hash falls in the held-out `fraction` (a fixed function of the hash)."""
    return fraction > 0 and int(key[:16], 16) < fraction * 16**16


@dataclass(frozen=True)
class DataSplit:
    """A domain's rows: training and held-out, with what was skipped on the way."""

    source: str
    train: tuple[TaskLine, ...]
    heldout: tuple[TaskLine, ...] = ()
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def train_keys(self) -> frozenset[str]:
        return frozenset(prompt_key(t.prompt) for t in self.train)

    @property
    def heldout_keys(self) -> frozenset[str]:
        return frozenset(prompt_key(t.prompt) for t in self.heldout)

    @property
    def heldout_sha256(self) -> str:
        """sha256 over the sorted content hashes of the held-out rows."""
        return hashlib.sha256("\n".join(sorted(content_hash(t) for t in self.heldout)).encode()).hexdigest()

    def check(self) -> None:
        """Raise if any training row's prompt hash is also a held-out one (never expected)."""
        shared = self.train_keys & self.heldout_keys
        if shared:
            raise RuntimeError(f"{self.source}: {len(shared)} prompts both in training and held out")


# ---------------------------------------------------------------- reading tables


@dataclass
class Table:
    """Rows of one split: (place, row or RowError) pairs, and the column names."""

    desc: str
    columns: list[str]
    rows: Iterator[tuple[str, dict[str, Any] | RowError]]
    arrow: bool


def _json_lines(p: Path) -> Table:
    parsed: list[tuple[str, dict[str, Any] | RowError]] = []
    columns: dict[str, None] = {}
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as exc:
            parsed.append((f"{p}:{n}", RowError("invalid JSON", str(exc))))
            continue
        if not isinstance(d, dict):
            parsed.append((f"{p}:{n}", RowError("not a JSON object", type(d).__name__)))
            continue
        columns.update(dict.fromkeys(d))
        parsed.append((f"{p}:{n}", d))
    return Table(str(p), list(columns), iter(parsed), arrow=False)


def _datasets():
    """The `datasets` package in offline mode (the env var for a first import, its config if imported before)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()
    return datasets


def _arrow(desc: str, ds) -> Table:
    return Table(desc, list(ds.column_names or []), ((f"{desc}[{i}]", r) for i, r in enumerate(ds)), arrow=True)


def _parquet(files: list[Path], desc: str) -> Table:
    ds = _datasets().load_dataset(
        "parquet", data_files={"train": [str(f) for f in files]}, split="train", streaming=True
    )
    return _arrow(desc, ds)


def _split_files(d: Path) -> dict[str, list[Path]]:
    """split -> files of a directory of split-named JSONL/Parquet files (also under `data/`)."""
    out: dict[str, list[Path]] = {}
    for f in sorted([*d.glob("*"), *d.glob("data/*")]):
        if f.is_file() and (f.suffix == ".parquet" or f.suffix in JSON_SUFFIXES):
            out.setdefault(f.stem.split("-", 1)[0], []).append(f)
    return out


def _directory(d: Path, split: str) -> Table:
    if (d / "dataset_dict.json").exists() or (d / "state.json").exists():
        ds = _datasets().load_from_disk(str(d))
        if hasattr(ds, "keys"):  # a DatasetDict
            if split not in ds:
                raise ValueError(f"{d}: no split {split!r}; splits present: {sorted(ds)}")
            return _arrow(f"{d}[{split}]", ds[split])
        if split != "train":
            raise ValueError(
                f"{d} holds one dataset (split 'train'), not split {split!r}; "
                "save a DatasetDict, or name the split 'train'"
            )
        return _arrow(str(d), ds)
    files = _split_files(d).get(split)
    if not files:
        raise ValueError(
            f"{d}: no data for split {split!r} (a save_to_disk dir, or files named "
            f"{split}.jsonl / {split}-*.parquet); splits present: {sorted(_split_files(d))}"
        )
    if all(f.suffix == ".parquet" for f in files):
        return _parquet(files, f"{d}[{split}]")
    if len(files) == 1 and files[0].suffix in JSON_SUFFIXES:
        return _json_lines(files[0])
    raise ValueError(
        f"{d}: split {split!r} mixes formats or JSONL shards ({[f.name for f in files]}); "
        "use one JSONL file or Parquet shards per split"
    )


def open_table(path: Path, split: str = "train") -> Table:
    """The rows of `split` of a local file or directory (see the module guarantees)."""
    if path.is_dir():
        return _directory(path, split)
    if not path.is_file():
        raise ValueError(f"task file {path} not found")
    if split != "train":
        raise ValueError(
            f"{path} is one file (split 'train'), not split {split!r}; point data at a "
            "directory of split files or a save_to_disk dir"
        )
    if path.suffix == ".parquet":
        return _parquet([path], str(path))
    if path.suffix in JSON_SUFFIXES:
        return _json_lines(path)
    raise ValueError(
        f"task file {path}: unknown format {path.suffix!r}; use .jsonl, .parquet, or a datasets save_to_disk directory"
    )


# ---------------------------------------------------------------- rows -> task lines


def chat_prompt(raw: Any) -> tuple[ChatMessage, ...]:
    """A prompt column's value as chat messages: text (one user message) or [{role, content}, ...]."""
    if isinstance(raw, str) and raw.strip():
        return (ChatMessage(role="user", content=raw),)
    if isinstance(raw, list) and raw and all(isinstance(m, dict) for m in raw):
        try:
            return tuple(ChatMessage(**m) for m in raw)
        except ValueError as exc:
            raise RowError(
                "bad prompt", f"messages need role (system/user/assistant/tool) and content: {exc}"
            ) from None
    raise RowError("bad prompt", f"a non-empty string or list of {{role, content}}, not {type(raw).__name__}")


def level_of(raw: Any) -> int | None:
    """A level column's value as an int (None when absent)."""
    if raw is None:
        return None
    try:
        level = int(raw)
    except (TypeError, ValueError):
        raise RowError("bad level", f"an integer, not {raw!r}") from None
    if isinstance(raw, bool) or (isinstance(raw, float) and raw != level):
        raise RowError("bad level", f"an integer, not {raw!r}")
    return level


def _drop_nulls(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _drop_nulls(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_drop_nulls(x) for x in v]
    return v


def _record(row: dict[str, Any], mapping: dict[str, str], arrow: bool) -> dict[str, Any]:
    """Canonical fields of a row: id, prompt, level, and hidden/params objects."""
    rec: dict[str, Any] = {"hidden": {}, "params": {}}
    for target in sorted(mapping, key=lambda t: "." in t):  # whole objects first, then their keys
        col = mapping[target]
        v = row.get(col)
        if v is None:
            continue
        if arrow:
            v = _drop_nulls(v)
        bucket, _, key = target.partition(".")
        if target in ("hidden", "params"):
            if not isinstance(v, dict):
                raise RowError(f"{target} not an object", f"column {col!r} holds {type(v).__name__}")
            rec[target] = {**v, **rec[target]}
        elif target == "gold" or key:
            rec["hidden" if target == "gold" else bucket][key or "gold"] = v
        else:
            rec[target] = v
    return rec


def _check_columns(label: str, table: Table, mapping: dict[str, str], asked: set[str], spec: Spec) -> None:
    for target, col in mapping.items():
        if col in table.columns or (target == "id" and target not in asked):
            continue
        if target in asked or target in spec.required:
            how = f"field_map.{target}" if target in asked else f"{target}, the {spec.name} default"
            hint = f"; set {label}.field_map.{target} to one of them" if label.startswith("sampler.") else ""
            raise ValueError(
                f"{label}: column {col!r} ({how}) not in {table.desc}; columns present: {table.columns}{hint}"
            )


def _line(spec: Spec, rec: dict[str, Any], id_col: bool) -> TaskLine:
    for f in spec.required:
        present = rec["hidden"].get("gold") if f == "gold" else rec.get(f)
        if present is None or present == "":
            raise RowError(f"missing {f}")
    if id_col and rec.get("id") is None:
        raise RowError("missing id")
    try:
        line = spec.build("" if not id_col else str(rec["id"]), rec)
    except RowError:
        raise
    except (ValueError, TypeError, KeyError) as exc:  # a builder's type checks (pydantic's included)
        raise RowError("bad value", repr(exc)) from None
    if not id_col:
        line = TaskLine(content_hash(line)[:16], line.prompt, line.hidden, line.params, line.level)
    return line


def read_lines(label: str, table: Table, spec: Spec, field_map: dict[str, str]) -> tuple[list[TaskLine], Counter]:
    """Every usable row of a table, and the skipped ones counted by reason."""
    mapping = {**dict(spec.defaults), **field_map}
    skipped: Counter = Counter()
    out, seen, n_rows, checked = [], set(), 0, False
    for where, row in table.rows:
        n_rows += 1
        if not checked and isinstance(row, dict):  # columns are checked once a row parsed at all
            _check_columns(label, table, mapping, set(field_map), spec)
            checked = True
        try:
            if isinstance(row, RowError):
                raise row
            line = _line(spec, _record(row, mapping, table.arrow), mapping["id"] in table.columns)
            if line.id in seen:
                raise RowError("duplicate id", line.id)
        except RowError as exc:
            skipped[exc.reason] += 1
            if sum(skipped.values()) <= LOGGED_SKIPS:
                log.warning("sampler.data_row_skipped", domain=label, where=where, reason=str(exc))
            continue
        seen.add(line.id)
        out.append(line)
    if not n_rows:
        raise ValueError(f"{label}: {table.desc} has no rows (columns present: {table.columns})")
    if not out:
        hint = "; JSONL needs one JSON object per line" if set(skipped) == {"invalid JSON"} else ""
        raise ValueError(
            f"{label}: {table.desc} has no usable row: {n_rows} skipped {dict(skipped)}; columns "
            f"present: {table.columns}; needed: {[mapping[f] for f in spec.required]}{hint}"
        )
    return out, skipped


# ---------------------------------------------------------------- splits


def resolve(data: str, default: Path | None = None) -> Path:
    """The data path (relative paths from the cwd, else from the repository root)."""
    if not data:
        if default is None:
            raise ValueError("no data file given")
        return default
    p = Path(data)
    return p if p.is_absolute() or p.exists() else ROOT / p


def _stamp(p: Path) -> tuple[int, int]:
    """A change stamp of a file or directory: (newest mtime, total size) of its files."""
    files = [f for f in p.rglob("*") if f.is_file()] if p.is_dir() else [p] if p.exists() else []
    stats = [f.stat() for f in files]
    return max([0, *(s.st_mtime_ns for s in stats)]), sum(s.st_size for s in stats)


def split_rows(
    source: str, lines: list[TaskLine], heldout: list[TaskLine], fraction: float, skipped: Counter
) -> DataSplit:
    """Training and held-out rows: `heldout` plus the `fraction` of `lines` whose prompt hash
    falls in it; a training row whose prompt is held out is dropped (counted in `skipped`)."""
    held = list(heldout)
    pinned = {prompt_key(t.prompt) for t in held}
    train = []
    for t in lines:
        key = prompt_key(t.prompt)
        if key in pinned:
            skipped["prompt in heldout_split"] += 1
        elif is_heldout(key, fraction):
            held.append(t)
        else:
            train.append(t)
    if not train:
        raise ValueError(f"{source}: all {len(lines)} rows are held out; lower heldout_fraction or check heldout_split")
    out = DataSplit(source, tuple(train), tuple(held), dict(skipped))
    out.check()
    return out


@lru_cache(maxsize=32)
def _load(
    label: str,
    path: Path,
    stamp: tuple[int, int],
    split: str,
    heldout_split: str,
    fraction: float,
    fmap: tuple[tuple[str, str], ...],
    spec: Spec,
) -> DataSplit:
    table = open_table(path, split)
    lines, skipped = read_lines(label, table, spec, dict(fmap))
    heldout: list[TaskLine] = []
    if heldout_split:
        heldout, held_skipped = read_lines(label, open_table(path, heldout_split), spec, dict(fmap))
        skipped.update({f"{heldout_split}: {k}": n for k, n in held_skipped.items()})
    out = split_rows(f"{label}: {table.desc}", lines, heldout, fraction, skipped)
    if skipped:
        log.warning("sampler.data_rows_skipped", domain=label, source=table.desc, skipped=dict(skipped))
    log.info(
        "sampler.data_loaded",
        domain=label,
        source=table.desc,
        train=len(out.train),
        heldout=len(out.heldout),
        heldout_sha256=out.heldout_sha256,
        skipped=sum(skipped.values()),
    )
    return out


def load_split(
    label: str,
    path: Path,
    spec: Spec,
    *,
    split: str = "train",
    heldout_split: str = "",
    heldout_fraction: float = 0.0,
    field_map: dict[str, str] | None = None,
) -> DataSplit:
    """The rows of a local dataset, split into training and held-out (cached; see the module guarantees)."""
    fmap = tuple(sorted((field_map or {}).items()))
    return _load(label, path, _stamp(path), split, heldout_split, heldout_fraction, fmap, spec)


def domain_split(ctx, spec: Spec, default: Path | None = None) -> DataSplit:
    """The rows of a config domain's `data` (`default` when empty), by its split settings."""
    dc = ctx.dc
    return load_split(
        f"sampler.domains.{ctx.name}",
        resolve(dc.data, default),
        spec,
        split=dc.split,
        heldout_split=dc.heldout_split,
        heldout_fraction=dc.heldout_fraction,
        field_map=dc.field_map,
    )
