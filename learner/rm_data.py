"""Preference pairs for reward-model training, read from the forms users have.

Forms: a JSONL (or JSON) file, a Parquet file, a `datasets` `save_to_disk` directory
(a Dataset or a DatasetDict), several split files (`train.jsonl test.jsonl`), or a
directory of split files. Every form is read with the `datasets` library, in memory.

Guarantees:
- Columns are `prompt`, `chosen`, `rejected` and an optional `margin`, renamed from the
  user's names by `field_map` ({our name: their column}). `chosen` / `rejected` are text
  or a conversation (a list of {role, content} messages); `prompt` is text, a
  conversation, or absent only when the sides are conversations (an implicit prompt).
  A missing required column, or a dataset with no usable pair, raises `RmDataError`
  listing the columns present.
- Malformed rows are skipped and counted by reason in `PairData.skipped`: `missing`
  (a required value is None), `empty` (a side renders to blank text), `identical`
  (chosen == rejected), `bad_margin` (a margin that is not a finite number).
- Held-out pairs: the split named `heldout_split` (default: the first of test,
  validation, valid, eval, heldout that exists) when the data has one; else the pairs
  whose content hash (sha256 of prompt, chosen and rejected) falls below
  `heldout_frac`, so the same pair is held out whatever the file order or the run.
- `render` turns a pair side into the model's input text exactly as the `model` verifier
  feeds its classifier: text pairs stay (prompt, response) for the tokenizer's pair
  encoding; conversations are rendered whole through the tokenizer's chat template.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

HELDOUT_NAMES = ("test", "validation", "valid", "eval", "heldout")
DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class RmDataError(ValueError):
    """The preference data cannot be used as given (the message says what to change)."""


@dataclass
class Pair:
    """One preference: `chosen` beats `rejected` for `prompt` (by `margin`, when given)."""

    prompt: str | list[dict]
    chosen: str | list[dict]
    rejected: str | list[dict]
    margin: float = 0.0

    def key(self) -> str:
        """Content hash (sha256 hex) of the pair, the held-out selector."""
        blob = json.dumps([self.prompt, self.chosen, self.rejected], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class PairData:
    """Training and held-out pairs with what was skipped."""

    train: list[Pair]
    heldout: list[Pair]
    columns: list[str]
    rows: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    heldout_from: str = "hash"


def _load_files(files: list[Path]):
    """A DatasetDict with one split per file stem (several files with one format)."""
    import datasets

    kinds = {DATA_SUFFIXES.get(f.suffix.lower()) for f in files}
    if None in kinds or len(kinds) != 1:
        raise RmDataError(f"preference files must all be .jsonl/.json or all .parquet, got {[f.name for f in files]}")
    empty = [f.name for f in files if f.stat().st_size == 0]
    if empty:
        raise RmDataError(f"preference data file(s) {empty} are empty (no rows, no columns): remove them or fill them")
    splits: dict[str, list[str]] = {}
    for f in files:
        splits.setdefault(f.stem.split(".")[0] or "train", []).append(str(f))
    return datasets.load_dataset(kinds.pop(), data_files=splits, keep_in_memory=True)


def read_splits(paths: list[str | Path]) -> dict:
    """{split name: datasets.Dataset} of the data at `paths` (module docstring: the forms)."""
    import datasets

    datasets.disable_progress_bars()  # the CLI shows its own
    paths = [Path(p) for p in paths]
    for p in paths:
        if not p.exists():
            raise RmDataError(f"preference data {str(p)!r} does not exist")
    if len(paths) == 1 and paths[0].is_dir():
        d = paths[0]
        if any((d / n).exists() for n in ("dataset_info.json", "dataset_dict.json", "state.json")):
            loaded = datasets.load_from_disk(str(d), keep_in_memory=True)
            return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
        files = sorted(f for f in d.iterdir() if f.suffix.lower() in DATA_SUFFIXES)
        if not files:
            raise RmDataError(f"{str(d)!r} holds no .jsonl/.json/.parquet file and is no save_to_disk directory")
        return dict(_load_files(files))
    if any(p.is_dir() for p in paths):
        raise RmDataError("give one directory, or one or more files, not both")
    if len(paths) == 1:
        only = _load_files(paths)
        return {"train": next(iter(only.values()))}
    return dict(_load_files(paths))


def _is_conversation(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def _blank(value) -> bool:
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, list):
        return not value or all(not str(m.get("content") or "").strip() for m in value if isinstance(m, dict))
    return True


def _pair_of(row: dict, names: dict[str, str], skipped: dict[str, int]) -> Pair | None:
    """The row as a Pair, or None (counted in `skipped`)."""

    def skip(reason: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1

    chosen, rejected = row.get(names["chosen"]), row.get(names["rejected"])
    prompt = row.get(names["prompt"], None) if names["prompt"] in row else ""
    if chosen is None or rejected is None or prompt is None:
        return skip("missing")
    if (
        _blank(chosen)
        or _blank(rejected)
        or not isinstance(chosen, (str, list))
        or not isinstance(rejected, (str, list))
    ):
        return skip("empty")
    if chosen == rejected:
        return skip("identical")
    margin = row.get(names["margin"], 0.0) if names["margin"] in row else 0.0
    try:
        margin = float(0.0 if margin is None else margin)
    except (TypeError, ValueError):
        return skip("bad_margin")
    if not math.isfinite(margin):
        return skip("bad_margin")
    return Pair(prompt, chosen, rejected, margin)


def _names(columns: list[str], field_map: dict[str, str] | None, sample: dict | None) -> dict[str, str]:
    """Our column name -> the dataset's; RmDataError when a required one is absent."""
    fm = dict(field_map or {})
    unknown = sorted(set(fm) - {"prompt", "chosen", "rejected", "margin"})
    if unknown:
        raise RmDataError(f"field_map names {unknown}; it maps prompt, chosen, rejected, margin to your columns")
    names = {k: fm.get(k, k) for k in ("prompt", "chosen", "rejected", "margin")}
    conversational = sample is not None and _is_conversation(sample.get(names["chosen"]))
    required = ["chosen", "rejected"] + ([] if conversational else ["prompt"])
    missing = [f"{k} (column {names[k]!r})" for k in required if names[k] not in columns]
    if missing:
        raise RmDataError(
            f"preference data lacks {', '.join(missing)}; its columns are {sorted(columns)}: "
            "rename with field_map (e.g. --field-map prompt=question)"
        )
    return names


def load_pairs(
    paths: list[str | Path],
    *,
    field_map: dict[str, str] | None = None,
    heldout_split: str | None = None,
    heldout_frac: float = 0.05,
) -> PairData:
    """Read, validate and split preference pairs (module guarantees)."""
    splits = read_splits(paths)
    if heldout_split is not None and heldout_split not in splits:
        raise RmDataError(f"heldout_split {heldout_split!r} is not among the data's splits {sorted(splits)}")
    held_name = heldout_split or next((n for n in HELDOUT_NAMES if n in splits), None)
    columns = sorted({c for ds in splits.values() for c in ds.column_names})
    total = sum(len(ds) for ds in splits.values())
    if total == 0:
        raise RmDataError(f"preference data at {[str(p) for p in paths]} has no rows (columns: {columns})")
    first = next(ds[0] for ds in splits.values() if len(ds))
    names = _names(columns, field_map, first)
    skipped: dict[str, int] = {}
    train, held = [], []
    for name, ds in splits.items():
        for row in ds:
            pair = _pair_of(row, names, skipped)
            if pair is None:
                continue
            if held_name is not None:
                (held if name == held_name else train).append(pair)
            elif int(pair.key()[:8], 16) / 0xFFFFFFFF < heldout_frac:
                held.append(pair)
            else:
                train.append(pair)
    if not train:
        raise RmDataError(f"no usable training pair in {total} rows (skipped: {skipped or 'none'}; columns: {columns})")
    return PairData(train, held, columns, total, skipped, f"split {held_name!r}" if held_name else "hash")


def render(tokenizer, pair: Pair, side: str) -> tuple[str, str | None]:
    """(text, text_pair) of `side` ('chosen' / 'rejected'): (prompt, response) for text, which
    `learner.rm.side_ids` joins into one text as the `model` verifier does; one chat-template
    text (and None) for conversations."""
    response = getattr(pair, side)
    if isinstance(response, str) and not isinstance(pair.prompt, list):
        return pair.prompt, response
    prompt = (
        pair.prompt
        if isinstance(pair.prompt, list)
        else ([{"role": "user", "content": pair.prompt}] if pair.prompt else [])
    )
    reply = response if isinstance(response, list) else [{"role": "assistant", "content": response}]
    if not getattr(tokenizer, "chat_template", None):
        raise RmDataError(
            "conversational pairs need a tokenizer with a chat template; this model's has none "
            "(give text columns, or a base model whose tokenizer has one)"
        )
    return tokenizer.apply_chat_template(prompt + reply, tokenize=False), None
