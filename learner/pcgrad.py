"""PCGrad: projecting conflicting per-domain gradients (optional, off by default).

Source: Yu et al. 2020, "Gradient Surgery for Multi-Task Learning",
arXiv:2001.06782, Algorithm 1. For each task ``i`` start from
``g_i^PC = g_i``; for every other task ``j``: if ``g_i^PC . g_j < 0`` (a
conflict), project ``g_i^PC`` onto the normal plane of ``g_j``::

    g_i^PC <- g_i^PC - (g_i^PC . g_j) / ||g_j||^2 * g_j

The update is ``sum_i g_i^PC``. Projections are always against the
*original* ``g_j`` (as in Algorithm 1), while the dot product uses the
running ``g_i^PC``.

Deviation, for determinism: the paper visits the other tasks in random
order; here they are visited in fixed index order ``j = 0, 1, ..., K-1``
(skipping ``i``). With two tasks the order does not matter.

Cost (it must stay cheap at a hundred domains): the projections are computed on the
K x K Gram matrix of the task gradients, never on the P-dimensional vectors, so a step
costs one K x P by P x K matmul plus one K-vector by K x P product, and O(K^3) work on
K x K numbers, instead of K(K-1) sequential P-dimensional dot products and updates.
Memory: the K gradients stacked (K x P), as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["pcgrad"]

GradLike = torch.Tensor | Sequence[torch.Tensor | None]


def _project(flat: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Algorithm 1 in coefficient space: every running ``g_i^PC`` is a combination
    ``sum_k a_ik g_k`` of the original gradients, so its dot product with ``g_j`` is
    ``(a_i G)_j`` with the Gram matrix ``G = F F^T`` (one matmul, computed once), and a
    projection only changes ``a_ij``. The update is ``(sum_i a_i) F``: two matmuls over the
    parameters instead of K^2 - K dot products, whatever the number of tasks K (the K^3
    coefficient work is on K x K numbers)."""
    import numpy as np

    k = len(flat)
    stacked = torch.stack(flat)  # K x P
    gram = (stacked @ stacked.T).double().numpy()  # one matmul in the gradients' dtype
    sq_norms = np.diag(gram).copy()
    coef = np.zeros(k)
    n_conflicts = 0
    for i in range(k):
        a = np.zeros(k)
        a[i] = 1.0
        for j in range(k):
            if j == i or sq_norms[j] == 0.0:
                continue
            dot = float(a @ gram[:, j])
            if dot < 0.0:
                a[j] -= dot / sq_norms[j]
                n_conflicts += 1
        coef += a
    weights = torch.from_numpy(coef).to(stacked.dtype).to(stacked.device)
    return weights @ stacked, n_conflicts


def pcgrad(grads: Sequence[GradLike]) -> tuple[GradLike, int]:
    """Combine per-task (per-domain) gradients with PCGrad.

    Args:
        grads: one entry per task, either

            * a tensor (any shape, the same for all tasks; treated as one flat
              vector), or
            * a list of per-parameter tensors (same length and shapes across
              tasks; ``None`` = no gradient for that parameter in that task,
              read as zeros; a parameter that is ``None`` in every task stays
              ``None``).

    Returns:
        ``(combined, n_conflicts)``: ``combined`` has the input's form (a
        tensor of the common shape, or a list of per-parameter tensors);
        ``n_conflicts`` counts the projections applied, i.e. ordered pairs
        ``(i, j)`` where the running ``g_i^PC`` had a negative dot product
        with ``g_j`` (two mutually conflicting tasks give 2). Inputs are not
        modified; nothing is differentiated (computed under ``no_grad``).
    """
    if len(grads) == 0:
        raise ValueError("pcgrad needs at least one task gradient")
    with torch.no_grad():
        if all(isinstance(g, torch.Tensor) for g in grads):
            shape = grads[0].shape
            for g in grads:
                if g.shape != shape:
                    raise ValueError(f"task gradients differ in shape: {tuple(g.shape)} vs {tuple(shape)}")
            combined, n = _project([g.detach().reshape(-1) for g in grads])
            return combined.reshape(shape), n
        if any(isinstance(g, torch.Tensor) for g in grads):
            raise ValueError("mix of tensors and per-parameter lists; use one form for all tasks")

        n_params = len(grads[0])
        if any(len(g) != n_params for g in grads):
            raise ValueError("task gradient lists differ in length")
        templates: list[torch.Tensor | None] = []
        for p in range(n_params):
            present = [g[p] for g in grads if g[p] is not None]
            for x in present[1:]:
                if x.shape != present[0].shape:
                    raise ValueError(
                        f"parameter {p}: shapes differ across tasks: {tuple(x.shape)} vs {tuple(present[0].shape)}"
                    )
            templates.append(present[0] if present else None)
        live = [p for p in range(n_params) if templates[p] is not None]
        if not live:
            return [None] * n_params, 0
        flat = []
        for g in grads:
            parts = []
            for p in live:
                x = g[p]
                t = templates[p]
                assert t is not None
                parts.append((x if x is not None else torch.zeros_like(t)).detach().reshape(-1))
            flat.append(torch.cat(parts))
        combined, n = _project(flat)
        out: list[torch.Tensor | None] = [None] * n_params
        offset = 0
        for p in live:
            t = templates[p]
            assert t is not None
            out[p] = combined[offset : offset + t.numel()].reshape(t.shape)
            offset += t.numel()
        return out, n
