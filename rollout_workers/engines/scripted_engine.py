"""The `scripted` engine: no model; each episode's turns replay a script of tool calls.

For tests and task checks (`rollout.engine = "scripted"`): it proves the episode, sandbox,
diff export and verifier path without a capable model. Scripts live in a local directory
(`rollout.scripted.dir`), one `<task_id>.json` per task:

    {"task_id": "...", "steps": [{"tool": "apply_patch", "args": {"unified_diff": "..."}},
                                 {"tool": "submit", "args": {}},
                                 {"text": "any raw turn text"}]}

`rlbus tasks scripts --domain repo --out DIR [--empty]` writes gold scripts (the cached gold
patch through `apply_patch`, then `submit`) or empty ones (`submit` only). The engine reads
nothing but that directory and the run's tokenizer: never the hidden bucket.

Guarantees:
- The task is found from the prompt's `schemas.repo_task.PROMPT_TASK_LINE` (so a
  `purpose=eval` copy with another task_id replays the same script) and the call syntax from
  its `PROMPT_FORMAT_LINE`; step k of the script is the episode's (k+1)-th model turn. An
  episode is recognised on later turns by its context, which always starts with the ids
  this engine produced for it before (token in, token out), so G samples of one task and
  any number of tasks in one batch are told apart exactly.
- A prompt holding mini-swe-agent's action fence (```` ```mswea_bash_command ````: a harness
  calling through the endpoint) gets steps as mini-swe-agent actions (`mswea_command`: the
  patch through `patch -p1`, `submit` as its `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`),
  each turn ending with EOS like a chat model's.
- A step is written with `schemas.tool_protocol.repo_call_text` (or a raw `text`); a turn
  that calls a tool ends right after the call, a turn without one (past the script's end:
  "(script finished)", or a prompt with no script: "(no script for TASK)") ends with EOS.
- Token ids come from the run's tokenizer (`model.path`'s, the same one the learner
  scores with); a turn longer than `max_new_tokens` is cut there with finish_reason
  `length`, as a model's would be. Behaviour log-probs are 0.0: scripted samples are not
  the policy's, and training on them is not the point (GRPO groups of identical scripted
  samples have zero variance and are filtered by `learner.skip_zero_variance`).
- `load_weights` accepts any blob and changes nothing; `max_context` is None (only the
  configured context budget applies).
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from collections import OrderedDict
from pathlib import Path

import numpy as np

from rollout_workers.engines.sample import Sample
from schemas.repo_task import PROMPT_FORMAT_RE, PROMPT_TASK_LINE, PROMPT_TASK_RE
from schemas.tool_protocol import repo_call_text

MAX_TRACKED = 1024
"""Episode contexts remembered (least recently used dropped first)."""


class ScriptMissing(ValueError):
    """`rollout.scripted.dir` is not a directory."""


def load_script(directory: Path, task_id: str) -> list[dict] | None:
    """The steps of `task_id`'s script, or None when the directory has no script for it."""
    path = directory / f"{task_id}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    steps = data.get("steps") if isinstance(data, dict) else None
    if not isinstance(steps, list):
        raise ValueError(f"{path}: a script is an object with a 'steps' list")
    return steps


def write_script(directory: Path, task_id: str, steps: list[dict]) -> Path:
    """Write `task_id`'s script (the format `load_script` reads); its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{task_id}.json"
    path.write_text(json.dumps({"task_id": task_id, "steps": steps}, indent=1, ensure_ascii=False) + "\n")
    return path


def gold_steps(gold_patch: str) -> list[dict]:
    """The steps replaying a gold patch: `apply_patch` it, then `submit`."""
    return [{"tool": "apply_patch", "args": {"unified_diff": gold_patch}}, {"tool": "submit", "args": {}}]


EMPTY_STEPS: list[dict] = [{"tool": "submit", "args": {}}]
"""An empty script: submit the repository untouched."""


MSWEA = "mswea"
"""mini-swe-agent's text action format (its `mini_textbased` config): one bash block per turn."""
MSWEA_FENCE = "```mswea_bash_command"
MSWEA_SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""The command that ends a mini-swe-agent run (its first output line, alone)."""
_HEREDOC = "RLBUS_SCRIPT_EOF"


def mswea_command(tool: str, args: dict) -> str:
    """The shell command doing what repository tool `tool` does (the harness runs it in /work)."""
    if tool == "apply_patch":
        diff = str(args["unified_diff"])
        diff += "" if diff.endswith("\n") else "\n"
        return f"cat > /tmp/rlbus.diff <<'{_HEREDOC}'\n{diff}{_HEREDOC}\npatch -p1 --batch < /tmp/rlbus.diff"
    if tool == "write_file":
        text = str(args["content"])
        text += "" if text.endswith("\n") else "\n"
        return f"cat > {shlex.quote(str(args['path']))} <<'{_HEREDOC}'\n{text}{_HEREDOC}"
    if tool == "run":
        return str(args["command"])
    if tool == "read_file":
        return f"cat {shlex.quote(str(args['path']))}"
    if tool == "list_files":
        return f"find {shlex.quote(str(args.get('path', '.')))} -type f"
    if tool == "submit":
        return MSWEA_SUBMIT
    raise ValueError(f"{tool!r} is not a repository tool")


def step_text(step: dict, tool_format: str) -> str:
    """The turn text of one script step (`mswea`: mini-swe-agent's THOUGHT + one bash block)."""
    if "text" in step:
        return str(step["text"])
    if tool_format == MSWEA:
        command = mswea_command(str(step["tool"]), dict(step.get("args") or {}))
        return f"THOUGHT: scripted step {step['tool']}.\n\n{MSWEA_FENCE}\n{command}\n```"
    return repo_call_text(str(step["tool"]), dict(step.get("args") or {}), tool_format)


def _key(ids) -> str:
    return hashlib.sha1(np.asarray(ids, dtype=np.int32).tobytes()).hexdigest()


class ScriptedEngine:
    """Replays scripts from a directory (see the module docstring)."""

    def __init__(self, model_path: str, scripts_dir: str) -> None:
        from transformers import AutoTokenizer

        self.dir = Path(scripts_dir)
        if not scripts_dir or not self.dir.is_dir():
            raise ScriptMissing(
                f"rollout.engine = 'scripted' needs rollout.scripted.dir, a directory of "
                f"<task_id>.json scripts (got {scripts_dir!r}); write one with "
                "`rlbus tasks scripts --domain repo --out DIR [--empty]`"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.eos_id = self.tokenizer.eos_token_id
        self.max_context = None
        self._episodes: OrderedDict[tuple[int, str], tuple[str, str, int]] = OrderedDict()
        self._scripts: dict[str, list[dict] | None] = {}

    def load_weights(self, blob: bytes) -> None:
        """Accept any blob (nothing to load)."""

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` (no special tokens), as int32."""
        return np.asarray(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)

    def decode(self, ids) -> str:
        """Text of token ids (special tokens skipped)."""
        return self.tokenizer.decode(list(map(int, ids)), skip_special_tokens=True)

    def _script(self, task_id: str) -> list[dict] | None:
        if task_id not in self._scripts:
            self._scripts[task_id] = load_script(self.dir, task_id)
        return self._scripts[task_id]

    def _locate(self, ids: np.ndarray) -> tuple[str, str, int]:
        """(task id, tool format, step) of the episode whose context is `ids`."""
        for length in sorted({n for n, _ in self._episodes if n <= len(ids)}, reverse=True):
            state = self._episodes.get((length, _key(ids[:length])))  # one hash per distinct length
            if state is not None:
                return state
        text = self.decode(ids)
        task = PROMPT_TASK_RE.search(text)
        fmt = PROMPT_FORMAT_RE.search(text)
        if MSWEA_FENCE in text:  # a mini-swe-agent harness's prompt: its template puts text before the task line
            task = task or re.search(re.escape(PROMPT_TASK_LINE) + r"(\S+)", text)
            return (task.group(1) if task else "", MSWEA, 0)
        return (task.group(1) if task else "", fmt.group(1) if fmt else "tags", 0)

    def _turn(self, task_id: str, fmt: str, step: int) -> tuple[str, bool]:
        """(turn text, whether it is a tool call)."""
        steps = self._script(task_id) if task_id else None
        if steps is None:
            return f"(no script for {task_id or 'this prompt'})", False
        if step >= len(steps):
            return "(script finished)", False
        return step_text(steps[step], fmt), "tool" in steps[step]

    def generate(self, prompts, n: int, max_new_tokens: int, temperature: float) -> list[list[Sample]]:
        """n identical scripted samples per prompt (text or token ids)."""
        out, remember = [], []
        for p in prompts:
            ids = self.encode(p) if isinstance(p, str) else np.asarray(p, dtype=np.int32)
            task_id, fmt, step = self._locate(ids)
            text, is_call = self._turn(task_id, fmt, step)
            gen = self.encode(text)
            if (not is_call or fmt == MSWEA) and self.eos_id is not None:  # a harness's turn ends with EOS
                gen = np.concatenate([gen, np.asarray([self.eos_id], dtype=np.int32)])
            reason = "stop"
            if len(gen) > max_new_tokens:
                gen, reason = gen[:max_new_tokens], "length"
                text = self.decode(gen)
            full = np.concatenate([ids, gen]).astype(np.int32)
            remember.append(((len(full), _key(full)), (task_id, fmt, step + 1)))
            out.append(
                [
                    Sample(
                        ids.astype(np.int32), gen.astype(np.int32), np.zeros(len(gen), dtype=np.float32), text, reason
                    )
                    for _ in range(n)
                ]
            )
        for k, state in remember:
            self._episodes[k] = state
            self._episodes.move_to_end(k)
        while len(self._episodes) > MAX_TRACKED:
            self._episodes.popitem(last=False)
        return out
