"""The `hf` engine: `HFEngine`, a causal LM from a local HF directory on transformers/torch (CPU or GPU).

Guarantees (the engine contract of `rollout_workers.engines`, plus):
- All prompts of a call and all G samples of a prompt are generated in ONE batched
  `generate` call with the KV cache (left padding).
- `load_weights(blob)` swaps weights in place between batches; no restart.
- `HFEngine.load_weights_file(path, sha256)` is the zero-copy path for `file://` blobs
  (`rollout_workers.weight_loading.load_state_file`): bytes go from the file straight into staging
  tensors that become the model's weights only after the sha256 matched (a mismatch
  raises `ChecksumMismatch`, model untouched). It returns False (model untouched) for
  blobs it cannot load that way (LoRA adapters, another dtype/shape, a GPU model); the
  caller then uses `load_weights`. Costs one extra copy of the weights in memory.
- `HFEngine.load_weights_file_speculative(path)` is the same read with the sha256 off
  the critical path: the new weights serve at once and the returned
  `rollout_workers.weight_loading.SpeculativeLoad` (verify with `digest()` in a thread, then `commit()`
  or `rollback()`) holds the previous weights until settled. None (model untouched) where
  the verify-first path would decline, or for tied weights that swapping cannot keep.
  While one is unsettled, every other load raises RuntimeError (it would overwrite the
  weights being verified, or the ones a rollback restores).
"""

from __future__ import annotations

import numpy as np

from rollout_workers.engines.sample import Sample


class HFEngine:
    """A causal LM from a local HF directory, generating with transformers."""

    def __init__(self, model_path: str, device: str = "cpu", threads: int = 1):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        self.torch = torch
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(model_path).to(self.device).eval()
        self.model_path, self.base = model_path, None  # base: the untouched start weights, for LoRA adapters
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        self.max_context = getattr(self.model.config, "max_position_embeddings", None)
        """Longest context (prompt + generation) the model takes; the agent loop ends an episode before it."""

    def _check_settled(self) -> None:
        pending = getattr(self, "_speculative", None)
        if pending is not None and not pending.settled:
            raise RuntimeError(f"speculative load of {pending.path} not verified yet: commit or roll it back first")

    def load_weights(self, blob: bytes) -> None:
        """Hot-load a safetensors blob into the model: full weights, or a LoRA adapter, which
        is merged into the base weights this engine started from (never into the previous version)."""
        from bus.weight_blobs import blob_kind, load_state_bytes, merged_state_blob

        self._check_settled()

        if blob_kind(blob) == "lora":
            if self.base is None:
                from transformers import AutoModelForCausalLM

                self.base = AutoModelForCausalLM.from_pretrained(self.model_path).eval()
            blob = merged_state_blob(self.base, blob)
        load_state_bytes(self.model, blob)
        self.model.eval()

    def load_weights_file(self, path: str, sha256: str) -> bool:
        """Hot-load a full-state safetensors file without an intermediate blob; False if this
        path does not apply (see the module guarantees)."""
        from rollout_workers.weight_loading import load_state_file

        self._check_settled()
        if self.device.type != "cpu":
            return False
        if getattr(self, "_staging", None) is None:
            self._staging: dict = {}  # reused staging tensors (the previous weights after a swap)
        if not load_state_file(self.model, path, sha256, self._staging):
            return False
        self.model.eval()
        return True

    def load_weights_file_speculative(self, path: str):
        """Swap a full-state safetensors file in before its sha256 is checked; the
        `SpeculativeLoad` to verify and settle, or None if this path does not apply (see
        the module guarantees)."""
        from rollout_workers.weight_loading import load_state_file_speculative

        self._check_settled()
        if self.device.type != "cpu":
            return None
        if getattr(self, "_staging", None) is None:
            self._staging = {}
        pending = load_state_file_speculative(self.model, path, self._staging)
        if pending is not None:
            self._speculative = pending
        return pending

    def encode_batch(self, prompts: list[str] | list[list[int]]) -> dict:
        """Left-padded input_ids/attention_mask for text prompts, or for token-id prompts as given
        (multi-turn contexts pass ids, so earlier turns are never re-tokenized differently)."""
        torch = self.torch
        if prompts and not isinstance(prompts[0], str):
            width = max(len(p) for p in prompts)
            ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(prompts), width), dtype=torch.long)
            for i, p in enumerate(prompts):
                if len(p):
                    ids[i, width - len(p) :] = torch.as_tensor(np.asarray(p, dtype=np.int64))
                    mask[i, width - len(p) :] = 1
            return {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}
        return self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` (no special tokens), as int32."""
        return np.asarray(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)

    def decode(self, ids) -> str:
        """Text of token ids (special tokens skipped)."""
        return self.tokenizer.decode(list(map(int, ids)), skip_special_tokens=True)

    def generate(
        self, prompts: list[str] | list[list[int]], n: int, max_new_tokens: int, temperature: float
    ) -> list[list[Sample]]:
        """n samples per prompt (text, or token ids), one batched call. Greedy with n > 1 (which HF
        `generate` refuses) runs each prompt n times as one sample each: n identical samples."""
        torch = self.torch
        greedy = temperature <= 0
        repeat = greedy and n > 1
        enc = self.encode_batch([p for p in prompts for _ in range(n)] if repeat else prompts)
        with torch.no_grad():
            out = self.model.generate(
                **enc,
                do_sample=not greedy,
                temperature=None if greedy else temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                num_return_sequences=1 if repeat else n,
                pad_token_id=self.pad_id,
                eos_token_id=self.eos_id,
                output_logits=True,
                return_dict_in_generate=True,
            )
        width = enc["input_ids"].shape[1]
        gen = out.sequences[:, width:]  # [B*n, T]
        logits = torch.stack(out.logits, dim=1).float()  # [B*n, T, V]
        if not greedy:
            logits = logits / temperature
        logp = torch.log_softmax(logits, dim=-1).gather(-1, gen.unsqueeze(-1)).squeeze(-1)
        is_eos = gen == self.eos_id
        has_eos = is_eos.any(dim=1)
        first_eos = torch.where(
            has_eos, is_eos.int().argmax(dim=1), torch.full_like(has_eos, gen.shape[1], dtype=torch.long)
        )
        lengths = torch.where(has_eos, first_eos + 1, torch.full_like(first_eos, gen.shape[1]))
        gen_np, logp_np, len_np = gen.cpu().numpy(), logp.cpu().numpy(), lengths.cpu().numpy()
        texts = self.tokenizer.batch_decode(
            [row[: min(L, f)] for row, L, f in zip(gen_np, len_np, first_eos.cpu().numpy())], skip_special_tokens=True
        )
        mask = enc["attention_mask"].cpu().numpy().astype(bool)
        ids = enc["input_ids"].cpu().numpy()
        result: list[list[Sample]] = []
        for p in range(len(prompts)):
            row = p * n if repeat else p  # the prompt's (first) row of the encoded batch
            prompt_ids = ids[row][mask[row]].astype(np.int32)
            group = []
            for j in range(n):
                i = p * n + j
                L = int(len_np[i])
                group.append(
                    Sample(
                        prompt_ids,
                        gen_np[i, :L].astype(np.int32),
                        logp_np[i, :L].astype(np.float32),
                        texts[i],
                        "stop" if bool(has_eos[i]) else "length",
                    )
                )
            result.append(group)
        return result
