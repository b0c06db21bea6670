"""Backends as plug-ins: one record per backend, one registration each (chapter 3 adds
the second backend; every later chapter adds one the same way).

The registry is the one place where facts about a backend live, in two records:

- :class:`Backend`, the runtime record: the devices it runs on, a test of whether its
  library is installed, its implementation of each operation it provides, the custom
  operators that implement them (``operators``; whether each has an autograd formula
  is read from the dispatcher, :meth:`Backend.has_autograd`, never restated), the
  gradients it takes with respect to the clouds, and the compiled libraries it needs
  (``library``: the file of its own; ``libraries``: the backends whose files a process
  without this package loads to run it; ``python_module``: the module that defines its
  operators in Python, if any).
- :class:`Book`, the book record (``Backend.book``): the chapter that teaches it, the
  ``toolchain`` a reader needs beside PyTorch (the guide of chapter 12 prints it), its
  variants in the benchmark (``variants``, a function that builds them, so that this
  module imports nothing of :mod:`extkernels.variants`) or why it has none
  (``not_benchmarked``), what the parts of their names mean (``glossary``), its rows
  of the guide (``advice``), its search methods in chapter 14 (``methods``) and the
  workload of the projector chapter 15 packages (``shipped``).

Everything else that lists backends is generated from these records:
:data:`extkernels.variants.VARIANTS`, :data:`extkernels.experiments.geometry.METHODS`,
:func:`extkernels.experiments.shipping.shipped`, the guide and its glossary
(:mod:`extkernels.guide`) are read from the registry when asked for, so a backend
registered later (a test's) is in them too. The guide lists its rows in the book's
order of advice (:data:`PREFERENCE`).

A kNN backend writes only its search: ``knn_aggregate`` is then derived from it (the
search under ``no_grad``, then :func:`~extkernels.ops.gather.softmax_gather`), so every
kNN backend is a projector at once. ``operators`` names the backend's custom operators
that take an operation's arguments, so that the conformance suite
(``tests/test_backends.py``) runs ``opcheck`` on them: a new backend gets the suite by
registering.

A batch of clouds (``query_offsets``, ``ref_offsets``: :mod:`~extkernels.ops.batches`)
reaches a backend's implementation in one call where its record lists the operation in
``batched``; for any other operation the entry point loops over the clouds, calling the
single-cloud implementation once per cloud (:func:`~extkernels.ops.batches.per_cloud`).

A backend is one folder, ``ops/<backend>/``, whose ``__init__`` registers it:
``extkernels.ops`` imports every such folder it finds, so that adding a backend edits no
other file.

Compiled extensions (a CUDA C++ backend) keep their sources inside their backend's
folder (``ops/<backend>/csrc/``) and are built just in time, on first use, into
PyTorch's extension cache (``TORCH_EXTENSIONS_DIR``, by default under
``~/.cache/torch_extensions``), never into the source tree: a checkout stays clean and
every machine builds for its own GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .gather import softmax_gather
from .positions import refuse_position_grads, wants_grad

__all__ = [
    "OPERATIONS",
    "NEIGHBOUR_LISTS",
    "CUDAGRAPH_UNSAFE",
    "PREFERENCE",
    "Backend",
    "Book",
    "register",
    "registered",
    "get",
    "scratch",
    "backends",
    "by_preference",
    "lookup",
    "check_position_grads",
]

OPERATIONS = ("knn", "knn_aggregate", "radius_aggregate")
#: Operations beside the projector's, which its benchmark and conformance suite do not
#: run: neighbour lists for graph layers. A backend may implement them too.
NEIGHBOUR_LISTS = ("radius_search",)
_ALL = OPERATIONS + NEIGHBOUR_LISTS

#: The backends in the order the book advises them, best first (chapter 12's guide
#: lists its rows of each workload so, :func:`by_preference`): the fused operators,
#: then those that need no C++ toolchain or that a reader may already use, the earlier
#: chapters' searches, and the brute force last. A backend not named comes after those
#: named, in the order of registration.
PREFERENCE = ("fused", "triton", "cuml", "warp", "cpp", "ptx", "torch")

#: Tags of a custom operator that synchronises with the host or keeps state in Python
#: between calls: inductor's CUDA graphs (``mode="reduce-overhead"``) partition around
#: it (``torch.Tag.cudagraph_unsafe``, torch >= 2.9; nothing on older releases).
CUDAGRAPH_UNSAFE: tuple = (
    (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
)


def _always() -> bool:
    return True


def _derive_knn_aggregate(knn: Callable) -> Callable:
    """``knn_aggregate`` from a search: the neighbours, then the differentiable
    softmax-gather-sum (gradients reach ``feats`` through the gather, and the clouds
    through the search's distances where it differentiates them)."""

    def knn_aggregate(p_query, p_ref, feats, k, sigma, **options):
        distances, indices = knn(p_query, p_ref, k, **options)
        return softmax_gather(distances, indices, feats, sigma)

    knn_aggregate.__doc__ = (
        f"kNN-weighted aggregation over the search of {knn.__module__}."
    )
    return knn_aggregate


@dataclass(frozen=True)
class Book:
    """What the book says of a backend beside its code.

    Attributes:
        chapter: the chapter that teaches it.
        toolchain: what a reader needs on their machine beyond PyTorch to run it, as
            the guide prints it (``"PyTorch only"``, ``"the warp-lang wheel"``...).
        variants: builds its variants of the benchmark (a list of
            :class:`extkernels.variants.Variant`, in the benchmark's order) from the
            module :mod:`extkernels.variants`, which it is given as its one argument,
            whenever :data:`extkernels.variants.VARIANTS` is read.
        not_benchmarked: why the benchmark has no variant of it; ``None`` (the
            default) when ``variants`` builds some (a test holds every registered
            backend to one or the other).
        glossary: what the parts of its variants' names mean (the results page's
            glossary): part -> words, listed in the order of the chapters.
        advice: builds its rows of the guide (a list of
            :class:`extkernels.guide.Advice`) from the module :mod:`extkernels.guide`,
            which it is given as its one argument; ``None`` (the default) for none.
        methods: its kNN search methods of chapter 14's geometry command: name ->
            options of :func:`extkernels.knn`.
        shipped: the workload (``"knn"`` or ``"radius"``) of its projector that
            chapter 15 exports and packages; ``None`` for none.
    """

    chapter: int = 1
    toolchain: str = ""
    variants: Callable[[], Sequence] | None = None
    not_benchmarked: str | None = None
    glossary: Mapping[str, str] = field(default_factory=dict)
    advice: Callable[[object], Sequence] | None = None
    methods: Mapping[str, Mapping] = field(default_factory=dict)
    shipped: str | None = None


@dataclass(frozen=True)
class Backend:
    """One backend: where it runs and what it implements.

    Attributes:
        name: the ``backend=`` of the public entry points (``torch``, ``cuml``,
            ``warp``...).
        devices: device types whose tensors it accepts.
        available: whether its library is installed (a cheap test: no import).
        knn, knn_aggregate, radius_aggregate, radius_search: its implementation of
            each operation (``radius_search`` optional, see :data:`NEIGHBOUR_LISTS`),
            called with checked arguments (see :mod:`~extkernels.ops.checks`) and the
            caller's extra keyword options; ``knn_aggregate`` is derived from ``knn``
            when not given.
        operators: operation -> qualified name (``"lib::name"``) of the custom operator
            that implements it with the operation's own arguments (what ``opcheck`` runs
            on).
        prepare: makes its custom operators exist (a just-in-time build of compiled
            ones); called before :meth:`operator` looks one up.
        position_grads: the operations it differentiates with respect to ``p_query``
            and ``p_ref`` (see :mod:`~extkernels.ops.positions`); a call of any other
            whose clouds require grad is refused at forward time. A derived
            ``knn_aggregate`` is differentiable where ``knn`` is.
        batched: the operations whose implementation takes a batch of clouds itself
            (keywords ``query_offsets`` and ``ref_offsets``, indices global); the entry
            points loop over the clouds for the others. A derived ``knn_aggregate`` is
            batched where ``knn`` is.
        library: the file of its own compiled operator library (what
            ``torch.ops.load_library`` loads in a process without this package),
            built or found when called; ``None`` when it has none to build.
        libraries: the backends whose ``library`` a process without this package
            loads to run its operators, in order.
        python_module: the module that defines its operators in Python, which such a
            process must import; ``None`` when they need no Python.
        book: what the book says of it (:class:`Book`); ``None`` for a backend the
            book does not teach.
    """

    name: str
    devices: tuple[str, ...] = ("cpu", "cuda")
    available: Callable[[], bool] = _always
    knn: Callable | None = None
    knn_aggregate: Callable | None = None
    radius_aggregate: Callable | None = None
    radius_search: Callable | None = None
    operators: Mapping[str, str] = field(default_factory=dict)
    prepare: Callable[[], object] = _always
    position_grads: tuple[str, ...] = ()
    batched: tuple[str, ...] = ()
    library: Callable[[], object] | None = None
    libraries: tuple[str, ...] = ()
    python_module: str | None = None
    book: Book | None = None

    def __post_init__(self) -> None:
        if self.knn is not None and self.knn_aggregate is None:
            object.__setattr__(self, "knn_aggregate", _derive_knn_aggregate(self.knn))
            if "knn" in self.position_grads:
                grads = (*self.position_grads, "knn_aggregate")
                object.__setattr__(self, "position_grads", tuple(dict.fromkeys(grads)))
            if "knn" in self.batched:
                batched = (*self.batched, "knn_aggregate")
                object.__setattr__(self, "batched", tuple(dict.fromkeys(batched)))
        unknown = set(self.batched) - set(OPERATIONS)
        if unknown:
            raise ValueError(
                f"batched: expected operations among {OPERATIONS}, got "
                f"{sorted(unknown)}"
            )
        unknown = set(self.position_grads) - set(_ALL)
        if unknown:
            raise ValueError(
                f"position_grads: expected operations among {_ALL}, got "
                f"{sorted(unknown)}"
            )
        unknown = set(self.operators) - set(_ALL)
        if unknown:
            raise ValueError(
                f"operators: expected keys among {_ALL}, got {sorted(unknown)}"
            )

    @property
    def chapter(self) -> int | None:
        """The chapter that teaches it (its book record's)."""
        return self.book.chapter if self.book else None

    @property
    def toolchain(self) -> str:
        """What a reader installs for it beyond PyTorch (its book record's)."""
        return self.book.toolchain if self.book else ""

    @property
    def not_benchmarked(self) -> str | None:
        """Why the benchmark has no variant of it (its book record's); a backend
        without a book record is no part of the book."""
        if self.book is None:
            return "no part of the book"
        return self.book.not_benchmarked

    def variants(self, kit) -> list:
        """Its variants of the benchmark, as its book record builds them with ``kit``
        (the module :mod:`extkernels.variants`, which the registry does not import)."""
        if self.book is None or self.book.variants is None:
            return []
        return list(self.book.variants(kit))

    def implements(self, op: str) -> bool:
        """Whether it provides operation ``op`` (directly or derived)."""
        return getattr(self, op, None) is not None

    def operator(self, op: str):
        """The custom operator implementing ``op`` (an ``OpOverload``), or ``None``."""
        qualname = self.operators.get(op)
        if qualname is None:
            return None
        self.prepare()
        namespace, name = qualname.split("::")
        return getattr(getattr(torch.ops, namespace), name).default

    def has_autograd(self, op: str) -> bool:
        """Whether the custom operator of ``op`` has an autograd formula, read from
        the operator once :attr:`prepare` made it exist. A ``custom_op`` or
        ``triton_op`` always has a kernel at the dispatcher's Autograd key (one that
        raises without a formula), so its definition is asked; an operator defined in
        C++ (``TORCH_LIBRARY``) has an Autograd kernel only once ``register_autograd``
        gave it one."""
        from torch._library.custom_ops import _maybe_get_opdef

        qualname = self.operators.get(op)
        if qualname is None:
            raise ValueError(
                f"op: {self.name!r} has custom operators for {sorted(self.operators)}, "
                f"got {op!r}"
            )
        self.prepare()
        opdef = _maybe_get_opdef(qualname)
        if opdef is not None:
            return opdef._backward_fn is not None
        return torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Autograd")

    def runs_on(self, device_type: str) -> bool:
        """Whether it can run on tensors of ``device_type`` on this machine."""
        here = device_type == "cpu" or (
            device_type == "cuda" and torch.cuda.is_available()
        )
        return device_type in self.devices and here and self.available()

    def runs_here(self) -> bool:
        """True when its library is installed and one of its devices exists here."""
        return any(self.runs_on(d) for d in self.devices)


_BACKENDS: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add ``backend`` (replacing one of the same name); returns it."""
    _BACKENDS[backend.name] = backend
    return backend


def registered() -> list[Backend]:
    """Every registered backend, whether or not it can run here (for the conformance
    suite)."""
    return list(_BACKENDS.values())


def get(name: str) -> Backend:
    """The backend registered as ``name``, whether or not it can run here."""
    if name not in _BACKENDS:
        raise ValueError(f"name: expected one of {sorted(_BACKENDS)}, got {name!r}")
    return _BACKENDS[name]


@contextlib.contextmanager
def scratch(*added: Backend, alone: bool = False) -> Iterator[None]:
    """A registry of the block's own: ``added`` are registered on entry and, with
    whatever the block registers, gone after it; ``alone=True`` also hides every other
    backend meanwhile (a test collects the conformance suite for its own backend so)."""
    global _BACKENDS
    before = _BACKENDS
    _BACKENDS = {} if alone else dict(before)
    try:
        for b in added:
            register(b)
        yield
    finally:
        _BACKENDS = before


def backends(op_name: str) -> list[str]:
    """Names of the backends of ``op_name`` that can run on this machine."""
    if op_name not in _ALL:
        raise ValueError(f"op_name: expected one of {_ALL}, got {op_name!r}")
    return [
        b.name for b in _BACKENDS.values() if b.implements(op_name) and b.runs_here()
    ]


def by_preference(backends: Sequence[Backend]) -> list[Backend]:
    """``backends`` in the book's order of advice (:data:`PREFERENCE`)."""
    rank = {name: i for i, name in enumerate(PREFERENCE)}
    return sorted(backends, key=lambda b: rank.get(b.name, len(PREFERENCE)))


def lookup(op: str, name: str, device: torch.device) -> Callable:
    """The implementation of ``op`` by backend ``name``, checked against the inputs'
    device."""
    b = _BACKENDS.get(name)
    if b is None or not b.implements(op):
        known = sorted(n for n, b in _BACKENDS.items() if b.implements(op))
        raise ValueError(f"backend: expected one of {known} for {op}, got {name!r}")
    if device.type not in b.devices:
        raise ValueError(
            f"backend: {name!r} runs on {' or '.join(b.devices)} tensors, got tensors "
            f"on {device}"
        )
    if not torch.compiler.is_compiling() and not b.available():
        raise RuntimeError(
            f"backend: {name!r} is not available on this machine (is it installed?)"
        )
    return getattr(b, op)


def check_position_grads(
    op: str, name: str, p_query: torch.Tensor, p_ref: torch.Tensor
) -> None:
    """At forward time, refuse a call of ``op`` by backend ``name`` whose clouds
    require grad when the backend cannot differentiate ``op`` with respect to them: no
    position that asked for a gradient ever gets ``None``. The error names the argument
    and the backends here that can."""
    needs = (wants_grad(p_query), wants_grad(p_ref))
    if op in _BACKENDS[name].position_grads or not any(needs):
        return
    others = [
        b.name
        for b in _BACKENDS.values()
        if op in b.position_grads and b.runs_on(p_query.device.type)
    ]
    refuse_position_grads(op, name, needs, others)
