"""The `model` verifier: a learned reward model or an LLM judge, on CPU, from a local path.

The model is `verifier_params["model_path"]`, else env `RLBUS_REWARD_MODEL`: a local
Hugging Face directory, loaded with `local_files_only` (never downloaded). Its kind is
`verifier_params["judge"]` (`classifier` | `causal`), else read from the config:
`...ForSequenceClassification` architectures are classifiers, anything else a causal LM.

- classifier (reward model): scores the pair (question, response); the score is
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
  0.5). The default scalar is `score` (a config can weight `correct` instead).
- Input is truncated from the left to `max_length` tokens (default 1024, capped by the
  model's positions), so the response and the judge's "Answer:" are always seen.
- Each (path, kind) is loaded once per process (thread-safe) in eval mode, float32, CPU.
- No model configured raises `VerifierInputError` (the task is unusable); a configured
  path that is absent or fails to load raises `VerifierInfraError` (this node lacks the
  model: retried, then dead-lettered). Empty or odd responses are scored, status "ok".
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas import Trajectory
from verifier_workers.errors import VerifierInfraError
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
_cache: dict[tuple[str, str], Loaded] = {}


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
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = cls.from_pretrained(path, local_files_only=True, torch_dtype=torch.float32).eval()
    except (OSError, ValueError) as exc:
        raise VerifierInfraError(f"reward model {str(path)!r} failed to load as {kind}: {exc}") from exc
    tokenizer.truncation_side = "left"
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
    key = (str(p.resolve()), resolved)
    with _lock:
        if key not in _cache:
            _cache[key] = _load(p, resolved)
        return _cache[key]


def _question(traj: Trajectory) -> str:
    q = traj.verifier_params.get("question")
    if isinstance(q, str):
        return q
    return next((t.text for t in traj.turns if t.role == "prompt"), "")


def score_classifier(m: Loaded, question: str, response: str, max_length: int, positive: int | None) -> float:
    """Probability that the reward model calls the response good."""
    import torch

    enc = m.tokenizer(question, response, return_tensors="pt", truncation=True, max_length=max_length)
    with torch.inference_mode():
        logits = m.model(**enc).logits[0].float()
    if logits.numel() == 1:
        return float(torch.sigmoid(logits[0]))
    label = logits.numel() - 1 if positive is None else int(positive)
    return float(torch.softmax(logits, -1)[label])


def score_judge(m: Loaded, prompt: str, max_length: int) -> float:
    """P(yes) / (P(yes) + P(no)) of the judge's next token."""
    import torch

    enc = m.tokenizer(prompt, return_tensors="pt", truncation=True, max_length=max_length)
    with torch.inference_mode():
        probs = torch.softmax(m.model(**enc).logits[0, -1].float(), -1)
    yes, no = float(probs[m.yes_ids].sum()), float(probs[m.no_ids].sum())
    return yes / (yes + no) if yes + no > 0 else 0.5


def verify_model(traj: Trajectory, hidden: dict | None = None) -> Verdict:
    """Score the final answer with the configured reward model or judge."""
    params, hidden = traj.verifier_params, hidden or {}
    m = load(model_path(params), params.get("judge"))
    max_length = min(int(params.get("max_length", DEFAULT_MAX_LENGTH)), m.max_positions)
    question, response = _question(traj), traj.final_text or ""
    if m.kind == "classifier":
        s = score_classifier(m, question, response, max_length, params.get("positive_label"))
    else:
        prompt = JUDGE_TEMPLATE.format(
            question=question,
            response=response,
            reference=hidden.get("reference", "(none)"),
            rubric=hidden.get("rubric", "(none)"),
        )
        s = score_judge(m, prompt, max_length)
    threshold = float(params.get("threshold", 0.5))
    return Verdict(
        {"score": s, "correct": float(s >= threshold)}, weights={"score": 1.0}, details=f"{m.kind} score={s:.4f}"
    )
