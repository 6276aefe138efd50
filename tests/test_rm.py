"""Reward-model training (`rlbus train-rm`, issue 32): the loss by hand, the data forms,
malformed rows, the export in plain transformers and in the `model` verifier, exact resume."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from schemas.config.workers import RM_INPUT_FORM

TINY = dict(hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=256)


def rows(n: int = 24) -> list[dict]:
    """Pairs a tiny model learns in a few steps: the chosen answer is right, the rejected one says no."""
    return [{"prompt": f"{a}+{a + 1}=", "chosen": str(2 * a + 1), "rejected": f"no {2 * a + 3}"} for a in range(n)]


def rm_traj(answer: str, group: str = "g1", **params):
    """A trajectory the `model` verifier scores."""
    from schemas import Trajectory

    return Trajectory(
        run_id="r1",
        task_id="t1",
        task_msg_id="m1",
        domain="judge",
        group_id=group,
        group_size=1,
        sample_index=0,
        turns=[],
        verifier="model",
        verifier_params=params,
        policy_version=0,
        final_text=answer,
    )


def write_jsonl(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return path


def cfg(tmp_path, model, data, **kw):
    from learner.rm_train import RmConfig

    base = dict(
        data=[str(d) for d in data],
        model=str(model),
        out=str(tmp_path / "out"),
        dtype="fp32",
        lr=1e-3,
        batch_size=8,
        max_steps=4,
        max_length=64,
        micro_batch_tokens=64,
        heldout_frac=0.2,
        eval_every=0,
        save_every=0,
        progress=False,
        threads=1,
    )
    base.update(kw)
    return RmConfig(**base)


# ---------------------------------------------------------------- the loss


def test_bt_loss_matches_a_hand_computation():
    import torch

    from learner.rm import bt_loss

    rc, rr = torch.tensor([2.0, 0.5, -1.0]), torch.tensor([1.0, 1.5, -3.0])
    margin = torch.tensor([0.0, 0.5, 1.0])
    sig = lambda x: 1 / (1 + math.exp(-x))
    plain = -(math.log(sig(1.0)) + math.log(sig(-1.0)) + math.log(sig(2.0))) / 3
    assert float(bt_loss(rc, rr)) == pytest.approx(plain, abs=1e-6)
    with_margin = -(math.log(sig(1.0)) + math.log(sig(-1.5)) + math.log(sig(1.0))) / 3
    assert float(bt_loss(rc, rr, margin)) == pytest.approx(with_margin, abs=1e-6)
    centre = 0.01 * (3.0**2 + 2.0**2 + (-4.0) ** 2) / 3
    assert float(bt_loss(rc, rr, margin, 0.01)) == pytest.approx(with_margin + centre, abs=1e-6)
    # the normaliser of a micro-batch is the whole batch's pair count: parts add up to the whole
    parts = bt_loss(rc[:1], rr[:1], margin[:1], 0.01, pairs=3) + bt_loss(rc[1:], rr[1:], margin[1:], 0.01, pairs=3)
    assert float(parts) == pytest.approx(float(bt_loss(rc, rr, margin, 0.01)), abs=1e-6)


def test_micro_batched_gradient_equals_the_one_batch_gradient(tiny_model):
    import torch

    from learner.rm import accumulate, encode_pairs, load_reward_model, plan_pairs
    from learner.rm_data import Pair

    model, tok = load_reward_model(tiny_model(**TINY))
    pairs = [Pair(r["prompt"], r["chosen"] + "x" * (i % 5) * 7, r["rejected"], 0.1 * i) for i, r in enumerate(rows(6))]
    enc = encode_pairs(tok, pairs, 64)

    class C:
        center_coef, pad_id = 0.05, tok.pad_token_id

    def grads(chunks):
        model.zero_grad()
        accumulate(model, enc, [(c, True) for c in chunks], 6, C, lambda: torch.autocast("cpu", enabled=False), "cpu")
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    small = plan_pairs(enc, list(range(6)), 24)
    assert len(small) > 1 and sorted(i for c in small for i in c) == list(range(6))
    assert torch.allclose(grads(small), grads([list(range(6))]), atol=1e-6)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_shared_prompt_rows_give_the_two_row_rewards_and_gradients(tiny_model, impl):
    """One packed row per pair (prompt once) = two right-padded rows: rewards, loss, gradients;
    includes a side that is a prefix of the other and a pair truncated from the left."""
    import torch

    from learner.rm import encode_pairs, load_reward_model, micro_loss
    from learner.rm_data import Pair
    from learner.rm_shared import pack, shared_prefix_len, supports

    model, tok = load_reward_model(tiny_model(**TINY, tokenizer="bpe"))
    model.config._attn_implementation = impl
    assert supports(model)
    pairs = [Pair(r["prompt"], r["chosen"] + "x" * (i % 3), r["rejected"], 0.1 * i) for i, r in enumerate(rows(5))]
    pairs += [Pair("q", "ab", "abcd"), Pair("long " * 40, "y", "z")]
    enc = encode_pairs(tok, pairs, 24)
    assert enc.truncated == 1
    ids = pack(enc, list(range(5)), tok.pad_token_id)[0]
    assert ids.shape[1] < 2 * max(enc.lengths[:5])  # fewer positions than two padded rows
    assert shared_prefix_len([1, 2], [1, 2, 3]) == 1 and shared_prefix_len([5], [5]) == 0

    def run(shared):
        model.zero_grad()
        loss, rc, rr = micro_loss(
            model, enc, list(range(len(pairs))), len(pairs), 0.05, tok.pad_token_id, "cpu", shared
        )
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return loss.detach(), rc, rr, grads

    for two, one in zip(run(False), run(True)):
        assert torch.allclose(two, one, atol=1e-5), (two - one).abs().max()


def test_training_encodes_each_side_as_the_verifier_serves_it(tiny_model):
    """train-rm's ids are the `model` verifier's: prompt + response as one text, EOS last,
    cut from the left (so an RM trained by TRL's RewardTrainer, same form, is read as trained)."""
    from learner.rm import encode_pairs, load_reward_model
    from learner.rm_data import Pair
    from verifier_workers.verifiers.model import classifier_ids

    _, tok = load_reward_model(tiny_model(**TINY, tokenizer="bpe"))
    pairs = [Pair("12+34=", "46", "408"), Pair("57+88=", "145", "-31"), Pair("long " * 40, "yes", "no")]
    enc = encode_pairs(tok, pairs, 16)
    for i, p in enumerate(pairs):
        assert enc.chosen[i] == classifier_ids(tok, p.prompt, p.chosen, 16)
        assert enc.rejected[i] == classifier_ids(tok, p.prompt, p.rejected, 16)
        assert enc.chosen[i][-1] == tok.eos_token_id and len(enc.chosen[i]) <= 16
    assert enc.chosen[0] == tok("12+34=46")["input_ids"] + [tok.eos_token_id]
    assert enc.truncated == 1 and enc.both_truncated == 1


def test_shared_prompt_is_off_for_lora_and_sharded_models(tmp_path, tiny_model):
    from learner.rm import load_reward_model
    from learner.rm_shared import supports
    from learner.rm_train import Trainer

    lora, _ = load_reward_model(tiny_model(**TINY), lora_rank=2)
    assert not supports(lora)
    data = write_jsonl(tmp_path / "p.jsonl", rows(8))
    assert Trainer(cfg(tmp_path, tiny_model(**TINY), [data])).shared
    assert not Trainer(cfg(tmp_path, tiny_model(**TINY), [data], shared_prefix=False)).shared


# ---------------------------------------------------------------- data


def test_data_in_all_four_forms(tmp_path):
    import datasets

    from learner.rm_data import load_pairs

    items = rows(20)
    jsonl = write_jsonl(tmp_path / "prefs.jsonl", items)
    a = load_pairs([jsonl], heldout_frac=0.3)
    assert a.rows == 20 and len(a.train) + len(a.heldout) == 20 and a.heldout_from == "hash" and a.heldout

    pq = tmp_path / "prefs.parquet"
    datasets.Dataset.from_list(items).to_parquet(str(pq))
    b = load_pairs([pq], heldout_frac=0.3)
    assert [p.key() for p in b.heldout] == [p.key() for p in a.heldout]  # held out by content, whatever the form

    disk = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(items[:15]), "test": datasets.Dataset.from_list(items[15:])}
    ).save_to_disk(str(disk))
    c = load_pairs([disk])
    assert len(c.train) == 15 and len(c.heldout) == 5 and c.heldout_from == "split 'test'"

    splits = tmp_path / "splits"
    splits.mkdir()
    write_jsonl(splits / "train.jsonl", items[:12])
    write_jsonl(splits / "validation.jsonl", items[12:])
    d = load_pairs([splits])
    assert len(d.train) == 12 and len(d.heldout) == 8
    e = load_pairs([splits / "train.jsonl", splits / "validation.jsonl"], heldout_split="validation")
    assert len(e.train) == 12 and len(e.heldout) == 8


def test_conversational_pairs_render_through_the_chat_template(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    from learner.rm import encode_pairs
    from learner.rm_data import load_pairs

    convo = [
        {
            "chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
            "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}],
        }
    ] * 3
    data = load_pairs([write_jsonl(tmp_path / "c.jsonl", convo)], heldout_frac=0.0)  # implicit prompt: no column
    tok = AutoTokenizer.from_pretrained(tiny_model(tokenizer="bpe", **TINY))
    enc = encode_pairs(tok, data.train, 256)
    want = tok.apply_chat_template(convo[0]["chosen"], tokenize=False)
    assert tok.decode(enc.chosen[0]) == want and enc.chosen[0] != enc.rejected[0]


def test_malformed_rows_are_counted_and_missing_columns_listed(tmp_path):
    from learner.rm_data import RmDataError, load_pairs

    bad = rows(10) + [
        {"prompt": "p", "chosen": None, "rejected": "r"},
        {"prompt": "p", "chosen": "  ", "rejected": "r"},
        {"prompt": "p", "chosen": "same", "rejected": "same"},
        {"prompt": "p", "chosen": "a", "rejected": "b", "margin": "lots"},
    ]
    data = load_pairs([write_jsonl(tmp_path / "bad.jsonl", bad)], heldout_frac=0.0)
    assert data.skipped == {"missing": 1, "empty": 1, "identical": 1, "bad_margin": 1} and len(data.train) == 10

    renamed = [{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in rows(4)]
    path = write_jsonl(tmp_path / "renamed.jsonl", renamed)
    with pytest.raises(RmDataError, match=r"lacks chosen.*prompt.*\['bad', 'good', 'question'\]"):
        load_pairs([path])
    ok = load_pairs([path], field_map={"prompt": "question", "chosen": "good", "rejected": "bad"}, heldout_frac=0)
    assert len(ok.train) == 4
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(RmDataError):
        load_pairs([tmp_path / "empty.jsonl"])
    only_bad = write_jsonl(tmp_path / "only_bad.jsonl", bad[10:])
    with pytest.raises(RmDataError, match="no usable training pair.*columns"):
        load_pairs([only_bad])


def test_overlong_pairs_are_truncated_from_the_left_and_counted(tiny_model):
    from transformers import AutoTokenizer

    from learner.rm import encode_pairs
    from learner.rm_data import Pair

    tok = AutoTokenizer.from_pretrained(tiny_model(**TINY))
    pairs = [Pair("q" * 50, "a" * 40 + "END", "b" * 40 + "FIN"), Pair("q", "short", "x" * 80), Pair("q", "a", "b")]
    enc = encode_pairs(tok, pairs, 32)
    assert enc.truncated == 2 and enc.both_truncated == 1 and len(enc.chosen) == 3  # none dropped
    assert all(len(ids) <= 32 for ids in enc.chosen + enc.rejected)
    eos = tok.eos_token  # the response and the EOS after it survive the cut
    assert tok.decode(enc.chosen[0]).endswith("END" + eos) and tok.decode(enc.rejected[0]).endswith("FIN" + eos)


# ---------------------------------------------------------------- training, export, resume


def test_train_export_loads_in_transformers_and_scores_in_the_model_verifier(tmp_path, tiny_model):
    import torch
    from transformers import AutoModelForSequenceClassification

    from learner.rm_train import run
    from schemas import Trajectory
    from verifier_workers import registry

    data = write_jsonl(tmp_path / "prefs.jsonl", rows(40))
    report = run(cfg(tmp_path, tiny_model(**TINY), [data], max_steps=12, batch_size=8))
    out = tmp_path / "out"
    saved = json.loads((out / "rm_report.json").read_text())
    assert saved["heldout_pairs"] > 0 and saved["heldout_accuracy"] == report["heldout_accuracy"]
    assert len(saved["calibration"]) == 10 and (out / "rm_scores.png").stat().st_size > 1000
    rm = AutoModelForSequenceClassification.from_pretrained(out / "model")
    assert rm.config.num_labels == 1 and rm.config.pad_token_id is not None

    def traj(answer: str) -> Trajectory:
        return rm_traj(answer, question="3+4=", model_path=str(out / "model"))

    fn = registry.get("model")
    good, bad = fn(traj("7"), None), fn(traj("no 9"), None)
    assert 0 < good.components["score"] < 1 and good.components["logit"] > bad.components["logit"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "model")
    with torch.no_grad():
        direct = rm(**tok("3+4=7" + tok.eos_token, return_tensors="pt")).logits[0, 0]  # TRL's form, read as-is
    assert float(direct) == pytest.approx(good.components["logit"], abs=1e-5)

    # an rlbus RM of another input form (or from before the form was recorded) is refused, never scored
    from verifier_workers.errors import VerifierInfraError
    from verifier_workers.verifiers.model import check_input_form

    assert rm.config.rlbus_rm_input == RM_INPUT_FORM
    conf = json.loads((out / "model" / "config.json").read_text())
    for form in ("tokenizer(prompt, response)", None):
        old = out.parent / f"old-{form is None}"
        shutil.copytree(out, old)
        (old / "model" / "config.json").write_text(json.dumps({**conf, "rlbus_rm_input": form}))
        with pytest.raises(VerifierInfraError, match="retrain it"):
            check_input_form(old / "model")
    (old / "rm_report.json").unlink()  # no marks at all: a classifier from elsewhere, served in TRL's form
    check_input_form(old / "model")


def test_resume_is_exact(tmp_path, tiny_model):
    import torch
    from safetensors.torch import load_file

    from learner.rm_train import run

    data = write_jsonl(tmp_path / "prefs.jsonl", rows(30))
    base = tiny_model(**TINY)
    run(cfg(tmp_path / "a", base, [data], max_steps=6, center_coef=0.01))
    stopped = run(cfg(tmp_path / "b", base, [data], max_steps=6, center_coef=0.01, stop_after=3))
    assert stopped == {"stopped_at": 3, "total_steps": 6} and not (tmp_path / "b/out/model").exists()
    resumed = run(cfg(tmp_path / "b", base, [data], max_steps=6, center_coef=0.01))
    assert resumed["resumed_from"] == 3
    a, b = load_file(tmp_path / "a/out/model/model.safetensors"), load_file(tmp_path / "b/out/model/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lora_rm_exports_a_merged_plain_classifier(tmp_path, tiny_model):
    from transformers import AutoModelForSequenceClassification

    from learner.rm_train import run

    data = write_jsonl(tmp_path / "prefs.jsonl", rows(16))
    run(cfg(tmp_path, tiny_model(**TINY), [data], max_steps=2, lora_rank=4))
    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out/model")
    assert not any("lora" in k for k in rm.state_dict())


def test_base_without_a_classifier_head_is_an_error_naming_it(tmp_path):
    from transformers import ViTConfig

    from learner.rm import RmModelError, load_reward_model

    ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8).save_pretrained(tmp_path)
    with pytest.raises(RmModelError, match="model_type 'vit'.*no sequence-classification head"):
        load_reward_model(tmp_path)


def test_cli_reports_bad_data_with_exit_2(tmp_path, tiny_model, capsys):
    from rlbus.cli import _parser

    path = write_jsonl(tmp_path / "x.jsonl", [{"q": "a", "good": "b", "bad": "c"}])
    args = _parser().parse_args(
        ["train-rm", str(path), "--model", str(tiny_model(**TINY)), "--out", str(tmp_path / "o")]
    )
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "columns are ['bad', 'good', 'q']" in err and "--field-map" in err


@pytest.mark.e2e
def test_two_fsdp_ranks_train_the_one_rank_weights(tmp_path, tiny_model):
    """`--world-size 2` (gloo): both ranks step, the export is a plain classifier whose weights
    are the one-rank run's up to float rounding (the gradient is the same average)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    from learner.rm_train import run

    data = write_jsonl(tmp_path / "prefs.jsonl", rows(24))
    base = tiny_model(**TINY)
    one = run(cfg(tmp_path / "one", base, [data], max_steps=3, micro_batch_tokens=32))
    two = run(cfg(tmp_path / "two", base, [data], world_size=2, max_steps=3, save_every=2, micro_batch_tokens=32))
    assert two["world_size"] == 2 and two["steps"] == 3 and one["heldout_pairs"] == two["heldout_pairs"]
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "two/out/model").config.num_labels == 1
    a, b = (load_file(tmp_path / f"{k}/out/model/model.safetensors") for k in ("one", "two"))
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
