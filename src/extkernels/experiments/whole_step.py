"""The experiments of chapter 11: threads per query, the step captured by hand and the
replay's kernels, the step through ``mode="reduce-overhead"``, shapes that change
between calls, and lower precision.

Each function runs on the device of its inputs; those that need CUDA graphs say so.
The rows of the benchmark's table the chapter shows, and the numbers its prose quotes
from these tables, are in :mod:`~.whole_step_report`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pandas as pd
import torch
import torch.nn.functional as F
from torch.autograd import DeviceType

from ..data import query_grid, reference_cloud, targets
from ..graphs import (
    IN_ONE_GRAPH,
    CapturedStep,
    captured_forward,
    captured_train_step,
)
from ..models import KnnAggregation, Projector, RadiusAggregation
from ..ops import knn, knn_aggregate
from ..ops.checks import value_checks
from ..problem import Problem
from ..profiling import compiler_count, profile, reset_compiler, runtime_calls
from ..timing import first_call_seconds, time_blocks, time_fn

__all__ = [
    "lanes_table",
    "radius_kernels",
    "projector",
    "captured_steps",
    "replay_kernels",
    "reduce_overhead_step",
    "reduce_overhead_row",
    "pad_cloud",
    "changing_shapes",
    "rounded_search",
    "half_features",
]


def lanes_table(p_query, p_ref, feats, k: int, sigma: float, lanes, n_iters=200):
    """The fused kNN aggregation on chapter 9's grid (``index="grid"``; search, softmax,
    gather: one operator call) with each number of threads per query, beside chapter 9's
    operator.

    Returns:
        DataFrame indexed by ``threads per query`` (``"chapter 9"`` for the C++
        backend's operator): ``ms`` (median of blocks), ``min``, ``max``, and ``same
        neighbours`` (distances equal to chapter 9's search, bit for bit).
    """
    reference = knn(p_query, p_ref, k, backend="cpp")[0]
    rows = {}
    with value_checks(False):
        cpp = torch.ops.extkernels_cpp.knn_aggregate_fwd
        ms = time_blocks(lambda: cpp(p_query, p_ref, feats, k, sigma), n_iters)
        rows["chapter 9"] = (*ms, True)
        op = torch.ops.extkernels_fused.knn_aggregate_fwd
        for n in lanes:
            ms = time_blocks(
                lambda n=n: op(p_query, p_ref, feats, k, sigma, n, "grid"), n_iters
            )
            got = torch.ops.extkernels_fused.knn(p_query, p_ref, k, n, "grid")[0]
            rows[str(n)] = (*ms, bool(torch.equal(got, reference)))
    out = pd.DataFrame(rows, index=["ms", "min", "max", "same neighbours"]).T
    return out.infer_objects().rename_axis("threads per query")  # floats round


def radius_kernels(p_query, p_ref, feats, radius: float, sigma: float, n_iters=200):
    """The fused radius aggregation's forward and backward with each of its CUDA kernels
    (a warp per query, and one thread per (query, feature)), one operator call each.

    Returns:
        DataFrame indexed by kernel with ``forward ms`` and ``backward ms`` (medians of
        blocks of calls), and ``same output`` (forward outputs of the two equal to
        1e-5).
    """
    op = torch.ops.extkernels_fused.radius_aggregate_fwd
    bwd = torch.ops.extkernels_fused.radius_aggregate_bwd
    grad = torch.randn(p_query.shape[0], feats.shape[1], device=feats.device)
    rows, outs = {}, {}
    with value_checks(False):
        for label, warp in (
            ("a warp per query", True),
            ("a thread per feature", False),
        ):
            out, *saved = op(p_query, p_ref, feats, radius, sigma, warp)
            outs[label] = out

            def backward(saved=saved, warp=warp):
                return bwd(grad, p_query, *saved, radius, sigma, warp)

            forward = time_blocks(
                lambda w=warp: op(p_query, p_ref, feats, radius, sigma, w), n_iters
            )
            rows[label] = {
                "forward ms": forward[0],
                "backward ms": time_blocks(backward, n_iters)[0],
            }
    out = pd.DataFrame(rows).T
    a, b = outs.values()
    out["same output"] = bool(torch.allclose(a, b, atol=1e-5))
    return out.rename_axis("kernel")


def projector(workload: str, prob: Problem):
    """The projector of ``workload`` (``"knn"`` or ``"radius"``) with the fused
    backend's aggregation, its reference cloud and its targets, at the sizes of
    ``prob`` (chapter 11). The weights are seeded with ``prob.seed``, so every call
    builds the same model.

    Returns:
        ``(model, p_ref, target)``: the :class:`~extkernels.models.Projector` on
        ``prob.device``, the cloud ``(N, 3)`` float32 (``prob.n_ref`` or
        ``prob.n_ref_radius`` points) and the targets ``(M, 1)`` float32.
    """
    if workload == "knn":
        agg, n_ref = KnnAggregation(prob.k, prob.sigma, "fused"), prob.n_ref
    elif workload == "radius":
        agg = RadiusAggregation(prob.radius, prob.sigma, "fused")
        n_ref = prob.n_ref_radius
    else:
        raise ValueError(f'workload: expected "knn" or "radius", got "{workload}"')
    torch.manual_seed(prob.seed)
    model = Projector(agg, prob.hidden).to(prob.device)
    p_ref = reference_cloud(n_ref, seed=prob.seed, device=prob.device)
    target = targets(prob.n_query, seed=prob.seed, device=prob.device)
    return model, p_ref, target


def captured_steps(model, p_query, p_ref, target, n_iters: int = 200, top: int = 8):
    """The training step of ``model`` captured in one CUDA graph twice (chapter 11):
    with the eager model inside, then with ``torch.compile(model, fullgraph=True)``
    and inductor's settings for one graph (:data:`~extkernels.variants.IN_ONE_GRAPH`;
    inductor's kernels then run in the graph). Each is timed by replays, medians of
    five blocks of ``n_iters``, value checks off; then the kernels of the compiled
    step's replay are listed (:func:`replay_kernels`). Both steps train ``model``.

    Returns:
        ``(times, kernels)``: DataFrame indexed by the model in the graph
        (``eager``, ``compiled``) with ``ms``, ``min`` and ``max``; and the
        ``top`` kernels of a replay.
    """
    compiled = torch.compile(model, fullgraph=True, options=IN_ONE_GRAPH)
    times = {}
    with value_checks(False):
        for label, inside in (("eager", model), ("compiled", compiled)):
            step = captured_train_step(
                inside, model.parameters(), p_query, p_ref, target
            )
            ms = time_blocks(step, n_iters, repeats=5)
            times[label] = dict(zip(("ms", "min", "max"), ms, strict=True))
        kernels = replay_kernels(step, top=top)
    return pd.DataFrame(times).T, kernels


def replay_kernels(fn: Callable[[], object], n_iters: int = 20, top: int = 10):
    """The device kernels of ``fn`` (a replayed CUDA graph, say) under
    ``torch.profiler``, per call: the ``top`` by time, then one row for the rest.

    ``top_kernels`` (:mod:`~extkernels.profiling`) attributes device time to the
    operators that launched it; a graph's replay launches no operator, so this table
    lists the kernels themselves.

    Returns:
        DataFrame with ``kernel``, ``µs`` and ``share (%)`` of the summed kernel time,
        and ``calls`` per call of ``fn``.
    """
    prof = profile(fn, device=torch.device("cuda"), n_iters=n_iters, warmup=3)
    rows: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            name = e.name.split("(")[0].replace("void ", "").split("<")[0][-60:]
            row = rows.setdefault(name, [0.0, 0.0])
            row[0] += (e.time_range.end - e.time_range.start) / n_iters
            row[1] += 1 / n_iters
    df = pd.DataFrame(
        [(k, v[0], v[1]) for k, v in rows.items()], columns=["kernel", "µs", "calls"]
    ).sort_values("µs", ascending=False)
    total = df["µs"].sum()
    head, rest = df.head(top), df.iloc[top:]
    if len(rest):
        other = pd.DataFrame(
            [(f"{len(rest)} other kernels", rest["µs"].sum(), rest["calls"].sum())],
            columns=df.columns,
        )
        head = pd.concat([head, other])
    head = head.assign(**{"share (%)": 100 * head["µs"] / total})
    return head[["kernel", "µs", "share (%)", "calls"]].round(1).reset_index(drop=True)


def reduce_overhead_step(model, params, p_query, p_ref, target, lr: float = 1e-3):
    """A training step with the whole of its work compiled under
    ``mode="reduce-overhead"``: the loss with the model (one compiled function, forward
    and backward graphs), and Adam's update (a second one). Each call starts a new
    step of inductor's CUDA graphs (``cudagraph_mark_step_begin``), so the previous
    step's outputs may be overwritten.

    Returns:
        ``step()`` returning the loss (detached).
    """
    optimizer = torch.optim.Adam(list(params), lr=lr, capturable=True)

    def loss_fn(p_query, p_ref, target):
        return F.mse_loss(model(p_query, p_ref), target)

    loss_fn = torch.compile(loss_fn, mode="reduce-overhead", fullgraph=True)
    update = torch.compile(optimizer.step, mode="reduce-overhead")

    def step() -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(p_query, p_ref, target)
        loss.backward()
        update()
        return loss.detach()

    return step


def reduce_overhead_row(model, p_query, p_ref, target) -> dict[str, float]:
    """One row of chapter 11's table of the whole step compiled under
    ``mode="reduce-overhead"`` (:func:`reduce_overhead_step`): five steps of warm-up,
    then ``torch.profiler`` over ten steps to count the launches, then the time per
    step, medians of five blocks of 50, value checks off. Dynamo's warning about the
    profiler range that Adam's step opens is silenced for the process (its logs shown
    at ERROR only).

    Returns:
        ``ms per step``, and per step the ``graph launches`` and the ``kernel launches``
        outside any graph (kernels launched one at a time), as ints.
    """
    torch._logging.set_logs(dynamo=logging.ERROR)
    with value_checks(False):
        step = reduce_overhead_step(model, model.parameters(), p_query, p_ref, target)
        for _ in range(5):
            step()
        prof = profile(step, device=p_query.device, n_iters=10, warmup=2)
        ms = time_blocks(step, 50, repeats=5)
    calls = runtime_calls(
        prof, names=("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel")
    )
    graph = calls["name"] == "cudaGraphLaunch"
    # calls per step, averaged over the profiled steps: whole numbers, shown as such
    return {
        "ms per step": ms[0],
        "graph launches": round(float(calls.loc[graph, "calls"].sum())),
        "kernel launches": round(float(calls.loc[~graph, "calls"].sum())),
    }


def pad_cloud(p_ref: torch.Tensor, size: int, p_query: torch.Tensor) -> torch.Tensor:
    """``p_ref`` followed by ``size - N`` copies of one point placed so far away that
    no query can have it among its neighbours: beyond the box of both clouds by the
    box's own extent, farther from every query than any real point."""
    n = p_ref.shape[0]
    if size < n:
        raise ValueError(f"size: expected at least the cloud's {n} points, got {size}")
    both = torch.cat([p_ref, p_query])
    lo, hi = both.amin(0), both.amax(0)
    far = (hi + (hi - lo) + 1.0).expand(size - n, 3)
    return torch.cat([p_ref, far]).contiguous()


def _projector(backend: str, k: int, sigma: float, hidden: int, device):
    torch.manual_seed(0)
    return Projector(KnnAggregation(k, sigma, backend), hidden).to(device)


def changing_shapes(
    sizes: list[int], bucket: int, *, grid_side: int, k: int, sigma: float, hidden: int
) -> pd.DataFrame:
    """The kNN projector's forward pass on clouds of each of ``sizes`` points, called in
    turn (a size may come back: it finds what its first call built), four ways:
    compiled (inductor decides when to recompile), compiled with ``mark_dynamic`` on
    the cloud's length, one CUDA graph captured per size, and one graph for a padded
    bucket of ``bucket`` points (every size padded to it with :func:`pad_cloud`).

    Returns:
        DataFrame indexed by (strategy, call, points), ``call`` counting from 1, with
        ``first call ms`` (compiling or capturing included), ``ms per call`` after it,
        ``graphs`` (graphs inductor compiled, or CUDA graphs captured, so far) and
        ``exact`` (output equal to the eager projector's on the same cloud, to 1e-5).
    """
    device = torch.device("cuda")
    p_query = query_grid(grid_side, device=device)
    clouds = {n: reference_cloud(n, seed=n, device=device) for n in sizes}
    model = _projector("fused", k, sigma, hidden, device)
    with torch.no_grad():
        expected = {n: model(p_query, c) for n, c in clouds.items()}
    rows = {}

    def record(strategy, call, n, fn, count):
        first_ms = 1e3 * first_call_seconds(fn, device)
        exact = torch.allclose(fn()[: p_query.shape[0]], expected[n], atol=1e-5)
        rows[(strategy, call, n)] = {
            "first call ms": first_ms,
            "ms per call": time_fn(fn, 50),
            "graphs": int(count()),
            "exact": bool(exact),
        }

    for strategy in ("compiled", "compiled, mark_dynamic"):
        reset_compiler()
        compiled = torch.compile(model, fullgraph=True)

        def forward(cloud, compiled=compiled):
            with torch.no_grad():
                return compiled(p_query, cloud)

        for call, n in enumerate(sizes, 1):
            cloud = clouds[n]
            if strategy.endswith("mark_dynamic"):
                torch._dynamo.mark_dynamic(cloud, 0)
            record(
                strategy,
                call,
                n,
                lambda cloud=cloud: forward(cloud),
                lambda: compiler_count("stats", "unique_graphs"),
            )
    graphs: dict[int, CapturedStep] = {}
    for call, n in enumerate(sizes, 1):

        def replay(n=n):
            if n not in graphs:
                graphs[n] = captured_forward(model, p_query, clouds[n])
            return graphs[n]()

        record("one graph per size", call, n, replay, lambda: len(graphs))
    padded = pad_cloud(clouds[sizes[0]], bucket, p_query)
    bucket_graph = captured_forward(model, p_query, padded)
    for call, n in enumerate(sizes, 1):

        def replay_bucket(cloud=clouds[n]):
            padded.copy_(pad_cloud(cloud, bucket, p_query))
            return bucket_graph()

        record(f"one graph, padded to {bucket:,}", call, n, replay_bucket, lambda: 1)
    out = pd.DataFrame(rows).T.infer_objects()  # the columns' own types: floats round
    out.index.names = ["strategy", "call", "points"]
    return out


def rounded_search(p_query, p_ref, k: int, dtypes) -> pd.DataFrame:
    """The exact search on coordinates rounded to each of ``dtypes`` (and back to
    float32, which the search kernels take): the share of queries whose k neighbours
    are still the float32 search's, and the largest coordinate change.

    Returns:
        DataFrame indexed by dtype with ``same neighbours (%)`` and ``largest
        rounding``.
    """
    _, expected = knn(p_query, p_ref, k, backend="fused")
    rows = {}
    for dtype in dtypes:
        q, r = (t.to(dtype).float() for t in (p_query, p_ref))
        _, got = knn(q, r, k, backend="fused")
        same = (got.sort(1).values == expected.sort(1).values).all(1)
        change = max((q - p_query).abs().max().item(), (r - p_ref).abs().max().item())
        rows[str(dtype).removeprefix("torch.")] = {
            "same neighbours (%)": 100 * same.float().mean().item(),
            "largest rounding": change,
        }
    return pd.DataFrame(rows).T.rename_axis("coordinates")


def half_features(p_query, p_ref, feats, k: int, sigma: float, n_iters: int = 100):
    """The fused kNN aggregation with float32 and float16 features: largest relative
    error of the float16 output against float32, and the time per call of each.

    Returns:
        DataFrame indexed by features dtype with ``ms`` and ``relative error``.
    """
    rows = {}
    reference = knn_aggregate(p_query, p_ref, feats, k, sigma, backend="fused")
    scale = reference.abs().max().item()
    op = torch.ops.extkernels_fused.knn_aggregate_fwd
    with value_checks(False):
        for dtype in (torch.float32, torch.float16):
            x = feats.to(dtype)
            out = op(p_query, p_ref, x, k, sigma)[0]
            rows[str(dtype).removeprefix("torch.")] = {
                "ms": time_fn(lambda x=x: op(p_query, p_ref, x, k, sigma), n_iters),
                "relative error": (out.float() - reference).abs().max().item() / scale,
            }
    return pd.DataFrame(rows).T.rename_axis("features")
