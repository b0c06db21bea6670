"""The PTX kernels as PyTorch custom operators (chapter 10): ``extkernels_ptx::gather``
and its adjoint ``extkernels_ptx::scatter``, with fake implementations, an autograd
formula, and argument checks that name the argument.

pyptx registers an operator of its own for every kernel it builds
(``pyptx::kernel_<handle>``, a list of tensors in, a list out). These wrap the kernels
in operators with a fixed name and a real signature instead, for three reasons the
chapter measures: one name for every shape (pyptx's name changes with each build), a
scatter that accumulates into a zeroed buffer (pyptx's operators allocate their outputs
and mutate nothing) and the checks (a bad index in a PTX kernel is an illegal memory
access, not an exception).

On CUDA tensors the operators launch the PTX kernels (a GPU of compute capability 9.0);
on the CPU they compute the same sums with PyTorch, so the operators, their fakes and
their gradients are testable anywhere.
"""

from __future__ import annotations

import torch

from ..capture import capturing
from ..checks import (
    alert_not_deterministic,
    check_contiguous,
    check_index_limit,
    check_same_device,
    check_tensor,
    values_checked,
)
from ..gather import gather as torch_gather
from ..gather import gather_weights_grad
from ..gather import scatter as torch_scatter
from . import kernels

__all__ = [
    "gather",
    "gather_cpu",
    "gather_fake",
    "scatter",
    "scatter_cpu",
    "scatter_fake",
    "gather_setup_context",
    "gather_backward",
    "check_neighbours",
    "check_hopper",
    "vector_aligned",
]

#: The compute capability the kernels are built for (``sm_90a``).
HOPPER = (9, 0)


def _check_matrix(name: str, t: object, dtype: torch.dtype, what: str) -> None:
    check_tensor(name, t, (dtype,), what)
    if t.dim() != 2 or t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(f"{name}: expected a non-empty {what}, got {tuple(t.shape)}")
    check_contiguous(name, t)


def _check_threads(name: str, m, f) -> None:
    """A thread per query and vector of features, ``M * F / vec_width(F)`` of them, at
    most :data:`~.kernels.MAX_THREADS` (its index and its row are 32-bit)."""
    threads = m * f
    if threads > kernels.MAX_THREADS:  # (only then is the vectors' width needed)
        threads = m * (f // kernels.vec_width(f))
    check_index_limit(
        name,
        "queries × feature vectors",
        threads,
        kernels.MAX_THREADS,
        "the PTX kernels index threads and rows with 32-bit integers: a thread per "
        "query and vector of 4 features, or of 1 where F is not a multiple of 4",
    )


def check_neighbours(
    weights: object,
    indices: object,
    rows: object,
    n_ref: int,
    *,
    rows_name: str = "feats",
    values: bool | None = None,
) -> None:
    """The arguments of both operators: ``(M, k)`` float32 weights, ``(M, k)`` int64
    indices into ``n_ref`` rows, and a float32 matrix ``rows`` (``feats`` ``(n_ref,
    F)`` for the gather, ``grad_out`` ``(M, F)`` for the scatter), all on one device.
    The threads, one per query and vector of features, must be countable in 32 bits
    (:data:`~.kernels.MAX_THREADS`). Where values are checked (see
    :func:`~extkernels.ops.checks.values_checked`), every index must lie in ``[0,
    n_ref)``: one host synchronisation."""
    if isinstance(n_ref, bool) or not isinstance(n_ref, (int, torch.SymInt)):
        raise TypeError(f"n_ref: expected an int, got {type(n_ref).__name__}")
    if isinstance(n_ref, int) and n_ref < 1:
        raise ValueError(f"n_ref: expected n_ref >= 1, got {n_ref}")
    _check_matrix("weights", weights, torch.float32, "(M, k) matrix")
    _check_matrix("indices", indices, torch.int64, "(M, k) matrix")
    if indices.shape != weights.shape:
        raise ValueError(
            f"indices: expected the shape of weights {tuple(weights.shape)}, got "
            f"{tuple(indices.shape)}"
        )
    _check_matrix(rows_name, rows, torch.float32, "(rows, F) matrix")
    want = n_ref if rows_name == "feats" else weights.shape[0]
    if rows.shape[0] != want:
        raise ValueError(f"{rows_name}: expected {want} rows, got {rows.shape[0]}")
    check_same_device(weights=weights, indices=indices, **{rows_name: rows})
    _check_threads(rows_name, weights.shape[0], rows.shape[1])
    if values is None:  # never while a CUDA graph is captured: nothing may be read back
        values = values_checked(indices) and not capturing()
    if values:
        lo, hi = indices.aminmax()
        lo, hi = int(lo), int(hi)  # the one synchronisation
        if lo < 0 or hi >= n_ref:
            raise ValueError(
                f"indices: expected rows in [0, {n_ref}), got values in [{lo}, {hi}]"
            )


def check_hopper(device: torch.device) -> None:
    """The kernels are built for ``sm_90a``: a GPU of compute capability 9.0."""
    capability = torch.cuda.get_device_capability(device)
    if capability != HOPPER:
        raise RuntimeError(
            f"weights: the PTX kernels are built for {kernels.ARCH} (compute "
            f"capability 9.0, Hopper), but {device} has compute capability "
            f"{capability[0]}.{capability[1]}"
        )


def vector_aligned(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` ``(n, F)`` as the kernels read them: where they read 16-byte vectors
    (``F`` a multiple of four, :func:`~.kernels.vec_width`) from a pointer that is not
    16-byte aligned (a contiguous view at an offset, such as ``buf[1:].view(n, 8)``), a
    copy at an aligned address; else ``rows`` itself. A vector load from a misaligned
    address is a sticky CUDA error that ends every later CUDA call of the process."""
    if kernels.vec_width(rows.shape[1]) == 1 or rows.data_ptr() % 16 == 0:
        return rows
    return rows.clone()  # the allocator's blocks start at 512-byte boundaries


# ------------------------------------------------------------------ the gather


@torch.library.custom_op("extkernels_ptx::gather", mutates_args=(), device_types="cuda")
def gather(
    weights: torch.Tensor, indices: torch.Tensor, feats: torch.Tensor
) -> torch.Tensor:
    """``out[q] = sum_j weights[q, j] * feats[indices[q, j]]``: ``(M, F)`` float32."""
    check_neighbours(weights, indices, feats, feats.shape[0])
    check_hopper(weights.device)
    return kernels.gather(weights, indices, vector_aligned(feats))


@gather.register_kernel("cpu")
def gather_cpu(weights, indices, feats):
    """The gather on CPU tensors, in PyTorch (chapter 10)."""
    check_neighbours(weights, indices, feats, feats.shape[0])
    return torch_gather(weights, indices, feats)


@gather.register_fake
def gather_fake(weights, indices, feats):
    """An empty ``(M, F)`` output, after the same metadata checks (chapter 10)."""
    check_neighbours(weights, indices, feats, feats.shape[0], values=False)
    return feats.new_empty((weights.shape[0], feats.shape[1]))


# ----------------------------------------------------------------- the scatter


@torch.library.custom_op(
    "extkernels_ptx::scatter", mutates_args=(), device_types="cuda"
)
def scatter(
    grad_out: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, n_ref: int
) -> torch.Tensor:
    """The gather's adjoint: ``grad[indices[q, j]] += weights[q, j] * grad_out[q]``,
    ``(n_ref, F)`` float32, by atomic reductions into zeros (the order of the additions
    varies from run to run: the result, by a few units in the last place; refused under
    ``torch.use_deterministic_algorithms(True)``)."""
    check_neighbours(weights, indices, grad_out, n_ref, rows_name="grad_out")
    check_hopper(weights.device)
    alert_not_deterministic("extkernels_ptx::scatter (atomic reductions of rows)")
    grad = grad_out.new_zeros((n_ref, grad_out.shape[1]))  # aligned: a fresh block
    kernels.scatter(weights, indices, vector_aligned(grad_out), grad)  # adds into grad
    return grad


@scatter.register_kernel("cpu")
def scatter_cpu(grad_out, weights, indices, n_ref):
    """The scatter on CPU tensors, by ``index_add_`` (chapter 10)."""
    check_neighbours(weights, indices, grad_out, n_ref, rows_name="grad_out")
    return torch_scatter(grad_out, weights, indices, n_ref)


@scatter.register_fake
def scatter_fake(grad_out, weights, indices, n_ref):
    """An empty ``(n_ref, F)`` output, after the same metadata checks (chapter 10)."""
    check_neighbours(
        weights, indices, grad_out, n_ref, rows_name="grad_out", values=False
    )
    return grad_out.new_empty((n_ref, grad_out.shape[1]))


# -------------------------------------------------------------------- autograd


def gather_setup_context(ctx, inputs, output):
    """Keeps the weights, the indices and (for the weights' gradient) the features
    (chapter 10)."""
    weights, indices, feats = inputs
    ctx.n_ref = feats.shape[0]
    ctx.save_for_backward(weights, indices, feats if ctx.needs_input_grad[0] else None)


def gather_backward(ctx, grad_out):
    """``feats`` by the scatter; ``weights`` (when they need it) by PyTorch:
    ``grad_weights[q, j] = <grad_out[q], feats[indices[q, j]]>`` (chapter 10). A
    backward that autograd records (``create_graph=True``) scatters in PyTorch, so that
    it can be differentiated again."""
    weights, indices, feats = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    grad_weights = grad_feats = None
    if ctx.needs_input_grad[0]:
        grad_weights = gather_weights_grad(grad_out, indices, feats)
    if ctx.needs_input_grad[2]:
        adjoint = torch_scatter if torch.is_grad_enabled() else scatter
        grad_feats = adjoint(grad_out, weights, indices, ctx.n_ref)
    return grad_weights, None, grad_feats


gather.register_autograd(gather_backward, setup_context=gather_setup_context)
