"""Every version of the running example, as the benchmark command and the chapters run
them (chapter 1 onward; each variant names the chapter that introduces it).

A :class:`Variant` says which workload (``knn`` or ``radius``), which backend and
whether it is compiled; :meth:`Variant.build` makes the model and data at a
:class:`~extkernels.Problem`'s sizes and :func:`run` times it by the book's protocol.
A backend's variants live in its registration (``Book.variants``, in its folder of
:mod:`extkernels.ops`), which builds them with this module; only the floor variants,
which run no backend, live here. :data:`VARIANTS` is generated from the registry each
time it is read (see :func:`variants`). A registered backend without variants says why
(``Book.not_benchmarked``); ``tests/test_registry.py`` holds every backend to one or
the other.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .clouds import workload
from .data import query_grid, reference_cloud, targets
from .graphs import IN_ONE_GRAPH
from .memory import use_rmm_pool
from .models import FixedGather, KnnAggregation, Projector, RadiusAggregation, Shifted
from .ops import backends, registry
from .packaging import Packaged, just_in_time
from .problem import Problem
from .timing import Timing, first_call_seconds, time_projector
from .training import make_forward, make_train_step

__all__ = [
    "FLOOR",
    "IN_ONE_GRAPH",
    "Variant",
    "VARIANTS",  # noqa: F822  (generated when read, see __getattr__)
    "compiled",
    "use_rmm_pool",
    "variants",
    "get",
    "run",
    "baseline_of",
    "chapters",
]

#: The ``backend`` of a floor variant: the aggregation replaced by
#: :class:`~extkernels.models.FixedGather` (no search, no custom operator), so that it
#: times everything else a projector does: the MLPs, the loss, autograd and Adam.
FLOOR = "floor"


@dataclass(frozen=True)
class Variant:
    """One version of the projector.

    Attributes:
        name: short unique name, used on the command line and in tables.
        workload: ``knn`` or ``radius``.
        backend: backend of the aggregation (see :func:`extkernels.backends`), or
            :data:`FLOOR` for no aggregation at all (the floor under every backend).
        compile: wrap the model in ``torch.compile``.
        fullgraph: compile with ``fullgraph=True`` (fail on any graph break).
        chapter: the chapter that introduces it.
        options: extra keyword arguments of the aggregation's backend.
        isolated: must run in a process of its own (it changes process-wide state, such
            as PyTorch's allocator), which the benchmark command arranges.
        setup: called once before anything is allocated on the device.
        backward_thread: let autograd run CUDA backward nodes on its own device thread
            (the default). With ``False`` the whole variant runs under
            ``torch.autograd.set_multithreading_enabled(False)``, so backward passes run
            on the calling thread: backward formulas written in Python (the Warp
            operators') then skip the hand-over to that thread.
        graphs: time the forward pass and the training step each captured in one CUDA
            graph and replayed (:mod:`extkernels.graphs`); needs a CUDA device.
        mode: ``torch.compile``'s mode (``"reduce-overhead"``: inductor replays the
            compiled graphs as CUDA graphs, around operators tagged unsafe for them).
        inductor: ``torch.compile``'s ``options``, inductor's settings for this
            model (:data:`~extkernels.graphs.IN_ONE_GRAPH`, named here too); empty
            for its defaults.
        cloud: the reference cloud and queries, one of
            :data:`extkernels.clouds.GEOMETRIES` (chapter 14); ``"normal"`` is the
            book's cloud on its query grid.
        jit: build the C++ libraries just in time, as a process without the
            ``extkernels-native`` wheel does, and in the cold run into an empty
            extension cache: the first call a reader's first run pays (chapter 15).
        package: forward passes only, of the model exported and compiled by
            AOTInductor into a package and loaded back with ``aoti_load_package``
            (chapter 15); ``first_call_s`` is the load and the first call.
        positions: the projector moves both clouds by learned offsets
            (:class:`~extkernels.models.Shifted`), so that its training step
            differentiates the aggregation with respect to the positions (chapter 6).
        after: the name of the variant it follows in :data:`VARIANTS` (one of another
            backend's); ``None``: it follows its own backend's previous variant.
    """

    name: str
    workload: str
    backend: str
    compile: bool = False
    fullgraph: bool = False
    chapter: int = 1
    options: dict = field(default_factory=dict)
    isolated: bool = False
    setup: Callable[[], None] | None = None
    backward_thread: bool = True
    graphs: bool = False
    mode: str | None = None
    inductor: dict = field(default_factory=dict)
    cloud: str = "normal"
    jit: bool = False
    package: bool = False
    positions: bool = False
    after: str | None = None

    @property
    def op(self) -> str:
        return "knn_aggregate" if self.workload == "knn" else "radius_aggregate"

    def available(self) -> bool:
        """True when it can run on this machine."""
        return self.unavailable_reason() is None

    def unavailable_reason(self) -> str | None:
        """Why it cannot run on this machine, or ``None`` when it can."""
        if self.backend != FLOOR and self.backend not in backends(self.op):
            return f"backend {self.backend!r} cannot run on this machine"
        if self.graphs and not torch.cuda.is_available():
            return "CUDA graphs need a CUDA GPU"
        if self.jit and (
            self.backend == FLOOR or registry.get(self.backend).library is None
        ):
            return f"backend {self.backend!r} has no library to build"
        return None

    def build(self, prob: Problem):
        """The model (eager), the callable to time (compiled or not) and the data.

        Returns:
            ``(model, run, (p_query, p_ref, target))``.
        """
        n_ref = prob.cloud_size(self.workload)
        if self.cloud == "normal":
            p_ref = reference_cloud(n_ref, seed=prob.seed, device=prob.device)
            p_query = query_grid(prob.grid_side, device=prob.device)
        else:
            w = workload(
                self.cloud,
                n_ref,
                side=prob.grid_side,
                seed=prob.seed,
                device=prob.device,
            )
            p_ref, p_query = w.p_ref, w.p_query
        target = targets(p_query.shape[0], seed=prob.seed, device=prob.device)
        if self.backend == FLOOR:
            agg = FixedGather(p_query.shape[0], n_ref, seed=prob.seed)
        elif self.workload == "knn":
            agg = KnnAggregation(prob.k, prob.sigma, self.backend, **self.options)
        else:
            agg = RadiusAggregation(
                prob.radius, prob.sigma, self.backend, **self.options
            )
        torch.manual_seed(prob.seed)
        model = Projector(agg, prob.hidden)
        model = (Shifted(model) if self.positions else model).to(prob.device)
        if self.package:
            return (
                model,
                Packaged(model, p_query, p_ref),
                (p_query, p_ref, target),
            )
        options = {"options": self.inductor} if self.inductor else {}
        run_model = (
            torch.compile(model, fullgraph=self.fullgraph, mode=self.mode, **options)
            if self.compile
            else model
        )
        return model, run_model, (p_query, p_ref, target)


def compiled(name: str, backend: str, chapter: int, **options) -> Variant:
    """A variant compiled with ``fullgraph=True``, named ``workload/...``."""
    workload = name.partition("/")[0]
    return Variant(
        name,
        workload,
        backend,
        compile=True,
        fullgraph=True,
        chapter=chapter,
        **options,
    )


#: The floor variants, which run no backend: everything but the aggregation.
FLOORS = (
    Variant("knn/floor", "knn", FLOOR, chapter=9),
    Variant("knn/floor+graphs", "knn", FLOOR, chapter=9, graphs=True),
    # its backward on the calling thread (chapter 7)
    Variant("radius/floor+1thread", "radius", FLOOR, chapter=7, backward_thread=False),
    Variant("radius/floor", "radius", FLOOR, chapter=11),
    Variant("radius/floor+graphs", "radius", FLOOR, chapter=11, graphs=True),
)


def variants() -> list[Variant]:
    """Every variant of the benchmark, generated from the registry: per workload (in
    the order they first appear), the backends in the order of their chapters (the
    order of registration among equals), each with its variants in the order its
    registration builds them, and the floor variants after the last backend of a
    chapter up to theirs; a variant that names another in ``after`` comes right after
    it. The list is built again only when the registry has changed, so that the same
    name gives the same variant meanwhile."""
    every = registry.registered()
    cached = _CACHE.get("for")
    if (
        cached is None
        or len(cached) != len(every)
        or any(a is not b for a, b in zip(cached, every, strict=True))
    ):
        _CACHE["for"], _CACHE["variants"] = every, _generated()
    return list(_CACHE["variants"])


_CACHE: dict[str, list] = {}


def _generated() -> list[Variant]:
    this = sys.modules[__name__]
    taught = sorted(
        (b for b in registry.registered() if b.book is not None),
        key=lambda b: b.book.chapter,
    )
    built = [(b.book.chapter, b.variants(this)) for b in taught]
    if any(
        v.backend != b.name
        for b, (_, vs) in zip(taught, built, strict=True)
        for v in vs
    ):
        raise ValueError("variants: a backend's book builds variants of another")
    workloads = dict.fromkeys(
        v.workload for _, vs in built for v in vs
    ) | dict.fromkeys(v.workload for v in FLOORS)
    placed: list[Variant] = []
    for work in workloads:
        floors = [v for v in FLOORS if v.workload == work]
        for chapter, vs in built:
            placed += [v for v in floors if v.chapter < chapter]
            floors = [v for v in floors if v.chapter >= chapter]
            placed += [v for v in vs if v.workload == work]
        placed += floors
    ordered = [v for v in placed if v.after is None]
    for v in placed:
        if v.after is not None:
            names = [u.name for u in ordered]
            where = names.index(v.after) + 1 if v.after in names else len(ordered)
            ordered.insert(where, v)
    return ordered


def __getattr__(name: str):
    if name == "VARIANTS":
        return variants()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def chapters() -> dict[str, int]:
    """The chapter that teaches each variant, by the variant's name (the results page
    and chapter 12 print it beside every row)."""
    return {v.name: v.chapter for v in variants()}


def get(name: str) -> Variant:
    """The variant called ``name``."""
    every = variants()
    for v in every:
        if v.name == name:
            return v
    raise ValueError(f"name: expected one of {[v.name for v in every]}, got {name!r}")


def baseline_of(variant: Variant) -> str:
    """Name of the eager brute-force variant of the same workload (the speedup
    reference)."""
    return f"{variant.workload}/torch"


def run(variant: Variant, prob: Problem, *, cold: bool = True) -> dict:
    """Build and time one variant by the book's protocol.

    Returns:
        A :class:`~extkernels.timing.Timing` as a dict, plus ``workload`` and
        ``first_call_s`` (the first training step; for compiled variants it includes
        compiling the forward and backward graphs from scratch, with inductor's caches
        disabled). With ``cold=False`` the first step may use the compilers' caches;
        its time is ``warm_first_call_s`` and ``first_call_s`` is NaN.
    """
    if variant.setup is not None:
        variant.setup()
    if variant.jit:
        just_in_time(cold)
    if variant.compile:
        torch._dynamo.reset()  # nothing compiled earlier in this process is reused
    model, run_model, (p_query, p_ref, target) = variant.build(prob)
    with torch.autograd.set_multithreading_enabled(variant.backward_thread):
        first = (
            make_forward(run_model, p_query, p_ref)
            if variant.package
            else make_train_step(run_model, model.parameters(), p_query, p_ref, target)
        )
        # Inductor's on-disk caches would turn a recompilation into a lookup: measure it
        # cold.
        with (
            torch._inductor.config.patch(force_disable_caches=cold),
            warnings.catch_warnings(),
        ):
            warnings.filterwarnings("ignore", message=".*force_disable_caches")
            first_s = first_call_seconds(first, prob.device)
        t = time_projector(
            run_model,
            p_query,
            p_ref,
            target,
            n_warmup=prob.n_warmup,
            n_iters=prob.n_iters,
            params=model.parameters(),
            graphs=variant.graphs,
            train=not variant.package,
        )
    row = Timing(
        variant.name,
        t["forward_ms"],
        t["train_ms"],
        t["peak_mb"],
        prob.hardware,
        p_ref.shape[0],
        p_query.shape[0],
    ).__dict__
    return {
        **row,
        "workload": variant.workload,
        "first_call_s": first_s if cold else math.nan,
        "warm_first_call_s": math.nan if cold else first_s,
    }
