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
- `prefix_reuse` (`rollout.hf.prefix_reuse`): the KV cache of each generated row (its prompt
  and generation) is kept in a bounded `prefix_cache.PrefixCache` (`prefix_cache_entries`
  sequences, least recently used evicted); a later call whose token-id prompt starts with a
  kept sequence's ids feeds only the new suffix, still all rows in ONE batched `generate`
  (each row's reused keys/values left-padded in the cache, its suffix left-padded after
  them; positions follow the attention mask, so a row's positions are those of its own
  tokens). A prompt sharing nothing is prefilled in full; a model whose cache is not
  full-attention `DynamicLayer`s (sliding windows, linear attention) keeps nothing. Generated ids and behaviour
  log-probs equal the no-reuse path's within float tolerance (tests/test_prefix_reuse.py),
  sampled ones under the same torch seed too. Every weight load clears the cache and moves
  the weight epoch on twice (as it starts and once it is done), entries are salted with the
  epoch they were computed under and only the current epoch's are reused, a call that a load
  overlapped keeps nothing, and nothing is kept or reused while a speculative load is
  unsettled: no key/value of one version is ever reused under another (in-flight updates,
  `rollout_workers.inflight`, reload between the chunks of a turn). The cache is thread-safe (concurrent calls from a worker's pools).
"""

from __future__ import annotations

import numpy as np

from rollout_workers.engines.prefix_cache import PrefixCache
from rollout_workers.engines.sample import Sample


class HFEngine:
    """A causal LM from a local HF directory, generating with transformers."""

    def __init__(
        self,
        model_path: str,
        device: str = "cpu",
        threads: int = 1,
        prefix_reuse: bool = False,
        prefix_cache_entries: int = 64,
    ):
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
        self.prefix = PrefixCache(prefix_cache_entries) if prefix_reuse else None
        """Kept KV caches of recent rows (None: every prompt is prefilled in full)."""
        self._weights_seen = 0  # weight loads so far: a call that spans one keeps nothing

    def _check_settled(self) -> None:
        if self._unsettled():
            pending = self._speculative
            raise RuntimeError(f"speculative load of {pending.path} not verified yet: commit or roll it back first")
        self._new_epoch()

    def _new_epoch(self) -> None:
        """Weights change (or just changed): the kept keys/values are another policy's."""
        if self.prefix is not None:
            self._weights_seen += 1
            self.prefix.clear()

    def _unsettled(self) -> bool:
        pending = getattr(self, "_speculative", None)
        return pending is not None and not pending.settled

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
        try:
            load_state_bytes(self.model, blob)
        finally:
            self._new_epoch()
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
        try:
            if not load_state_file(self.model, path, sha256, self._staging):
                return False
        finally:
            self._new_epoch()
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
        try:
            pending = load_state_file_speculative(self.model, path, self._staging)
        finally:
            self._new_epoch()
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
        rows = [p for p in prompts for _ in range(n)] if repeat else prompts
        keep = self.prefix is not None and not self._unsettled()
        weights = getattr(self, "_weights_seen", 0)
        enc, cache, used = None, None, []
        if keep and rows and not isinstance(rows[0], str) and (n == 1 or repeat):
            enc, cache, used = self._reuse_batch(rows, weights)
        if enc is None:
            enc = self.encode_batch(rows)
        if cache is not None:
            enc = {**enc, "cache": cache}
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
        if keep and weights == self._weights_seen and not self._unsettled():
            self._remember(enc, out, len_np, used, weights)
        texts = self.tokenizer.batch_decode(
            [row[: min(L, f)] for row, L, f in zip(gen_np, len_np, first_eos.cpu().numpy())], skip_special_tokens=True
        )
        return self._samples(enc, len(prompts), n, repeat, gen_np, logp_np, len_np, texts, has_eos)

    def _samples(self, enc, count, n, repeat, gen_np, logp_np, len_np, texts, has_eos) -> list[list[Sample]]:
        """Per prompt, its n `Sample`s from the batch's outputs."""
        mask = enc["attention_mask"].cpu().numpy().astype(bool)
        ids = enc["input_ids"].cpu().numpy()
        result: list[list[Sample]] = []
        for p in range(count):
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

    def _reuse_batch(self, rows: list[list[int]], epoch: int = 0):
        """(input_ids/attention_mask, the batched cache, the entry keys used) for token-id rows:
        per row its longest kept prefix (left-padded to the longest such prefix, in the cache)
        then its new suffix (left-padded after it). (None, None, []) when no row reuses anything."""
        torch = self.torch
        hits = [self.prefix.lookup(r, epoch) for r in rows]
        width_p = max(k for k, _, _ in hits)
        if width_p == 0:
            return None, None, []
        width_s = max(len(r) - k for r, (k, _, _) in zip(rows, hits, strict=True))
        ids = torch.full((len(rows), width_p + width_s), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        first = next(e for _, e, _ in hits if e is not None)
        layers = []
        for k0, v0 in first.layers:
            shape = (len(rows), k0.shape[1], width_p, k0.shape[3])
            layers.append((k0.new_zeros(shape), v0.new_zeros(shape)))
        for i, (r, (k, entry, _)) in enumerate(zip(rows, hits, strict=True)):
            tail = torch.as_tensor(np.asarray(r[k:], dtype=np.int64))
            ids[i, width_p + width_s - len(tail) :] = tail
            mask[i, width_p + width_s - len(tail) :] = 1
            if k:
                ids[i, width_p - k : width_p] = torch.as_tensor(entry.ids[:k])
                mask[i, width_p - k : width_p] = 1
                for (kk, vv), (ke, ve) in zip(layers, entry.kv(k), strict=True):
                    kk[i, :, width_p - k :] = ke
                    vv[i, :, width_p - k :] = ve
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=[(k.to(self.device), v.to(self.device)) for k, v in layers])
        enc = {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}
        return enc, cache, [key for _, _, key in hits if key is not None]

    def _remember(self, enc, out, len_np, used, epoch: int = 0) -> None:
        """Keep each output row's real ids (prompt and generation, no padding) with their keys and
        values; the entries these rows continued are dropped (the new ones cover them)."""
        torch = self.torch
        from transformers.cache_utils import DynamicLayer

        cache = getattr(out, "cache", None)
        if cache is None or not cache.layers or any(type(x) is not DynamicLayer for x in cache.layers):
            return  # only full-attention dynamic layers hold every position's keys/values: else prefill in full
        kv = [(layer.keys.detach(), layer.values.detach()) for layer in cache.layers]
        length = kv[0][0].shape[2]  # the last generated token was never fed: not in the cache
        rows = out.sequences.shape[0]
        mask = enc["attention_mask"].repeat_interleave(rows // enc["attention_mask"].shape[0], dim=0)
        width = mask.shape[1]
        full = torch.cat([mask.bool(), torch.ones((rows, length - width), dtype=torch.bool, device=mask.device)], 1)
        for key in used:
            self.prefix.drop(key)
        for i in range(rows):
            real = full[i].clone()
            real[width + int(len_np[i]) :] = False  # padding after the row's end-of-sequence
            pos = real.nonzero().squeeze(1)
            self.prefix.put(out.sequences[i, :length][pos].cpu().numpy(), kv, i, pos, epoch)
