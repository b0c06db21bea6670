"""RAPIDS cuML's nearest-neighbour search, called directly and as a custom operator
(chapter 3).

Two ways to call the same search:

- :func:`knn_plain` calls cuML directly, handing the tensors over through DLPack without
  a copy. ``torch.compile`` cannot trace into cuML, so a compiled model breaks its graph
  here.
- ``torch.ops.cuml.knn`` (:func:`knn_op`) wraps the same call as a PyTorch custom
  operator with a fake implementation: the compiler treats it as one opaque node whose
  output shapes it knows, and ``torch.compile(fullgraph=True)`` succeeds.

Both search clouds centred on the reference cloud's mean (:func:`centred`). cuML's
kernels compute ``|x|^2 + |y|^2 - 2 x.y`` in float32, which cancels away the digits that
tell two neighbours apart when the points lie far from the origin (coordinates near 1000
keep about three); centring costs two small kernels and brings every cloud back to where
float32 resolves it. The distances returned are then recomputed from coordinate
differences, in the order they rank, so they are exact for the neighbours found.

cuML takes no stream argument and waits on the host before it returns, so the operator
synchronises PyTorch's current stream before handing the inputs over, copies the results
into memory PyTorch owns (nothing returned aliases cuML's buffers), and carries the
``cudagraph_unsafe`` tag: a host synchronisation cannot be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from .. import positions
from ..checks import check_knn
from ..registry import CUDAGRAPH_UNSAFE

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "auto_choice",
    "centred",
    "knn_fake",
    "knn_op",
    "knn_plain",
    "search",
]

#: cuML's exact searches: ``brute`` compares every pair (in the expanded form); ``rbc``,
#: the random ball cover, prunes with the triangle inequality around sampled landmarks.
#: cuML's default, ``auto``, picks one by the data's shape; the book names it (chapter 3
#: times both).
ALGORITHMS = ("brute", "rbc")
DEFAULT_ALGORITHM = "rbc"


def check_algorithm(algorithm: object) -> str:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: expected one of {ALGORITHMS}, got {algorithm!r}")
    return algorithm


def search(p_query: torch.Tensor, p_ref: torch.Tensor, k: int, algorithm: str):
    """cuML's kNN on DLPack views of the inputs, the call chapter 3 starts from.

    Args:
        p_query: ``(M, 3)`` float32 CUDA; p_ref: ``(N, 3)`` float32 CUDA.
        k: neighbours per query; algorithm: one of :data:`ALGORITHMS`.

    Returns:
        distances and indices, ``(M, k)`` CuPy arrays owned by cuML (no centring, no
        exact distances: :func:`knn_plain` and :func:`knn_op` add both).
    """
    import cupy
    from cuml.neighbors import NearestNeighbors

    # Zero-copy views: the CuPy arrays point at the tensors' own memory.
    ref = cupy.from_dlpack(p_ref.detach())
    query = cupy.from_dlpack(p_query.detach())
    nn = NearestNeighbors(n_neighbors=k, algorithm=algorithm, output_type="cupy").fit(
        ref
    )
    return nn.kneighbors(query, n_neighbors=k, return_distance=True)


def auto_choice(p_ref: torch.Tensor, k: int) -> str:
    """The search that cuML's default, ``algorithm="auto"``, picks for a reference
    cloud of this shape and ``k`` (cuML keeps its choice in a private attribute)."""
    import cupy
    from cuml.neighbors import NearestNeighbors

    _, ref = centred(p_ref, p_ref)
    return str(NearestNeighbors(n_neighbors=k).fit(cupy.from_dlpack(ref))._fit_method)


def centred(
    p_query: torch.Tensor, p_ref: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both clouds shifted by the reference cloud's mean (on the device, no
    synchronisation). Distances do not change; the float32 digits they are computed from
    come back."""
    centre = p_ref.detach().mean(dim=0)
    return p_query.detach() - centre, p_ref.detach() - centre


def exact_distances(
    p_query: torch.Tensor, p_ref: torch.Tensor, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distances to the found neighbours from coordinate differences, ascending along
    each row, with the indices in the same order."""
    d = positions.neighbour_distances(p_query, p_ref, indices)
    d, order = d.sort(dim=1)
    return d, indices.gather(1, order)


def knn_plain(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    k: int,
    algorithm: str = DEFAULT_ALGORITHM,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cuML's kNN called directly (no custom operator): ``(M, k)`` float32 distances
    ascending and ``(M, k)`` int64 indices. Breaks the graph of a compiled caller."""
    _, indices = search(*centred(p_query, p_ref), k, check_algorithm(algorithm))
    return exact_distances(p_query, p_ref, torch.from_dlpack(indices).long())


@torch.library.custom_op(
    "cuml::knn", mutates_args=(), device_types="cuda", tags=CUDAGRAPH_UNSAFE
)
def knn_op(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    k: int,
    algorithm: str = DEFAULT_ALGORITHM,
) -> tuple[torch.Tensor, torch.Tensor]:
    """k nearest reference points by cuML, as a PyTorch operator.

    Args:
        p_query: ``(M, 3)`` float32 CUDA, contiguous, finite.
        p_ref: ``(N, 3)`` float32 CUDA, contiguous, finite.
        k: ``1 <= k <= N``.
        algorithm: one of :data:`ALGORITHMS`.

    Returns:
        distances ``(M, k)`` float32 ascending, indices ``(M, k)`` int64; fresh tensors
        owned by PyTorch's allocator, ready on the current stream.
    """
    check_knn(p_query, p_ref, k)
    check_algorithm(algorithm)
    q, r = centred(p_query, p_ref)
    stream = torch.cuda.current_stream(p_query.device)
    # cuML runs on its own stream: the inputs must be complete before it reads them.
    stream.synchronize()
    _, found = search(q, r, k, algorithm)
    indices = torch.empty(
        (p_query.shape[0], k), dtype=torch.int64, device=p_query.device
    )
    # Copy out of cuML's buffer on PyTorch's stream and wait for the copy, so that the
    # buffer may be freed (and reused by cuML) as soon as this function returns.
    indices.copy_(torch.from_dlpack(found))
    stream.synchronize()
    return exact_distances(p_query, p_ref, indices)


@knn_op.register_fake
def knn_fake(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    k: int,
    algorithm: str = DEFAULT_ALGORITHM,
):
    """The fake of ``cuml::knn`` (chapter 3): output shapes and dtypes, no search.

    The real operator's contract, metadata only: a compiled caller fails at trace time.
    """
    check_knn(p_query, p_ref, k, values=False)
    check_algorithm(algorithm)
    m = p_query.shape[0]
    return p_query.new_empty((m, k)), p_query.new_empty((m, k), dtype=torch.int64)


# The distances differentiate with respect to both clouds, the neighbours held fixed
# (chapter 6's formula): cuML's neighbours, whose order of ties is cuML's own.
positions.register_knn_autograd("cuml::knn")
