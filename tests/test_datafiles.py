"""Data in the formats users have (`producers.datafile`): JSONL, Parquet and `datasets`
dirs give the same tasks; `field_map` renames columns; held-out rows never train (proved
by prompt hashes over many draws); malformed rows are skipped and counted; an empty
dataset, a missing column or a missing split is a config error naming what is there."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import datasets
import msgpack
import pytest

from producers.datafile import DataSplit, TaskLine, prompt_key
from producers.domains import make_source
from schemas import ChatMessage, encode
from schemas.config import load_config

ROOT = Path(__file__).resolve().parents[1]

ROWS = [  # the default JSONL-kind format; nested objects differ row to row (Arrow unions them)
    {
        "id": f"q{i}",
        "prompt": f"Extract the fields of record {i}.",
        "hidden": {"gold": {"name": f"n{i}", "year": 1900 + i} if i % 2 else {"city": f"c{i}"}},
        "params": {"note": f"p{i}"} if i % 3 else None,
        "level": 1 + i % 2,
    }
    for i in range(12)
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_all_formats(tmp_path: Path, rows: list) -> dict[str, Path]:
    """The same rows as a JSONL file, a Parquet file, a save_to_disk Dataset, a DatasetDict
    and a directory of split-named files."""
    ds = datasets.Dataset.from_list(rows)
    split_dir = tmp_path / "hub_layout" / "data"
    split_dir.mkdir(parents=True)
    ds.to_parquet(str(split_dir / "train-00000-of-00001.parquet"))
    ds.to_parquet(str(tmp_path / "rows.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(str(tmp_path / "saved_dict"))
    return {
        "jsonl": write_jsonl(tmp_path / "rows.jsonl", rows),
        "parquet": tmp_path / "rows.parquet",
        "saved": tmp_path / "saved",
        "saved_dict": tmp_path / "saved_dict",
        "split_files": tmp_path / "hub_layout",
    }


def config(tmp_path: Path, body: str):
    p = tmp_path / "run.toml"
    p.write_text(body)
    return load_config(p)


def domain(tmp_path: Path, data: Path, kind: str = "jsonl", extra: str = ""):
    verifier = 'verifier = "extract"\n' if kind == "jsonl" else ""
    cfg = config(tmp_path, f'[sampler.domains.d]\nkind = "{kind}"\n{verifier}data = "{data}"\nmax_level = 2\n{extra}')
    return cfg, make_source("r1", "d", cfg)


def drawn(cfg, src, n: int, seed: int = 0) -> list:
    rng, dc = random.Random(seed), cfg.sampler.domains["d"]
    return [src.make_task(rng, rng.randint(dc.min_level, dc.max_level), i) for i in range(n)]


def as_data(d) -> tuple:
    return d.task.model_dump(exclude={"msg_id", "created_at"}), d.hidden


def test_jsonl_parquet_and_datasets_dirs_give_identical_tasks(tmp_path):
    paths = write_all_formats(tmp_path, ROWS)
    made = {}
    for fmt, path in paths.items():
        cfg, src = domain(tmp_path, path)
        made[fmt] = (src.data.train, [as_data(d) for d in drawn(cfg, src, 40)])
    first = made["jsonl"]
    assert len(first[0]) == len(ROWS) and {d[0]["difficulty"] for d in first[1]} == {1, 2}
    for fmt, got in made.items():
        assert got == first, fmt
    q1 = next(t for t in first[0] if t.id == "q1")
    assert q1.hidden == {"gold": {"name": "n1", "year": 1901}} and q1.params == {"note": "p1"} and q1.level == 2
    assert next(t for t in first[0] if t.id == "q0").params == {}


def test_math_kind_reads_parquet_like_jsonl(tmp_path):
    rows = [{"id": f"m{i}", "problem": f"What is {i} + {i}?", "answer": str(2 * i), "level": None} for i in range(6)]
    write_jsonl(tmp_path / "m.jsonl", rows)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "m.parquet"))
    out = []
    for name in ("m.jsonl", "m.parquet"):
        cfg, src = domain(tmp_path, tmp_path / name, kind="math")
        out.append([as_data(d) for d in drawn(cfg, src, 20)])
    assert out[0] == out[1]
    task, hidden = out[0][0]
    assert hidden == {"gold": str(2 * int(task["verifier_params"]["problem_id"][1:]))}
    assert task["prompt"][0]["content"].endswith("\\boxed{}.") and "gold" not in task["verifier_params"]


def test_field_map_names_question_answer_id_and_metadata_columns(tmp_path):
    rows = [
        {
            "uid": 100 + i,
            "question": f"Compute {i} * 3.",
            "solution": i * 3,
            "difficulty": 1 + i % 2,
            "subject": "arithmetic",
            "source": "x",
        }
        for i in range(8)
    ]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "q.parquet"))
    cfg, src = domain(
        tmp_path,
        tmp_path / "q.parquet",
        kind="math",
        extra=(
            'field_map = { prompt = "question", gold = "solution", id = "uid", level = "difficulty", '
            '"params.subject" = "subject", "hidden.origin" = "source" }\n'
        ),
    )
    tasks = drawn(cfg, src, 30)
    for d in tasks:
        uid = int(d.task.verifier_params["problem_id"])
        assert d.task.prompt[0].content.startswith(f"Compute {uid - 100} * 3.")
        assert d.task.verifier_params == {"problem_id": str(uid), "subject": "arithmetic"}
        assert d.task.difficulty == 1 + (uid - 100) % 2
        assert d.hidden == {"gold": str((uid - 100) * 3), "origin": "x"}
        wire = msgpack.unpackb(encode(d.task))
        assert "gold" not in json.dumps(wire) and "origin" not in json.dumps(wire)
    # a judge-style file: the answer column becomes the hidden reference
    write_jsonl(tmp_path / "j.jsonl", [{"q": "Capital of France?", "a": "Paris"}, {"q": "2+2?", "a": "4"}])
    cfg, src = domain(tmp_path, tmp_path / "j.jsonl", extra='field_map = { prompt = "q", "hidden.reference" = "a" }\n')
    hidden = sorted(h["reference"] for _, h, _ in src.items)
    assert hidden == ["4", "Paris"] and all(f["hidden_ref"] for f, _, _ in src.items)
    # no id column: ids are content hashes, the same every load, distinct per row
    ids = [t.id for t in src.data.train]
    assert len(set(ids)) == 2 and all(len(i) == 16 for i in ids)
    assert [
        t.id
        for t in domain(
            tmp_path, tmp_path / "j.jsonl", extra='field_map = { prompt = "q", "hidden.reference" = "a" }\n'
        )[1].data.train
    ] == ids


@pytest.mark.parametrize(
    "fmap,match",
    [
        ('{ question = "q" }', "field_map keys \\['question'\\] unknown"),
        ('{ prompt = "" }', "mapped to an empty column"),
        ('{ gold = "a", "hidden.gold" = "b" }', "both gold and hidden.gold"),
    ],
)
def test_field_map_keys_are_checked_by_the_config(tmp_path, fmap, match):
    with pytest.raises(ValueError, match=match):
        config(tmp_path, f'[sampler.domains.d]\nkind = "jsonl"\nfield_map = {fmap}\n')


def math_rows(n: int) -> list[dict]:
    return [{"id": f"h{i}", "problem": f"Problem number {i}: what is {i} - 1?", "answer": str(i - 1)} for i in range(n)]


def test_heldout_rows_never_train_over_many_draws(tmp_path):
    data = write_jsonl(tmp_path / "h.jsonl", math_rows(300))
    cfg, src = domain(tmp_path, data, kind="math", extra="heldout_fraction = 0.2\n")
    split: DataSplit = src.data
    assert len(split.train) + len(split.heldout) == 300 and 30 < len(split.heldout) < 90
    held_keys, held_ids = split.heldout_keys, {t.id for t in split.heldout}
    assert not held_keys & split.train_keys
    split.check()
    seen = set()
    for d in drawn(cfg, src, 4000, seed=7):
        assert prompt_key(d.task.prompt) not in held_keys  # the hash of what the policy is shown
        assert d.task.verifier_params["problem_id"] not in held_ids
        seen.add(d.task.verifier_params["problem_id"])
    assert seen == {t.id for t in split.train}  # the draws reach every training row, and only those
    # the held-out set is pinned by content: the same in another format, changed by one gold
    datasets.Dataset.from_list(math_rows(300)).to_parquet(str(tmp_path / "h.parquet"))
    again = domain(tmp_path, tmp_path / "h.parquet", kind="math", extra="heldout_fraction = 0.2\n")[1].data
    assert again.heldout_sha256 == split.heldout_sha256 and again.heldout == split.heldout
    changed = math_rows(300)
    victim = int(next(iter(held_ids))[1:])
    changed[victim]["answer"] = "wrong"
    write_jsonl(tmp_path / "h2.jsonl", changed)
    other = domain(tmp_path, tmp_path / "h2.jsonl", kind="math", extra="heldout_fraction = 0.2\n")[1].data
    assert other.heldout_keys == held_keys and other.heldout_sha256 != split.heldout_sha256


def test_identical_prompts_fall_on_one_side_and_the_check_can_fail(tmp_path):
    rows = [{"id": f"{k}{i}", "problem": f"Same question {i}", "answer": "1"} for i in range(100) for k in "ab"]
    _, src = domain(tmp_path, write_jsonl(tmp_path / "dup.jsonl", rows), kind="math", extra="heldout_fraction = 0.3\n")
    held = {t.id[1:] for t in src.data.heldout}
    assert held and all(f"a{i}" in {t.id for t in src.data.heldout} for i in held)
    assert not {t.id[1:] for t in src.data.train} & held
    line = TaskLine("x", (ChatMessage(role="user", content="q"),), None, {}, None)
    with pytest.raises(RuntimeError, match="both in training and held out"):
        DataSplit("bad", (line,), (line,)).check()


def test_heldout_split_is_held_out_whole_and_its_prompts_leave_training(tmp_path):
    train = datasets.Dataset.from_list(math_rows(10))
    test = datasets.Dataset.from_list(
        [
            {"id": "t0", "problem": "A test-only problem", "answer": "0"},
            {"id": "t1", **{k: v for k, v in math_rows(4)[3].items() if k != "id"}},
        ]
    )
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "dd"))
    cfg, src = domain(tmp_path, tmp_path / "dd", kind="math", extra='heldout_split = "test"\n')
    assert {t.id for t in src.data.heldout} == {"t0", "t1"}
    assert "h3" not in {t.id for t in src.data.train} and len(src.data.train) == 9
    assert src.data.skipped == {"prompt in heldout_split": 1}
    assert all(d.task.verifier_params["problem_id"] != "h3" for d in drawn(cfg, src, 200))
    with pytest.raises(ValueError, match="no split 'validation'; splits present: \\['test', 'train'\\]"):
        domain(tmp_path, tmp_path / "dd", kind="math", extra='split = "validation"\n')


def test_malformed_parquet_rows_are_skipped_and_counted(tmp_path):
    rows = [
        {"id": "ok1", "problem": "1+1?", "answer": "2", "level": "1"},
        {"id": "ok2", "problem": "2+2?", "answer": "4", "level": "2"},
        {"id": None, "problem": "no id", "answer": "0", "level": None},
        {"id": "noans", "problem": "3+3?", "answer": None, "level": None},
        {"id": "badlvl", "problem": "4+4?", "answer": "8", "level": "hard"},
        {"id": "ok1", "problem": "dup", "answer": "1", "level": None},
    ]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "bad.parquet"))
    cfg, src = domain(tmp_path, tmp_path / "bad.parquet", kind="math")
    assert src.data.skipped == {"missing id": 1, "missing gold": 1, "bad level": 1, "duplicate id": 1}
    assert [t.id for t in src.data.train] == ["ok1", "ok2"]
    assert {d.task.verifier_params["problem_id"] for d in drawn(cfg, src, 30)} == {"ok1", "ok2"}


def test_empty_data_and_missing_columns_are_config_errors_naming_the_columns(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="has no rows"):
        domain(tmp_path, tmp_path / "empty.jsonl")
    datasets.Dataset.from_dict({"question": [], "answer": []}).to_parquet(str(tmp_path / "empty.parquet"))
    with pytest.raises(ValueError, match=r"has no rows \(columns present: \['question', 'answer'\]\)"):
        domain(tmp_path, tmp_path / "empty.parquet", kind="math")
    datasets.Dataset.from_list([{"question": "q", "answer": "a"}]).to_parquet(str(tmp_path / "qa.parquet"))
    with pytest.raises(
        ValueError,
        match=r"column 'problem' \(prompt, the math default\) not in .*qa.parquet; "
        r"columns present: \['question', 'answer'\]; set sampler.domains.d."
        "field_map.prompt to one of them",
    ):
        domain(tmp_path, tmp_path / "qa.parquet", kind="math")
    with pytest.raises(
        ValueError, match=r"column 'uid' \(field_map.id\) not in .*columns present: \['question', 'answer'\]"
    ):
        domain(
            tmp_path, tmp_path / "qa.parquet", kind="math", extra='field_map = { prompt = "question", id = "uid" }\n'
        )
    write_jsonl(tmp_path / "all_bad.jsonl", [{"id": 1, "prompt": 5}, {"id": 2, "prompt": ""}])
    (tmp_path / "all_bad.jsonl").write_text((tmp_path / "all_bad.jsonl").read_text() + "not json\n")
    with pytest.raises(
        ValueError,
        match=r"no usable row: 3 skipped \{'bad prompt': 1, 'missing prompt': 1, "
        r"'invalid JSON': 1\}; columns present: \['id', 'prompt'\]",
    ):
        domain(tmp_path, tmp_path / "all_bad.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown format '.csv'"):
        domain(tmp_path, tmp_path / "x.csv")
    with pytest.raises(ValueError, match="not split 'test'"):
        domain(tmp_path, tmp_path / "qa.parquet", kind="math", extra='split = "test"\n')
    with pytest.raises(ValueError, match="heldout_fraction"):
        domain(tmp_path, tmp_path / "qa.parquet", kind="math", extra="heldout_fraction = 1.0\n")


def test_loading_needs_no_hub(tmp_path):
    datasets.Dataset.from_list(math_rows(3)).to_parquet(str(tmp_path / "p.parquet"))
    code = (
        "import datasets.config as c; from pathlib import Path; from producers.datafile import load_split;"
        "from producers.domains.math import MATH;"
        f"s = load_split('x', Path({str(tmp_path / 'p.parquet')!r}), MATH);"
        "print(len(s.train), c.HF_HUB_OFFLINE)"
    )  # datasets imported first: the env var alone would not do
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["3", "True"]
