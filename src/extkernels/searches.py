"""The searches that chapter 14 compares, by name, and the JSON file that its geometry
and traits commands build together.

:func:`search_methods` reads the book's kNN methods from the registry; with the other
libraries (:data:`LIBRARIES`) and the radius aggregations (:data:`RADIUS`) they are
what :func:`searcher` turns into a call on a workload. :func:`merge_into` adds one
command's rows to the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from . import clouds
from .ops import knn, radius_aggregate, registry
from .provenance import joined_meta

__all__ = ["LIBRARIES", "RADIUS", "merge_into", "search_methods", "searcher"]


def search_methods() -> dict[str, tuple[str, dict]]:
    """The book's search methods, read from the registry (each backend's book record's
    ``methods``), the latest chapter's first: name -> (backend, options of
    :func:`extkernels.knn`). The geometry command's ``METHODS`` is the same, generated
    when read."""
    taught = [b for b in registry.registered() if b.book and b.book.methods]
    taught.sort(key=lambda b: -b.book.chapter)
    return {
        name: (b.name, dict(options))
        for b in taught
        for name, options in b.book.methods.items()
    }


def _cuvs(w: clouds.Workload, k: int):
    """cuVS's brute force (squared Euclidean, expanded as |q|^2 + |p|^2 - 2 q.p)."""
    import cupy as cp
    from cuvs.neighbors import brute_force

    def search():
        index = brute_force.build(cp.from_dlpack(w.p_ref), metric="sqeuclidean")
        d2, rows = brute_force.search(index, cp.from_dlpack(w.p_query), k)
        d2 = torch.as_tensor(cp.asarray(d2), device=w.p_ref.device)
        rows = torch.as_tensor(cp.asarray(rows), device=w.p_ref.device)
        return d2.clamp_min(0).sqrt(), rows.long()

    return search


def _cupy_knn(w: clouds.Workload, k: int):
    """cupy-knn's linear BVH (points in Morton order, leaves of 32): built every call;
    its kernels are compiled once, before timing."""
    import cupy as cp
    from cupy_knn import LBVHIndex

    index = LBVHIndex(leaf_size=32)
    index.build(cp.from_dlpack(w.p_ref))
    index.prepare_knn_default(k)

    def search():
        index.build(cp.from_dlpack(w.p_ref))
        rows, d2, _ = index.query_knn(cp.from_dlpack(w.p_query))
        d2 = torch.as_tensor(cp.asarray(d2), device=w.p_ref.device)
        rows = torch.as_tensor(cp.asarray(rows), device=w.p_ref.device)
        return d2.clamp_min(0).sqrt(), rows.long()

    return search


#: Libraries a reader would otherwise pick, called directly: name -> a function of
#: (workload, k) that returns a search (distances, rows).
LIBRARIES = {"cuvs": _cuvs, "cupy-knn": _cupy_knn}


#: The radius aggregation on the same clouds (radius and sigma 0.1, 25 features, as
#: the book's radius projector): name -> backend of :func:`extkernels.radius_aggregate`.
RADIUS = {"fused-radius": "fused", "warp-radius": "warp"}


def searcher(method: str, w: clouds.Workload, k: int):
    """The call that runs ``method`` (a key of :func:`search_methods`,
    :data:`LIBRARIES` or :data:`RADIUS`) once on workload ``w``: a function of no
    argument, which returns the search's ``(distances, rows)`` (a radius method's
    aggregation)."""
    if method in LIBRARIES:
        return LIBRARIES[method](w, k)
    if method in RADIUS:
        g = torch.Generator().manual_seed(0)
        feats = torch.randn(w.p_ref.shape[0], 25, generator=g).to(w.p_ref.device)
        return lambda: radius_aggregate(
            w.p_query, w.p_ref, feats, 0.1, 0.1, backend=RADIUS[method]
        )
    backend, options = search_methods()[method]
    return lambda: knn(w.p_query, w.p_ref, k, backend=backend, **options)


def merge_into(path: str, parts: dict) -> None:
    """Adds ``parts`` to the JSON at ``path`` (runs, checks and traits are appended; a
    method timed or checked again replaces its earlier rows; one run card for every
    call, :func:`~extkernels.provenance.joined_meta`; ``skipped`` lists the methods
    that did not load, until one is timed), so that several calls build one file."""
    data = json.loads(Path(path).read_text()) if os.path.exists(path) else {}
    parts = dict(parts)
    timed = {r["method"] for r in parts.get("runs", [])}
    skipped = [*data.pop("skipped", []), *parts.pop("skipped", [])]
    if skipped := [m for m in dict.fromkeys(skipped) if m not in timed]:
        data["skipped"] = skipped
    if "meta" in parts and "meta" in data:  # one run card for every call
        parts = {**parts, "meta": joined_meta([data["meta"], parts["meta"]], "parts")}
    for key in ("runs", "checks", "traits"):
        if key in parts and key in data:
            again = {r["method"] for r in parts[key]}
            kept = [r for r in data[key] if r["method"] not in again]
            parts = {**parts, key: kept + parts[key]}
    data.update(parts)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {path}")
