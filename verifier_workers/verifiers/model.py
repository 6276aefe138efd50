"""The `model` verifier: a learned reward model or an LLM judge, on CPU, from a local path.

The model is `verifier_params["model_path"]`, else env `RLBUS_REWARD_MODEL`: a local
Hugging Face directory, loaded with `local_files_only` (never downloaded). Its kind is
`verifier_params["judge"]` (`classifier` | `causal`), else read from the config:
`...ForSequenceClassification` architectures are classifiers, anything else a causal LM.

- classifier (reward model): scores question + response as one text with the tokenizer's
  EOS appended (`classifier_ids`: `rlbus train-rm`'s and TRL RewardTrainer's input form,
  so RMs trained by either are read as trained), pooled at the EOS; the score is
  sigmoid(logit) for a one-label head, else the softmax probability of label
  `positive_label` (default: the last label).
- causal (LLM judge): the judge prompt `JUDGE_TEMPLATE` (question, reference, rubric,
  response) ends in "Answer:"; the score is P(yes-like) / (P(yes-like) + P(no-like)) of
  the next token, where yes-like/no-like are the first tokens of "Yes"/" Yes"/"yes"/
  " yes" and the "No" forms, minus any token in both sets.

The question is `verifier_params["question"]`, else the trajectory's first prompt turn.
The hidden payload may hold `reference` (a gold answer) and `rubric` for the judge.

Guarantees:
- Components: `score` in [0, 1] and `correct` (1.0 iff score >= `threshold`, default
  0.5), plus `logit` (the raw reward) for a one-label classifier. The default scalar is
  `score` (a config can weight `correct` instead; `verifier.rm.normalize` replaces
  `score` with a normalised logit, `verifier_workers.rm_serving`).
- `verify_model_batch` scores many trajectories with one forward per model, or one per
  length bucket when `max_padding` < 1 (rows right-padded, each pooled at its own last
  token), equal to scoring them one by one up to float rounding; `verify_model` is a
  batch of one. The verifier worker batches through
  `verify_model.batched`.
- Input is truncated from the left to `max_length` tokens (default 1024, capped by the
  model's positions), so the response and the judge's "Answer:" are always seen.
- `verifier_params.mode = "pairwise"` (`verifier_workers.rm_pairwise`): the worker's batcher
  holds the group and replaces `score` with the sample's win rate in it; `verify_model`
  alone refuses it (`VerifierInputError`: one trajectory has no group); another mode than
  pointwise/pairwise is a `VerifierInputError`.
- Each (path, kind) is loaded once per process (thread-safe) in eval mode, float32, CPU,
  and again when its config.json changes (a model re-exported in place).
- No model configured raises `VerifierInputError` (the task is unusable); a configured
  path that is absent or fails to load raises `VerifierInfraError` (this node lacks the
  model: retried, then dead-lettered), also when a directory that scored before has gone
  missing since. Empty or odd responses are scored, status "ok".
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas import Trajectory
from schemas.config.workers import RM_INPUT_FORM
from verifier_workers.errors import VerifierInfraError
from verifier_workers.rm_pairwise import MODES, is_pairwise
from verifier_workers.verdict import Verdict, VerifierInputError

ENV = "RLBUS_REWARD_MODEL"
KINDS = ("classifier", "causal")
DEFAULT_MAX_LENGTH = 1024
JUDGE_TEMPLATE = (
    "You are grading a response.\n"
    "Question: {question}\n"
    "Reference answer: {reference}\n"
    "Rubric: {rubric}\n"
    "Response: {response}\n"
    "Is the response correct? Answer Yes or No.\n"
    "Answer:"
)
YES_FORMS = ("Yes", " Yes", "yes", " yes", "YES")
NO_FORMS = ("No", " No", "no", " no", "NO")


@dataclass
class Loaded:
    """A model ready to score."""

    kind: str
    model: Any
    tokenizer: Any
    max_positions: int
    yes_ids: list[int]
    no_ids: list[int]


_lock = threading.Lock()
_cache: dict[tuple[str, str, int], Loaded] = {}


def model_path(params: dict) -> str:
    """The configured model directory (VerifierInputError when none is)."""
    path = params.get("model_path") or os.environ.get(ENV, "")
    if not isinstance(path, str) or not path:
        raise VerifierInputError(f"model verifier without verifier_params.model_path or ${ENV}")
    return path


def kind_of(path: Path, asked: str | None) -> str:
    """`classifier` or `causal`: as asked, else from the config's architectures."""
    if asked:
        if asked not in KINDS:
            raise VerifierInputError(f"model verifier judge={asked!r} is not one of {KINDS}")
        return asked
    try:
        archs = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError) as exc:
        raise VerifierInfraError(f"reward model {str(path)!r} has no readable config.json: {exc}") from exc
    return "classifier" if any(a.endswith("ForSequenceClassification") for a in archs) else "causal"


def check_input_form(path: Path) -> None:
    """Refuse (infrastructure error: retried, then dead-lettered, never a score) a reward model
    `rlbus train-rm` exported for another input form than the one served (`RM_INPUT_FORM`), or
    before the form was recorded (a `rm_report.json` beside the model and no `rlbus_rm_input`).
    A classifier from elsewhere (no such marks) is served in TRL's form."""
    try:
        form = json.loads((path / "config.json").read_text()).get("rlbus_rm_input")
    except (OSError, ValueError) as exc:
        raise VerifierInfraError(f"reward model {str(path)!r} has no readable config.json: {exc}") from exc
    ours = (path.parent / "rm_report.json").exists()
    if form != RM_INPUT_FORM and (form is not None or ours):
        raise VerifierInfraError(
            f"reward model {str(path)!r} was trained for input form {form or 'tokenizer(prompt, response)'!r}, "
            f"but the model verifier serves {RM_INPUT_FORM!r}: retrain it with `rlbus train-rm` "
            "(scoring it anyway would give rewards it never learned)"
        )


def _first_token_ids(tokenizer, forms: tuple[str, ...]) -> set[int]:
    ids = set()
    for form in forms:
        enc = tokenizer(form, add_special_tokens=False)["input_ids"]
        if enc:
            ids.add(enc[0])
    return ids


def _load(path: Path, kind: str) -> Loaded:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    cls = AutoModelForSequenceClassification if kind == "classifier" else AutoModelForCausalLM
    if kind == "classifier":
        check_input_form(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = cls.from_pretrained(path, local_files_only=True, torch_dtype=torch.float32).eval()
    except (OSError, ValueError) as exc:
        raise VerifierInfraError(f"reward model {str(path)!r} failed to load as {kind}: {exc}") from exc
    tokenizer.truncation_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    yes, no = _first_token_ids(tokenizer, YES_FORMS), _first_token_ids(tokenizer, NO_FORMS)
    if kind == "causal" and not (yes - no and no - yes):
        raise VerifierInputError(f"judge model {str(path)!r}: its tokenizer cannot tell Yes from No")
    positions = int(getattr(model.config, "max_position_embeddings", DEFAULT_MAX_LENGTH) or DEFAULT_MAX_LENGTH)
    return Loaded(kind, model, tokenizer, positions, sorted(yes - no), sorted(no - yes))


def load(path: str, kind: str | None = None) -> Loaded:
    """The model at `path` (cached per process); see the module docstring for errors."""
    p = Path(path)
    if not p.is_dir():
        raise VerifierInfraError(f"reward model directory {path!r} not found on this node")
    resolved = kind_of(p, kind)
    try:
        stamp = (p / "config.json").stat().st_mtime_ns
    except OSError as exc:
        raise VerifierInfraError(f"reward model directory {path!r} vanished while loading: {exc}") from exc
    key = (str(p.resolve()), resolved, stamp)  # a model re-exported in place is loaded again
    with _lock:
        if key not in _cache:
            _cache[key] = _load(p, resolved)
        return _cache[key]


def _question(traj: Trajectory) -> str:
    q = traj.verifier_params.get("question")
    if isinstance(q, str):
        return q
    return next((t.text for t in traj.turns if t.role == "prompt"), "")


def length_buckets(lengths: list[int], max_padding: float) -> list[list[int]]:
    """Row indices sorted longest first and cut so that no forward pads more than
    `max_padding` of its positions (>= 1: a single forward for all rows)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    chunks: list[list[int]] = []
    real = 0
    for i in order:
        cur = chunks[-1] if chunks else None
        if cur is not None and 1.0 - (real + lengths[i]) / ((len(cur) + 1) * max(1, lengths[cur[0]])) <= max_padding:
            cur.append(i)
            real += lengths[i]
        else:
            chunks.append([i])
            real = lengths[i]
    return chunks


def row_logits(m: Loaded, rows: list[list[int]], max_padding: float = 1.0) -> list:
    """Each row's logits (the classifier's pooled row; the judge's last position), from
    right-padded forwards of length buckets (`length_buckets`): the head and the causal
    mask see each row's real tokens only, so a row scores as it would alone."""
    import torch

    pad = m.tokenizer.pad_token_id
    rows = [r or [pad] for r in rows]
    out: list = [None] * len(rows)
    for chunk in length_buckets([len(r) for r in rows], max_padding):
        width = max(len(rows[i]) for i in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for k, i in enumerate(chunk):
            ids[k, : len(rows[i])] = torch.tensor(rows[i], dtype=torch.long)
            mask[k, : len(rows[i])] = 1
        with torch.inference_mode():
            logits = m.model(input_ids=ids, attention_mask=mask).logits.float()
        for k, i in enumerate(chunk):
            out[i] = logits[k] if m.kind == "classifier" else logits[k, len(rows[i]) - 1]
    return out


def classifier_score(logits, positive: int | None) -> float:
    """Probability that the reward model calls the response good, from one row of logits."""
    import torch

    if logits.numel() == 1:
        return float(torch.sigmoid(logits[0]))
    label = logits.numel() - 1 if positive is None else int(positive)
    return float(torch.softmax(logits, -1)[label])


def judge_score(m: Loaded, logits) -> float:
    """P(yes) / (P(yes) + P(no)) from the judge's next-token logits."""
    import torch

    probs = torch.softmax(logits, -1)
    yes, no = float(probs[m.yes_ids].sum()), float(probs[m.no_ids].sum())
    return yes / (yes + no) if yes + no > 0 else 0.5


def classifier_ids(tokenizer, question: str, response: str, max_length: int) -> list[int]:
    """A reward model's input: question + response as one text, EOS appended unless already
    last, the last `max_length` ids kept (the left end is cut, the response and EOS stay)."""
    ids = tokenizer(question + response)["input_ids"]
    eos = tokenizer.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos):
        ids = ids + [eos]
    return ids[-max_length:]


def score_classifier(m: Loaded, question: str, response: str, max_length: int, positive: int | None) -> float:
    """Probability that the reward model calls the response good."""
    ids = classifier_ids(m.tokenizer, question, response, max_length)
    return classifier_score(row_logits(m, [ids])[0], positive)


def score_judge(m: Loaded, prompt: str, max_length: int) -> float:
    """P(yes) / (P(yes) + P(no)) of the judge's next token."""
    ids = m.tokenizer(prompt, truncation=True, max_length=max_length)["input_ids"]
    return judge_score(m, row_logits(m, [ids])[0])


def _verdict(kind: str, s: float, threshold: float, logit: float | None) -> Verdict:
    components = {"score": s, "correct": float(s >= threshold)}
    if logit is not None:
        components["logit"] = logit
    return Verdict(components, weights={"score": 1.0}, details=f"{kind} score={s:.4f}")


def _group_key(traj: Trajectory) -> tuple:
    p = traj.verifier_params
    if p.get("mode", "pointwise") not in MODES:
        raise VerifierInputError(f"model verifier mode={p.get('mode')!r} is not one of {MODES}")
    return (model_path(p), p.get("judge"), int(p.get("max_length", DEFAULT_MAX_LENGTH)), p.get("positive_label"))


def _score_group(items: list[tuple[Trajectory, dict | None]], max_padding: float) -> list[Verdict]:
    """Trajectories that share model, kind, max_length and label, scored in length buckets."""
    params = items[0][0].verifier_params
    m = load(model_path(params), params.get("judge"))
    max_length = min(int(params.get("max_length", DEFAULT_MAX_LENGTH)), m.max_positions)
    questions = [_question(t) for t, _ in items]
    responses = [t.final_text or "" for t, _ in items]
    thresholds = [float(t.verifier_params.get("threshold", 0.5)) for t, _ in items]
    if m.kind == "classifier":
        rows = [classifier_ids(m.tokenizer, q, r, max_length) for q, r in zip(questions, responses)]
        positive = params.get("positive_label")
        return [
            _verdict(m.kind, classifier_score(row, positive), th, float(row[0]) if row.numel() == 1 else None)
            for row, th in zip(row_logits(m, rows, max_padding), thresholds)
        ]
    prompts = [
        JUDGE_TEMPLATE.format(
            question=q,
            response=r,
            reference=(h or {}).get("reference", "(none)"),
            rubric=(h or {}).get("rubric", "(none)"),
        )
        for q, r, (_, h) in zip(questions, responses, items)
    ]
    rows = m.tokenizer(prompts, truncation=True, max_length=max_length)["input_ids"]
    return [
        _verdict(m.kind, judge_score(m, lg), th, None) for lg, th in zip(row_logits(m, rows, max_padding), thresholds)
    ]


def verify_model_batch(
    items: list[tuple[Trajectory, dict | None]], max_padding: float = 1.0
) -> list[Verdict | Exception]:
    """Score many trajectories: per (model, kind, max_length, label) group, one forward
    (`max_padding` >= 1) or one per length bucket padded at most `max_padding`
    (`length_buckets`); each item's Verdict, or the exception that item (or its whole group:
    a missing model) raised."""
    out: list[Verdict | Exception | None] = [None] * len(items)
    groups: dict[tuple, list[int]] = {}
    for i, (traj, _) in enumerate(items):
        try:
            groups.setdefault(_group_key(traj), []).append(i)
        except (VerifierInputError, TypeError, ValueError) as exc:
            out[i] = exc if isinstance(exc, VerifierInputError) else VerifierInputError(f"model verifier params: {exc}")
    for idx in groups.values():
        try:
            verdicts = _score_group([items[i] for i in idx], max_padding)
        except Exception as exc:  # noqa: BLE001 (the group shares the failure: a missing model dir is infra)
            verdicts = [exc] * len(idx)
        for i, v in zip(idx, verdicts):
            out[i] = v
    return out  # type: ignore[return-value]


def verify_model(traj: Trajectory, hidden: dict | None = None) -> Verdict:
    """Score the final answer with the configured reward model or judge (a batch of one)."""
    if is_pairwise(traj.verifier_params):
        raise VerifierInputError(
            "model verifier mode='pairwise' compares a group's samples: it is scored by the verifier worker's "
            "group batching (verifier_workers.rm_serving), not one trajectory alone"
        )
    result = verify_model_batch([(traj, hidden)])[0]
    if isinstance(result, Exception):
        raise result
    return result


verify_model.batched = verify_model_batch  # type: ignore[attr-defined]
"""The verifier worker's batching hook (`verifier_workers.rm_serving`)."""
