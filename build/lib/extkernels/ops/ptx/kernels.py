"""The aggregation's two memory-bound kernels written in PTX from Python with pyptx
(chapter 10): the weighted gather and its adjoint, the scatter.

``gather``: ``out[q, :] = sum_j weights[q, j] * feats[indices[q, j], :]``.
``scatter``: ``grad_feats[indices[q, j], :] += weights[q, j] * grad_out[q, :]``, by
atomic reductions (``red.global.add``) into a zeroed buffer that the caller passes in.

One thread owns one query and ``VEC`` consecutive features (four when ``F`` is a
multiple of four, read and written as one 16-byte vector; else one). The ``k``
neighbours are a loop unrolled at trace time: every shape is a constant in the PTX.
pyptx traces each function again, and ``ptxas`` builds it again, for every new
combination of shapes (``M``, ``k``, ``N``, ``F``): a build per shape.

Tracing needs no GPU: ``gather.ptx(M=..., K=..., N=..., F=...)`` returns the PTX text
on any machine. Launching needs a CUDA GPU of compute capability 9.0 (``sm_90a``:
Hopper), and cuda-python.
"""

from __future__ import annotations

from pyptx import Tile, kernel, ptx, reg
from pyptx.types import f32, pred, s64, u32, u64

__all__ = [
    "ARCH",
    "BLOCK",
    "MAX_THREADS",
    "gather",
    "scatter",
    "vec_width",
    "neighbour_label",
]

#: The target: Hopper's full feature set (``sm_90a``).
ARCH = "sm_90a"
#: Threads per block.
BLOCK = 256
#: The most threads, ``M * F / vec_width(F)``, the kernels take: a thread's index and
#: the row of ``out`` or ``grad_out`` it reads or writes (``q * F / vec + c``) are
#: ``u32`` registers (``mad.lo.u32`` in :func:`_query_and_chunk` and the kernels), and
#: the count of threads is a ``u32`` immediate. The operators refuse more
#: (``ops.check_neighbours``).
MAX_THREADS = 2**32 - 1


def vec_width(n_feats: int) -> int:
    """Features per thread: 4 (one 16-byte vector) when ``F`` divides by 4, else 1."""
    return 4 if n_feats % 4 == 0 else 1


def _grid(M: int, F: int, **_) -> tuple[int, int, int]:
    threads = M * (F // vec_width(F))
    return ((threads + BLOCK - 1) // BLOCK, 1, 1)


def neighbour_label(j: int) -> str:
    """The PTX label that opens neighbour ``j``'s unrolled step (to find it in the
    text)."""
    return f"NEIGHBOUR_{j}"


def _query_and_chunk(n_queries: int, chunks: int) -> tuple:
    """This thread's query ``q`` and feature chunk ``c``; threads past the last
    ``(q, c)`` return at once."""
    t = reg.scalar(u32)
    tid = reg.scalar(u32)
    ptx.inst.mov.u32(t, ptx.special.ctaid.x())
    ptx.inst.mov.u32(tid, ptx.special.tid.x())
    ptx.inst.mad.lo.u32(t, t, BLOCK, tid)
    past = reg.scalar(pred)
    ptx.inst.setp.ge.u32(past, t, n_queries * chunks)
    ptx.ret(pred=past)
    q = reg.scalar(u32)
    c = reg.scalar(u32)
    ptx.inst.div.u32(q, t, chunks)
    ptx.inst.rem.u32(c, t, chunks)
    return q, c


def _row(base, index, row_bytes: int):
    """``base + index * row_bytes`` as a 64-bit address (``index`` a u32 register)."""
    offset = reg.scalar(u64)
    ptx.inst.mul.wide.u32(offset, index, row_bytes)
    address = reg.scalar(u64)
    ptx.inst.add.u64(address, base, offset)
    return address


def _load(dst: list, address) -> None:
    """Read-only (non-coherent cache) load of ``len(dst)`` floats."""
    if len(dst) == 4:
        ptx.inst.ld.global_.nc.v4.f32(dst, ptx.addr(address))
    else:
        ptx.inst.ld.global_.nc.f32(dst[0], ptx.addr(address))


@kernel(
    in_specs=(Tile("M", "K", f32), Tile("M", "K", s64), Tile("N", "F", f32)),
    out_specs=(Tile("M", "F", f32),),
    grid=_grid,
    block=(BLOCK, 1, 1),
    arch=ARCH,
)
def gather(weights, indices, feats, out):
    m, k = weights.shape
    n_feats = feats.shape[1]
    vec = vec_width(n_feats)
    pw, pi, pf, po = ptx.global_ptrs(weights, indices, feats, out)
    q, c = _query_and_chunk(m, n_feats // vec)

    w_row = _row(pw, q, k * 4)  # this query's k weights (float32)
    i_row = _row(pi, q, k * 8)  # and its k indices (int64)
    f_col = _row(pf, c, vec * 4)  # feats + this thread's first feature
    acc = [reg.scalar(f32, init=0.0) for _ in range(vec)]
    w = reg.scalar(f32)
    idx = reg.scalar(s64)
    src = reg.scalar(u64)
    v = [reg.scalar(f32) for _ in range(vec)]
    for j in range(k):
        ptx.label(neighbour_label(j))
        ptx.inst.ld.global_.nc.f32(w, ptx.addr(w_row, 4 * j))
        ptx.inst.ld.global_.nc.s64(idx, ptx.addr(i_row, 8 * j))
        ptx.inst.mad.lo.s64(src, idx, n_feats * 4, f_col)  # &feats[idx, c * vec]
        _load(v, src)
        for e in range(vec):
            ptx.inst.fma.rn.f32(acc[e], w, v[e], acc[e])
    ptx.label(neighbour_label(k))

    row = reg.scalar(u32)
    ptx.inst.mad.lo.u32(row, q, n_feats // vec, c)  # (q * F + c * vec) / vec
    dst = _row(po, row, vec * 4)
    if vec == 4:
        ptx.inst.st.global_.v4.f32(ptx.addr(dst), acc)
    else:
        ptx.inst.st.global_.f32(ptx.addr(dst), acc[0])
    ptx.ret()


@kernel(
    in_specs=(
        Tile("M", "K", f32),
        Tile("M", "K", s64),
        Tile("M", "F", f32),
        Tile("N", "F", f32),
    ),
    out_specs=(),
    grid=_grid,
    block=(BLOCK, 1, 1),
    arch=ARCH,
)
def scatter(weights, indices, grad_out, grad_feats):
    m, k = weights.shape
    n_feats = grad_out.shape[1]
    vec = vec_width(n_feats)
    pw, pi, pg, pf = ptx.global_ptrs(weights, indices, grad_out, grad_feats)
    q, c = _query_and_chunk(m, n_feats // vec)

    row = reg.scalar(u32)
    ptx.inst.mad.lo.u32(row, q, n_feats // vec, c)
    g = [reg.scalar(f32) for _ in range(vec)]
    _load(g, _row(pg, row, vec * 4))  # grad_out[q, c * vec:(c + 1) * vec]

    w_row = _row(pw, q, k * 4)
    i_row = _row(pi, q, k * 8)
    f_col = _row(pf, c, vec * 4)
    w = reg.scalar(f32)
    idx = reg.scalar(s64)
    dst = reg.scalar(u64)
    contrib = [reg.scalar(f32) for _ in range(vec)]
    for j in range(k):
        ptx.label(neighbour_label(j))
        ptx.inst.ld.global_.nc.f32(w, ptx.addr(w_row, 4 * j))
        ptx.inst.ld.global_.nc.s64(idx, ptx.addr(i_row, 8 * j))
        ptx.inst.mad.lo.s64(dst, idx, n_feats * 4, f_col)
        for e in range(vec):
            ptx.inst.mul.f32(contrib[e], w, g[e])
        if vec == 4:  # Hopper: one 16-byte atomic reduction
            ptx.inst.red.global_.add.v4.f32(ptx.addr(dst), contrib)
        else:
            ptx.inst.red.global_.add.f32(ptx.addr(dst), contrib[0])
    ptx.label(neighbour_label(k))
    ptx.ret()
