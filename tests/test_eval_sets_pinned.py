"""The local eval sets (`arith`, `tool_calc`, the forgetting guard's general set) are pinned:
which problems, in which order, with which seeds, budgets and content hashes, and the scores a
fixed answerer gets on them. The expected values were computed from the scheduler's code
before eval sets became data (`producers.eval_set.EvalSet`, issue 28): refactors must not move them."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from rollout_workers.engines.null_engine import NullEngine
from rollout_workers.engines.sample import Sample
from scheduler.evaluation import EvalSuite
from scheduler.gates import add_general_set
from scheduler.pipeline_eval import eval_tasks
from schemas.answers import arith_value
from schemas.config import load_config

CASES = {
    "default": [],
    "arith_small": ["scheduler.eval.n=12", "scheduler.eval.difficulty=1"],
    "tool_calc": ["sampler.domains.tool_calc.max_turns=2", "scheduler.eval.n=5"],
    "tool_calc_json": [
        "sampler.domains.tool_calc.max_turns=3",
        "sampler.domains.tool_calc.tool_format=json",
        "sampler.domains.tool_calc.max_level=3",
        "sampler.domains.tool_calc.start_level=2",
        "sampler.domains.tool_calc.max_tokens=40",
        "scheduler.eval.n=4",
        "scheduler.eval.seed=7",
    ],
    "general_arith": ["scheduler.eval.general=arith", "scheduler.eval.general_n=6", "scheduler.eval.general_level=2"],
    "general_tool_calc": [
        "scheduler.eval.general=tool_calc",
        "scheduler.eval.general_n=6",
        "scheduler.eval.general_level=1",
    ],
    "general_tool_calc_dom": [
        "sampler.domains.tool_calc.max_turns=4",
        "scheduler.eval.general=tool_calc",
        "scheduler.eval.general_n=3",
        "scheduler.eval.n=3",
    ],
}

ARITH_200 = "866a9972f15ca9142a35ecb2c82668fc4a007b7343e7ce4858862d3eb971125d"
PINNED = {  # case -> (sha256 of the eval tasks, {set: (n, sha256)}, local sets, first two (task_id, prompt, params))
    "default": (
        "ef23922cd57ec2b7f54e3c97200b07e80262d6e103e6991c07f241c6e62f3e48",
        {"arith": (200, ARITH_200)},
        ["arith"],
        [("eval-arith-0", "21+51=", "21+51"), ("eval-arith-1", "63-52=", "63-52")],
    ),
    "arith_small": (
        "4b1df20f31cbd7c27df5e45632f0490e06b356a15207e987f244cb76e5b42577",
        {"arith": (12, "625f3506859ba45c375b9dfa5e39359adcd37640a0b89e4d00f516036440077f")},
        ["arith"],
        [("eval-arith-0", "4+9=", "4+9"), ("eval-arith-1", "9+7=", "9+7")],
    ),
    "tool_calc": (
        "1fe06018fd09145496401f71be0127c77fa06314052b125327f3e963b5c53a65",
        {"tool_calc": (5, "9cd414da587573bd73795f8fd6c176c593829f88cd43e6df8820534de72f13ca")},
        ["tool_calc"],
        [("eval-tool_calc-0", "627*744=?", "627*744"), ("eval-tool_calc-1", "723*713=?", "723*713")],
    ),
    "tool_calc_json": (
        "5a4f2244dae73cc9dcd553c57f2eea6ccd70a16e7eec56d7c8f2f007773b23ef",
        {"tool_calc": (4, "8f56ee09f87e92a9d344b9668e9d3fdc7ec8eeaefb26719f87103406808e6163")},
        ["tool_calc"],
        [("eval-tool_calc-0", "2810*9752=?", "2810*9752"), ("eval-tool_calc-1", "5154*9060=?", "5154*9060")],
    ),
    "general_arith": (
        "f4b6f49de128e248b16e47f257a7182906081ec9cfdce3727e79c6bc2571e64e",
        {
            "arith": (200, ARITH_200),
            "general_arith": (6, "ae73101a7b0ad0aa8171f94fdfb69757bb1c56aa34bf7b6ce1c921b12dc2f8ee"),
        },
        ["arith", "general_arith"],
        [("eval-arith-0", "21+51=", "21+51"), ("eval-arith-1", "63-52=", "63-52")],
    ),
    "general_tool_calc": (
        "0db646e6e0e83f1d1e7f8f52e49f8950cbe75c833f49fbcb634694ae70545f1f",
        {
            "arith": (200, ARITH_200),
            "general_tool_calc": (6, "f7c6b7df30f04c227ac79afa9bcf0790a6d63400f1351718a9854dd7ff471309"),
        },
        ["arith", "general_tool_calc"],
        [("eval-arith-0", "21+51=", "21+51"), ("eval-arith-1", "63-52=", "63-52")],
    ),
    "general_tool_calc_dom": (
        "41a8725ec864c6c2c3675e48e64151355dc31ee22906b7a05d3ae82ff2cff364",
        {
            "tool_calc": (3, "9546b186be18408983acabafa3533d06b33d647647308c2899aa12e3539c4c37"),
            "general_tool_calc": (3, "9546b186be18408983acabafa3533d06b33d647647308c2899aa12e3539c4c37"),
        },
        ["tool_calc", "general_tool_calc"],
        [("eval-tool_calc-0", "627*744=?", "627*744"), ("eval-tool_calc-1", "723*713=?", "723*713")],
    ),
}


def _suite(overrides: list[str]):
    cfg = load_config(None, overrides)
    suite = EvalSuite.from_config(cfg)
    add_general_set(suite, cfg)
    return suite


def _task_rows(suite) -> list[dict]:
    rows = []
    for t in eval_tasks(suite, "r1", 7):
        d = t.model_dump(mode="json")
        d.pop("created_at")
        rows.append(d)
    return rows


@pytest.mark.parametrize("case", sorted(CASES))
def test_eval_items_are_pinned(case):
    digest, sets, local, first = PINNED[case]
    suite = _suite(CASES[case])
    rows = _task_rows(suite)
    assert hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest() == digest
    assert [(r["task_id"], r["prompt"][0]["content"], r["verifier_params"]["expression"]) for r in rows[:2]] == first
    assert suite.local() == local and suite.pipeline_only() == [] and suite.skipped == []
    by_set = {}
    for r in rows:
        by_set[r["domain"]] = by_set.get(r["domain"], 0) + 1
    assert by_set == {name: n for name, (n, _) in sets.items()}


class Oracle(NullEngine):
    """Answers right when the prompt's sha256 starts with an even byte, else off by one
    (`=<answer>` for a tool_calc prompt, without a tool call: no sandbox is opened)."""

    def generate(self, prompts, n, max_new_tokens, temperature):
        out = []
        for p in prompts:
            gold = arith_value(p.rstrip("=?").rstrip("="))
            ans = gold if hashlib.sha256(p.encode()).digest()[0] % 2 == 0 else gold + 1
            text = f"={ans}" if p.endswith("?") else str(ans)
            out.append(
                [Sample(self.encode(p), np.array([48, 1], dtype=np.int32), np.zeros(2, dtype=np.float32), text, "stop")]
            )
        return out


@pytest.mark.parametrize(
    "overrides, want",
    [
        (
            ["scheduler.eval.n=12", "scheduler.eval.difficulty=1"],
            {"arith": (7 / 12, 12, "625f3506859ba45c375b9dfa5e39359adcd37640a0b89e4d00f516036440077f")},
        ),
        (
            [
                "sampler.domains.tool_calc.max_turns=2",
                "scheduler.eval.n=10",
                "scheduler.eval.general=arith",
                "scheduler.eval.general_n=7",
            ],
            {
                "tool_calc": (0.8, 10, "52932e5e44c25813e98ec48344c82bfb6e6ff9b017220c8095f9d1bf6c4acbdf"),
                "general_arith": (3 / 7, 7, "bd4426a4709c7c13ba280ffd32158cadb09c43651f44cca7cd3eb5fa86a01ca6"),
            },
        ),
    ],
)
async def test_local_scores_are_pinned(overrides, want):
    scores = await _suite(overrides).evaluate(Oracle(), open_sandbox=None)
    assert scores.keys() == want.keys()
    for name, (score, n, digest) in want.items():
        assert scores[name][0] == pytest.approx(score) and scores[name][1:] == (n, digest)
