"""Rollout-side weight loading from `file://` blobs: verified zero-copy reads and speculative swaps.

Guarantees:
- `load_state_file(model, path, sha256, staging)` reads each tensor's bytes straight
  into a reused staging tensor of the model's dtype/shape (`readinto`, no intermediate
  bytes), hashes exactly the bytes read (header included), and only if they hash to
  `sha256` makes the staging tensors the model's parameters/buffers (swap; the previous
  storage becomes the next staging buffer, so a worker holds the weights twice). On a
  mismatch it raises `ChecksumMismatch` and the model is untouched. It returns False
  without touching the model when the file does not fit that path (LoRA adapter blob,
  dtype/shape/device mismatch, non-contiguous parameter): the caller then uses
  `fetch_weights` + `load_state_bytes`, which converts dtypes or fails loudly. Names are
  checked as strictly as `load_state_bytes` (unexpected or missing non-tied: ValueError).
- `load_state_file_speculative(model, path, staging)` is the same load WITHOUT the hash
  on the critical path, and by default without the copy: tensors viewing a private
  (copy-on-write) memory map of the file become the model's weights at once. The
  returned `SpeculativeLoad` keeps the previous weights until it is settled:
  `digest()` (in a thread) hashes exactly the bytes that serve, then `commit()` or
  `rollback()`. Until then the new weights are unverified, and the caller publishes
  nothing generated with them. Structural faults (truncated, padded, unreadable header)
  raise ChecksumMismatch before anything is swapped; it returns None (model untouched)
  where `load_state_file` would return False, and when tied aliases could not be kept.
- The file must not be rewritten in place while mapped (the file store never does).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from bus.objects import ChecksumMismatch
from bus.weight_blobs import KIND_KEY, _byte_view, _st_dtype


def _readinto_full(f, mv: memoryview) -> None:
    while len(mv):
        n = f.readinto(mv)
        if not n:
            raise ChecksumMismatch(f"{f.name}: file ends early")
        mv = mv[n:]


def _resolve(model, name: str):
    """The Parameter or buffer object behind a state_dict name (None if neither)."""
    module_name, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(module_name) if module_name else model
    except AttributeError:
        return None
    if attr in module._parameters:
        return module._parameters[attr]
    return module._buffers.get(attr)


def _file_plan(model, header: dict, data_len: int):
    """([(name, target tensor, begin, end)] in file order, swap) if every tensor of the file can
    be read straight into the model's tensor of the same name, dtype and shape on CPU, the data
    is covered without holes, and every state name missing from the file is a tied alias of one
    in it; None otherwise (the generic path then converts, or raises as `load_state_bytes`)."""
    sd = model.state_dict()
    if any(k not in sd for k in header):
        return None
    plan, by_ptr = [], {}
    for name, spec in header.items():
        target = _resolve(model, name)
        if target is None:
            return None
        t = target.data
        if (
            _st_dtype(t) != spec.get("dtype")
            or list(t.shape) != spec.get("shape")
            or t.device.type != "cpu"
            or not t.is_contiguous()
        ):
            return None
        begin, end = spec["data_offsets"]
        if end - begin != t.numel() * t.element_size():
            return None
        plan.append((name, target, begin, end))
        by_ptr[t.data_ptr()] = target
    plan.sort(key=lambda e: e[2])
    pos = 0
    for _, _, begin, end in plan:
        if begin != pos:
            return None
        pos = end
    missing = [k for k in sd if k not in header]
    if pos != data_len or any(sd[k].data_ptr() not in by_ptr for k in missing):
        return None
    # swapping storages keeps a tie only if every alias IS the same tensor object
    swap = all(_resolve(model, k) is by_ptr[sd[k].data_ptr()] for k in missing)
    return plan, swap


def _open_file_plan(f, path, model):
    """(prefix bytes, plan, swap) of an open safetensors file positioned after its header, or
    None when the fast path does not apply (LoRA adapter, layout that does not fit the model);
    raises ChecksumMismatch for a file that cannot be the announced one (truncated, padded,
    unreadable header)."""
    file_size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) < 8:
        raise ChecksumMismatch(f"{path}: not a safetensors file ({file_size} bytes)")
    (n,) = struct.unpack("<Q", head)
    if n > min(file_size - 8, 100 << 20):
        raise ChecksumMismatch(f"{path}: header length {n} does not fit a {file_size}-byte file")
    raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise ChecksumMismatch(f"{path}: unreadable safetensors header ({exc})") from exc
    meta = header.pop("__metadata__", None) or {}
    if meta.get(KIND_KEY, "full") != "full":
        return None
    try:
        data_end = max((int(spec["data_offsets"][1]) for spec in header.values()), default=0)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ChecksumMismatch(f"{path}: malformed safetensors header ({exc!r})") from exc
    if data_end != file_size - 8 - n:  # truncated or padded: cannot be the announced file
        raise ChecksumMismatch(f"{path}: header describes {data_end} data bytes, file has {file_size - 8 - n}")
    planned = _file_plan(model, header, file_size - 8 - n)
    if planned is None:
        return None
    return head + raw, *planned


def _read_plan(f, path, plan, staging: dict, h=None) -> dict:
    """Read every planned tensor into its staging buffer (allocated when missing, of another
    shape/dtype, or aliasing the live tensor), hashing the bytes into `h` if given; the
    buffers by name. The file must end exactly there."""
    import torch

    bufs = {}
    for name, target, begin, end in plan:
        buf = staging.get(name)
        t = target.data
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.data_ptr() == t.data_ptr():
            buf = staging[name] = torch.empty_like(t, memory_format=torch.contiguous_format)
        if end > begin:
            mv = _byte_view(buf)
            _readinto_full(f, mv)
            if h is not None:
                h.update(mv)
        bufs[name] = buf
    if f.read(1):
        raise ChecksumMismatch(f"{path}: trailing bytes after the tensor data")
    return bufs


def load_state_file(model, path: str | Path, sha256: str, staging: dict) -> bool:
    """Zero-copy load of a safetensors file into `model` (see the module guarantees). `staging`
    is the caller's reusable dict of staging tensors. True if loaded, False if the fast path
    does not apply (model untouched); raises ChecksumMismatch (model untouched)."""
    import torch

    with open(path, "rb", buffering=0) as f:
        opened = _open_file_plan(f, path, model)
        if opened is None:
            return False
        prefix, plan, swap = opened
        h = hashlib.sha256(prefix)
        _read_plan(f, path, plan, staging, h)
    actual = h.hexdigest()
    if actual != sha256:
        raise ChecksumMismatch(f"{Path(path).as_uri()}: sha256 {actual} != announced {sha256}")
    with torch.no_grad():
        for name, target, _, _ in plan:
            new = staging[name]
            if swap:
                staging[name] = target.data
                target.data = new
            else:
                target.copy_(new)
    return True


class SpeculativeLoad:
    """A file's weights already swapped into the model, their sha256 not yet checked.

    Holds the previous weights (taken OUT of the staging dict, so no later read can
    overwrite them) until `commit()` (verified: the previous weights are released, as
    staging buffers for a later read when the new ones were read, not mapped) or
    `rollback()` (mismatch: they are the model's weights again). `digest()` hashes exactly
    the bytes that serve (header, then each tensor in file order), from the tensors now
    serving; nothing may write them meanwhile (inference only reads its weights)."""

    def __init__(
        self, path: str, prefix: bytes, plan: list, new: dict, previous: dict, staging: dict, mapped: bool = False
    ):
        self.path, self._prefix, self._plan = path, prefix, plan
        self._new, self._previous, self._staging = new, previous, staging
        self.mapped, self.settled = mapped, False

    def digest(self) -> str:
        """sha256 (hex) of the file's bytes as loaded (hashlib releases the GIL: run it in a thread)."""
        h = hashlib.sha256(self._prefix)
        for name, _, begin, end in self._plan:
            if end > begin:
                h.update(_byte_view(self._new[name]))
        return h.hexdigest()

    def commit(self) -> None:
        """Verified: keep the new weights; release the previous ones."""
        if self.settled:
            return
        if not self.mapped:  # read loads reuse them as staging buffers
            self._staging.update(self._previous)
        self._previous, self.settled = {}, True

    def rollback(self) -> None:
        """Rejected: the previous weights are the model's again (read, not mapped, new weights
        become staging buffers)."""
        if self.settled:
            return
        import torch

        with torch.no_grad():
            for name, target, _, _ in self._plan:
                target.data = self._previous[name]
        if not self.mapped:
            self._staging.update(self._new)
        self._new, self._previous, self.settled = {}, {}, True


PAGE = 4096


def _map_plan(path, prefix: bytes, plan: list) -> dict | None:
    """Tensors viewing a private (copy-on-write) memory map of the file, one per planned
    name, with every page already faulted in; None when a tensor's offset is not aligned to
    its element size (the caller reads instead)."""
    import torch

    size = os.stat(path).st_size
    base = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)  # MAP_PRIVATE
    start, views = len(prefix), {}
    for name, target, begin, end in plan:
        t = target.data
        if (start + begin) % t.element_size():
            return None
        views[name] = base[start + begin : start + end].view(t.dtype).view(t.shape)
    if size:
        int(base[::PAGE].sum())  # fault every page in now, not in the first forward pass
    return views


def load_state_file_speculative(model, path: str | Path, staging: dict, mapped: bool = True) -> SpeculativeLoad | None:
    """Swap a safetensors file's tensors into `model` at once, before any hashing; the
    returned `SpeculativeLoad` verifies (`digest`) and settles it (`commit` or `rollback`).

    `mapped` (default): the new tensors view a private memory map of the file (no copy: the
    page cache serves them; every page faulted in before the swap). The file must not be
    rewritten in place while mapped (the file store never does: a new file per version,
    renamed into place; truncating a mapped file would crash the reader with SIGBUS).
    Falls back to reading when a tensor is misaligned. Not mapped: read into staging
    tensors (`readinto`). None when the file does not fit the zero-copy path, or when tied
    aliases cannot be kept by swapping (the caller then uses the verify-first
    `load_state_file`); model untouched. Raises ChecksumMismatch (model untouched) for a
    file that cannot be the announced one (truncated, padded, unreadable header)."""
    import torch

    with open(path, "rb", buffering=0) as f:
        opened = _open_file_plan(f, path, model)
        if opened is None or not opened[2]:
            return None
        prefix, plan, _ = opened
        new = _map_plan(path, prefix, plan) if mapped else None
        mapped = new is not None
        if new is None:
            new = _read_plan(f, path, plan, staging)
    previous = {}
    with torch.no_grad():
        for name, target, _, _ in plan:
            previous[name] = target.data
            target.data = new[name]
            staging.pop(name, None)  # the previous weights are held by the SpeculativeLoad, not staged
    return SpeculativeLoad(str(path), prefix, plan, new, previous, staging, mapped=mapped)
