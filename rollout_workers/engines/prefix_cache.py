"""`PrefixCache`: the KV cache of recent sequences, so a multi-turn episode's next turn
prefills only its new suffix (`rollout.hf.prefix_reuse`, `hf_engine.HFEngine`).

Guarantees:
- An entry is one sequence's token ids and, per layer, the keys and values of exactly those
  ids (no padding), as the model computed them in one `generate` call: a row of that call's
  cache tensors and the positions of its ids there, read (copied) only when reused, so
  keeping a batch costs no copy (the batch's tensors live while any of its entries does).
- `lookup(ids)` returns the entry sharing the longest common prefix with `ids` and that
  prefix's length, capped at `len(ids) - 1` (the last prompt token is always fed again: its
  logits start the generation); 0 and None when nothing is shared.
- Thread-safe: every method holds one lock (a worker's pools may generate concurrently);
  an entry's tensors are never changed once stored.
- Bounded: at most `max_entries` entries, least recently used evicted first; `clear()`
  empties it (the engine clears it whenever its weights change: a cache of other weights
  would give other log-probs).
- Salted by weights: every entry is stored with the engine's weight epoch (`put(...,
  epoch=)`) and `lookup(ids, epoch=)` never returns an entry of another epoch, so even an
  entry stored by a call that raced a weight load (in-flight updates reload between the
  chunks of a turn) is never reused under the new weights.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass
class Entry:
    """One sequence: its ids, and where its keys/values are: per layer (keys, values) of a
    batch ([rows, heads, length, head_dim]), its `row` there and the `pos` of its ids."""

    ids: np.ndarray
    layers: list[tuple]
    row: int = 0
    pos: object = None
    epoch: int = 0

    def kv(self, k: int) -> list[tuple]:
        """Per layer (keys, values) of the first `k` ids, each [heads, k, head_dim]."""
        at = self.pos[:k]
        return [(keys[self.row][:, at], values[self.row][:, at]) for keys, values in self.layers]


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two id arrays."""
    m = min(len(a), len(b))
    if m == 0:
        return 0
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


class PrefixCache:
    """Least-recently-used store of sequences' KV caches (see the module guarantees)."""

    def __init__(self, max_entries: int = 64):
        if max_entries < 1:
            raise ValueError(f"prefix cache max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self._next = 0
        self.hits = 0
        self.reused_tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self.entries.clear()

    def lookup(self, ids, epoch: int = 0) -> tuple[int, Entry | None, int | None]:
        """(shared prefix length, entry, its key) for `ids`: the entry of weight `epoch` with the
        longest common prefix, capped at len(ids) - 1; (0, None, None) when none shares a token."""
        ids = np.asarray(ids, dtype=np.int64)
        best, best_key = 0, None
        with self._lock:
            for key, entry in self.entries.items():
                if entry.epoch != epoch:
                    continue  # another weights' keys/values: never reused
                k = common_prefix(entry.ids, ids)
                if k > best:
                    best, best_key = k, key
            best = min(best, len(ids) - 1)
            if best <= 0 or best_key is None:
                return 0, None, None
            self.entries.move_to_end(best_key)
            self.hits += 1
            self.reused_tokens += best
            return best, self.entries[best_key], best_key

    def drop(self, key: int) -> None:
        """Forget one entry (one a longer sequence now covers)."""
        with self._lock:
            self.entries.pop(key, None)

    def put(self, ids, layers: list[tuple], row: int = 0, pos=None, epoch: int = 0) -> None:
        """Store one sequence computed under weight `epoch` (evicting the least recently used past `max_entries`)."""
        with self._lock:
            self.entries[self._next] = Entry(np.asarray(ids, dtype=np.int64), layers, row, pos, epoch)
            self._next += 1
            while len(self.entries) > self.max_entries:
                self.entries.popitem(last=False)
