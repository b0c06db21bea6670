"""The Warp kernels of the radius aggregation (chapters 5-6), each small enough to read
alone.

A :class:`warp.HashGrid` sorts the reference points into cubic cells of width
``radius``, so a query visits at most the 3 x 3 x 3 cells around it, and the cost grows
with the number of actual neighbours instead of ``M x N``. Every kernel walks the grid
around one query:

- :data:`aggregate_online` (the forward) computes the nearest neighbour's distance
  ``d0``, the sum of ``exp((d0 - d) / sigma)`` and the weighted features in one walk,
  rescaling its sums when a nearer neighbour turns up (an online softmax), and stores
  ``d0`` and ``1 / sum`` for the backward;
- :data:`normaliser` computes only ``d0`` and ``1 / sum`` (for a backward that finds
  none kept);
- :data:`aggregate` is the weighted sum given ``d0`` and ``1 / sum``: linear in
  ``feats``, so Warp differentiates it (its adjoint is the backward), which it could not
  do for the online kernel, whose rescaling depends on the order of the neighbours;
- :data:`scatter` is that backward written by hand (atomic adds into ``grad_feats``);
- :data:`positions` is the gradient with respect to both clouds (one thread per query,
  every feature).

One thread of the other kernels handles one query and four features (launch dimension
``(M, ceil(F / 4))``): neighbouring threads read neighbouring features of the same
reference point, so the reads coalesce, and the walk's geometry is computed once for
four features.
:func:`load4`, :func:`store4` and :func:`atomic_add4` move those four features.

This module imports Warp; the backend imports it on first use.
"""

# No ``from __future__ import annotations`` here: Warp reads the kernels' annotations as
# objects.
import torch

from .interop import warp

wp = warp()

#: Features per thread of the aggregate and scatter kernels.
CHUNK = 4
# Smallest normal float32: the clamp of the torch reference's normaliser.
TINY = wp.constant(float(torch.finfo(torch.float32).tiny))


@wp.func
def load4(a: wp.array2d(dtype=float), row: int, f0: int) -> wp.vec4:
    # Columns f0 .. f0 + 3 of a row; columns past the last one read the last one again
    # (their results are never stored, so they receive no gradient either).
    last = a.shape[1] - 1
    return wp.vec4(
        a[row, f0],
        a[row, wp.min(f0 + 1, last)],
        a[row, wp.min(f0 + 2, last)],
        a[row, wp.min(f0 + 3, last)],
    )


@wp.func
def store4(a: wp.array2d(dtype=float), row: int, f0: int, nf: int, v: wp.vec4):
    # ``nf`` is passed, not read from ``a``: the adjoint launch passes a null output
    # array.
    a[row, f0] = v[0]
    if f0 + 1 < nf:
        a[row, f0 + 1] = v[1]
    if f0 + 2 < nf:
        a[row, f0 + 2] = v[2]
    if f0 + 3 < nf:
        a[row, f0 + 3] = v[3]


@wp.func
def atomic_add4(a: wp.array2d(dtype=float), row: int, f0: int, v: wp.vec4):
    nf = a.shape[1]
    wp.atomic_add(a, row, f0, v[0])
    if f0 + 1 < nf:
        wp.atomic_add(a, row, f0 + 1, v[1])
    if f0 + 2 < nf:
        wp.atomic_add(a, row, f0 + 2, v[2])
    if f0 + 3 < nf:
        wp.atomic_add(a, row, f0 + 3, v[3])


@wp.kernel(enable_backward=False)
def aggregate_online(
    grid: wp.uint64,
    p_query: wp.array(dtype=wp.vec3),
    p_ref: wp.array(dtype=wp.vec3),
    feats: wp.array2d(dtype=float),
    radius: float,
    sigma: float,
    out: wp.array2d(dtype=float),
    shift: wp.array(dtype=float),
    inv_norm: wp.array(dtype=float),
):
    # The forward in one walk. The sums are kept relative to the nearest distance seen
    # so far and rescaled when a nearer neighbour turns up; the first chunk's thread
    # stores the final shift and 1 / sum for the backward.
    q, c = wp.tid()
    f0 = c * CHUNK
    x = p_query[q]
    nearest = float(radius)
    total = float(0.0)  # noqa: UP018 (a variable, not a constant, for Warp's loop)
    acc = wp.vec4()
    for j in wp.hash_grid_query(grid, x, radius):
        d = wp.length(x - p_ref[j])
        if d <= radius:
            if d < nearest:
                scale = wp.exp((d - nearest) / sigma)
                total = total * scale
                acc = acc * scale
                nearest = d
            w = wp.exp((nearest - d) / sigma)
            total += w
            acc += w * load4(feats, j, f0)
    # Clamped like the torch reference: an empty neighbourhood has total == 0 and its
    # output stays 0 (0 * 1 / tiny), without an infinity.
    s = 1.0 / wp.max(total, TINY)
    store4(out, q, f0, feats.shape[1], acc * s)
    if c == 0:
        shift[q] = nearest
        inv_norm[q] = s


@wp.kernel(enable_backward=False)
def normaliser(
    grid: wp.uint64,
    p_query: wp.array(dtype=wp.vec3),
    p_ref: wp.array(dtype=wp.vec3),
    radius: float,
    sigma: float,
    shift: wp.array(dtype=float),
    inv_norm: wp.array(dtype=float),
):
    # aggregate_online without the features: d0 and 1 / sum_j exp((d0 - d_qj) / sigma).
    q = wp.tid()
    x = p_query[q]
    nearest = float(radius)
    total = float(0.0)  # noqa: UP018
    for j in wp.hash_grid_query(grid, x, radius):
        d = wp.length(x - p_ref[j])
        if d <= radius:
            if d < nearest:
                total = total * wp.exp((d - nearest) / sigma)
                nearest = d
            total += wp.exp((nearest - d) / sigma)
    shift[q] = nearest
    inv_norm[q] = 1.0 / wp.max(total, TINY)


@wp.kernel
def aggregate(
    grid: wp.uint64,
    p_query: wp.array(dtype=wp.vec3),
    p_ref: wp.array(dtype=wp.vec3),
    feats: wp.array2d(dtype=float),
    shift: wp.array(dtype=float),
    inv_norm: wp.array(dtype=float),
    radius: float,
    sigma: float,
    out: wp.array2d(dtype=float),
):
    # The weighted sum given the normalisers: linear in feats, hence differentiable by
    # Warp (its adjoint replays the walk and reverses the accumulation).
    q, c = wp.tid()
    f0 = c * CHUNK
    x = p_query[q]
    d0 = shift[q]
    acc = wp.vec4()
    for j in wp.hash_grid_query(grid, x, radius):
        d = wp.length(x - p_ref[j])
        if d <= radius:
            acc += wp.exp((d0 - d) / sigma) * load4(feats, j, f0)
    store4(out, q, f0, feats.shape[1], acc * inv_norm[q])


@wp.kernel(enable_backward=False)
def scatter(
    grid: wp.uint64,
    p_query: wp.array(dtype=wp.vec3),
    p_ref: wp.array(dtype=wp.vec3),
    shift: wp.array(dtype=float),
    inv_norm: wp.array(dtype=float),
    radius: float,
    sigma: float,
    grad_out: wp.array2d(dtype=float),
    grad_feats: wp.array2d(dtype=float),
):
    # The hand-written backward: grad_feats[j, f] += w_qj / sum_q * grad_out[q, f] for
    # every neighbour j of q. Several queries share a neighbour, hence the atomic adds.
    q, c = wp.tid()
    f0 = c * CHUNK
    x = p_query[q]
    d0 = shift[q]
    g = load4(grad_out, q, f0) * inv_norm[q]
    for j in wp.hash_grid_query(grid, x, radius):
        d = wp.length(x - p_ref[j])
        if d <= radius:
            atomic_add4(grad_feats, j, f0, wp.exp((d0 - d) / sigma) * g)


@wp.kernel(enable_backward=False)
def positions(
    grid: wp.uint64,
    p_query: wp.array(dtype=wp.vec3),
    p_ref: wp.array(dtype=wp.vec3),
    feats: wp.array2d(dtype=float),
    shift: wp.array(dtype=float),
    inv_norm: wp.array(dtype=float),
    radius: float,
    sigma: float,
    grad_out: wp.array2d(dtype=float),
    out: wp.array2d(dtype=float),
    grad_query: wp.array(dtype=wp.vec3),
    grad_ref: wp.array(dtype=wp.vec3),
):
    # The clouds' gradient, neighbours held fixed. With a_j = exp((d0 - d_j) / sigma) /
    # sum, out = sum_j a_j feats[j], and g = grad_out[q]:
    #   dL / dd_j = -(a_j / sigma) * (<g, feats[j]> - <g, out>),
    # pulled along (x - p_ref[j]) / d_j onto the query and, negated, onto the reference
    # point (atomic adds: several queries share a neighbour). A pair at distance 0 has
    # no direction and contributes nothing, as in the torch reference.
    q = wp.tid()
    x = p_query[q]
    d0 = shift[q]
    scale = inv_norm[q] / sigma
    nf = feats.shape[1]
    g_out = float(0.0)  # noqa: UP018
    for c in range(nf):
        g_out += grad_out[q, c] * out[q, c]
    pulled = wp.vec3()
    for j in wp.hash_grid_query(grid, x, radius):
        diff = x - p_ref[j]
        d = wp.length(diff)
        if d <= radius and d > 0.0:
            g_f = float(0.0)  # noqa: UP018
            for c in range(nf):
                g_f += grad_out[q, c] * feats[j, c]
            pull = (-wp.exp((d0 - d) / sigma) * scale * (g_f - g_out) / d) * diff
            pulled += pull
            wp.atomic_add(grad_ref, j, -pull)
    grad_query[q] = pulled
