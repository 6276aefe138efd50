"""The `bpe` tokenizer of tiny models: byte-level BPE trained here, with a ChatML chat template.

Guarantees:
- `build_bpe_tokenizer(seed, vocab_size)` trains a byte-level BPE (HF `tokenizers`, GPT-2
  byte alphabet: every string encodes, nothing is unknown) on text the built-in domains
  generate (`training_corpus`): arith problems and answers, tool_calc episodes (prompt,
  `<py>` call, observation, answer), the frozen example texts shipped with this package
  (`bpe_corpus.json`: the strings of examples/data/*.jsonl when it was frozen; examples/
  itself is never read), and the chat template's own scaffolding. The same seed and vocab
  size give the same vocabulary and merges (the corpus is a pure function of the seed).
- Special tokens, ids 0..2: `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (eos:
  an assistant turn ends with it). Tool tokens, ids 3..6, are added tokens that decoding
  keeps (not special, as in Qwen2.5): `<tool_call>`, `</tool_call>`, `<tool_response>`,
  `</tool_response>`.
- `CHAT_TEMPLATE` (saved in `tokenizer_config.json` by `save_pretrained`) is ChatML:
  `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message; with `tools=` the system turn
  lists each tool's JSON schema inside `<tools></tools>` and says how to call one
  (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`); a tool message renders
  as `<|im_start|>tool\\n<tool_response>\\n{content}\\n</tool_response><|im_end|>\\n`;
  `add_generation_prompt` appends `<|im_start|>assistant\\n`. Assistant messages with
  `tool_calls` render them as `<tool_call>` JSON blocks.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = [PAD, IM_START, IM_END]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CORPUS = Path(__file__).resolve().with_name("bpe_corpus.json")
"""The frozen example texts (package data): a JSON object whose `texts` are trained on in order."""

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures are within <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function, return a JSON object with its name and arguments within "
    '<tool_call></tool_call>:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>tool\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set f = call.function if call.function is defined else call %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' + (f.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

SAMPLE_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python program; the value of a final expression is printed.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The program."}},
            "required": ["code"],
        },
    },
}


def corpus_texts() -> list[str]:
    """The frozen example texts of `CORPUS` (they never change: see the module guarantees)."""
    return list(json.loads(CORPUS.read_text(encoding="utf-8"))["texts"])


def training_corpus(seed: int = 0, n: int = 4000) -> list[str]:
    """The texts the tokenizer is trained on (deterministic given `seed`)."""
    from producers.domains import arith, tool_calc

    rng = random.Random(f"bpe-corpus-{seed}")
    texts = []
    for i in range(n):
        p = arith.generate(rng, 1 + i % len(arith.LEVELS))
        texts.append(p.prompt + p.completion)
    for i in range(n // 4):
        texts.append("".join(t for t, _ in tool_calc.demonstration(rng, 1 + i % 3)))
    texts += corpus_texts()
    chat = "".join(f"{IM_START}{role}\n{IM_END}\n" for role in ("system", "user", "assistant", "tool"))
    texts += [json.dumps(SAMPLE_TOOL), '<tools>\n</tools>\n<tool_call>\n{"name": "python", "arguments": {}}'] * 20
    texts += [chat] * 200
    return texts


def build_bpe_tokenizer(seed: int = 0, vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE with its chat template (see the module guarantees)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS + TOOL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(training_corpus(seed), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])  # decoding keeps them
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=IM_END,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 16,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
