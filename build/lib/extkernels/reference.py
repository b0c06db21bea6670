"""Independent references and ``validate_*`` checks used by the chapters (chapter 1
onward).

The kNN reference is SciPy's k-d tree in float64 on the CPU, so it shares no code with
any backend. Each ``validate_*`` function returns True or raises ``AssertionError``
saying what is wrong, so a notebook cell can end on it and nbval can check the ``True``.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "knn_reference",
    "validate_knn",
    "validate_close",
    "ANCHOR_A100",
    "ANCHOR_H200",
    "anchor_figures",
    "not_like_for_like",
]

#: The column of the figures the tutorial this book grows from published (one A100).
ANCHOR_A100 = "A100, published by the anchor tutorial"
#: The column of the same tutorial's code as this book measured it (one H200, torch
#: 2.11): the book's own measurement, not a published figure.
ANCHOR_H200 = "H200, the anchor's code timed by the book (torch 2.11)"

# ms per iteration, forward / training step, under the names of the book's variants
# that do the same thing (the anchor's cuML with a graph break is knn/cuml+compile; its
# shared RMM pool sits under the compiled custom operator). Each pair is one mode: the
# compiled custom operator's row is the anchor's compiled forward and compiled training
# step (11.163 / 12.571 ms).
anchor_figures = {
    ANCHOR_A100: {
        "knn/torch": (144.0, 144.8),
        "knn/torch+compile": (74.2, 74.7),
        "knn/cuml": (14.1, 15.8),
        "knn/cuml+compile": (15.7, 17.7),
        "knn/cuml-op+compile+rmm": (11.163, 12.571),
        "radius/torch": (161.4, 260.7),
        "radius/torch+compile": (38.7, 86.2),
        "radius/warp+compile": (13.5, 30.0),
    },
    ANCHOR_H200: {
        "knn/torch": (87.2, 87.6),
        "knn/torch+compile": (39.1, 39.5),
        "knn/cuml": (8.8, 10.9),
        "knn/cuml-op+compile": (9.3, 11.6),
        "knn/cuml-op+compile+rmm": (8.2, 10.9),
        "radius/torch": (92.7, 149.4),
        "radius/torch+compile": (59.3, 78.4),
    },
}

# Rows of `anchor_figures` whose code computes the result differently from the book's
# variant of the same name, and how.
not_like_for_like = {
    "radius/torch": "a different algorithm: the anchor's code takes a softmax over all "
    "N points through an M × N × F broadcast; the book's brute force masks the weights "
    "within the radius and multiplies them by the features",
    "radius/torch+compile": "the same difference, compiled",
}


def knn_reference(
    p_query: torch.Tensor, p_ref: torch.Tensor, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """k nearest neighbours by ``scipy.spatial.cKDTree`` in float64.

    Returns:
        distances ``(M, k)`` float64 and indices ``(M, k)`` int64, as NumPy arrays.
    """
    from scipy.spatial import cKDTree

    ref = p_ref.detach().cpu().double().numpy()
    dist, idx = cKDTree(ref).query(p_query.detach().cpu().double().numpy(), k)
    return dist.reshape(len(dist), k), idx.reshape(len(idx), k).astype(np.int64)


def validate_knn(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    distances: torch.Tensor,
    indices: torch.Tensor,
    k: int,
    *,
    atol: float = 1e-4,
) -> bool:
    """Check a kNN result against :func:`knn_reference`, robustly to ties.

    Passes when the shapes and dtypes are right, the distances match the reference's
    within ``atol``, and every returned index really lies at its returned distance (so
    two equally near points may come in either order).
    """
    m = p_query.shape[0]
    assert tuple(distances.shape) == (m, k), (
        f"distances: shape {tuple(distances.shape)}, expected {(m, k)}"
    )
    assert tuple(indices.shape) == (m, k), (
        f"indices: shape {tuple(indices.shape)}, expected {(m, k)}"
    )
    assert distances.dtype == torch.float32, (
        f"distances: dtype {distances.dtype}, expected float32"
    )
    assert indices.dtype == torch.int64, (
        f"indices: dtype {indices.dtype}, expected int64"
    )
    ref_d, _ = knn_reference(p_query, p_ref, k)
    d = distances.detach().cpu().double().numpy()
    err = np.abs(d - ref_d).max()
    assert err <= atol, (
        f"distances differ from the k-d tree's by up to {err:.3g} (atol {atol})"
    )
    q = p_query.detach().cpu().double().numpy()
    r = p_ref.detach().cpu().double().numpy()
    idx = indices.detach().cpu().numpy()
    assert idx.min() >= 0 and idx.max() < len(r), "indices: out of range of p_ref"
    actual = np.linalg.norm(q[:, None, :] - r[idx], axis=-1)
    err = np.abs(actual - ref_d).max()
    assert err <= atol, (
        f"indices do not point at the returned distances (off by up to {err:.3g})"
    )
    return True


def validate_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    name: str,
    atol: float,
    rtol: float = 0.0,
) -> bool:
    """``actual`` matches ``expected`` in shape, dtype and values, within
    ``atol + rtol * |expected|``."""
    assert actual.shape == expected.shape, (
        f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    )
    assert actual.dtype == expected.dtype, (
        f"{name}: dtype {actual.dtype}, expected {expected.dtype}"
    )
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    excess = ((a - e).abs() - (atol + rtol * e.abs())).max().item()
    assert excess <= 0, (
        f"{name}: differs from the reference beyond atol={atol}, rtol={rtol} "
        f"(max excess {excess:.3g})"
    )
    return True
