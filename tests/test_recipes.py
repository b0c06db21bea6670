"""Each chapter's typed recipe runs outside the book.

A chapter's recipe is its code cells tagged ``recipe``: what a reader copies into a
script of their own, from the kernel to the registrations (and, in chapter 1, the model
and its training). Here they run in order in a fresh Python process on the CPU that
imports torch and the chapter's library but cannot import the book's package, on data
made with plain torch; then the operator the reader built is used as the chapter uses
it and checked against a brute force written here. The first error fails the test.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]

#: What every recipe finds before its first cell: the book's package out of reach, the
#: sizes a chapter reads from ``prob``, and the clouds, features and targets it names.
PREAMBLE = """
import math
import sys
import types

sys.modules["extkernels"] = None  # `import extkernels` raises: the recipe is on its own

import torch

torch.manual_seed(0)
prob = types.SimpleNamespace(
    device=torch.device("cpu"), k=7, sigma=0.1, radius=0.3, hidden=25, seed=0,
    n_ref=2000, grid_side=8,
)
axis = torch.linspace(-1.0, 1.0, prob.grid_side)
grid = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), dim=-1)
p_query = grid.reshape(-1, 3).contiguous()
p_ref = torch.randn(prob.n_ref, 3)
feats = torch.randn(prob.n_ref, prob.hidden)
target = torch.randn(p_query.shape[0], 1)
on_gpu = False


def _pairwise(q, r):
    return torch.cdist(q, r, compute_mode="donot_use_mm_for_euclid_dist")


def _knn_aggregate_brute(q, r, f, k, sigma):
    d, i = _pairwise(q, r).topk(k, dim=1, largest=False)
    return (torch.softmax(-d / sigma, dim=1)[:, :, None] * f[i]).sum(dim=1)


def _check_knn_aggregate(aggregate):
    # The reader's kNN aggregation against the brute force, on a slice: the output and
    # the features' gradient. Returns the slice and the features.
    q, r = p_query[:64], p_ref[:256]
    x, y = (feats[:256].clone().requires_grad_() for _ in range(2))
    out = aggregate(q, r, x, prob.k, prob.sigma)
    want = _knn_aggregate_brute(q, r, y, prob.k, prob.sigma)
    assert torch.allclose(out, want, atol=1e-5), "output"
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    want.backward(grad_out)
    assert torch.allclose(x.grad, y.grad, atol=1e-5), "feats gradient"
    return q, r, x


def _check_search_and_model(d, i, q, r, knn_aggregate):
    # A search's (d, i) on (q, r) against the brute force, then the aggregation built
    # on it against the brute force and, in chapter 1's projector, compiled and trained.
    want, want_i = _pairwise(q, r).topk(prob.k, dim=1, largest=False)
    assert torch.allclose(d, want, atol=1e-5), "distances"
    assert torch.equal(i.sort(1).values, want_i.sort(1).values), "neighbours"
    _check_knn_aggregate(lambda *a: knn_aggregate(*a))
    torch.manual_seed(prob.seed)
    model = Projector(lambda *a: knn_aggregate(*a, prob.k, prob.sigma))
    n = q.shape[0]
    ours = train(torch.compile(model, fullgraph=True), q, r, target[:n], steps=3)
    assert len(ours) == 3 and all(map(math.isfinite, ours)), ours


def _radius_aggregate_brute(q, r, f, radius, sigma):
    d = _pairwise(q, r)
    w = torch.where(d <= radius, torch.exp(-d / sigma), 0.0)
    return w / w.sum(dim=1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny) @ f
"""

#: Per chapter: the chapters whose recipes it builds on (chapter 1's projector and
#: training loop), the imports it takes from a cell that also imports the book's
#: package, and what the reader then does with the result (asserting what must hold).
CHAPTERS = {
    "01_eager_baseline": (
        (),
        "",
        """
        d, i = knn(p_query, p_ref, prob.k)
        want, _ = _pairwise(p_query, p_ref).topk(prob.k, dim=1, largest=False)
        assert torch.allclose(d, want, atol=1e-5), "knn: distances"
        assert len(ours) == 5 and all(map(math.isfinite, ours)), ours
        q = p_query.clone().requires_grad_()
        knn_aggregate(q, p_ref, feats, prob.k, prob.sigma).sum().backward()
        assert torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0, "no q gradient"
        """,
    ),
    "03_cuml_knn": (
        ("01_eager_baseline",),
        "from torch._subclasses.fake_tensor import FakeTensorMode\n",
        """
        # cuML needs a CUDA GPU: here the operator runs its fake, as the compiler does
        with FakeTensorMode():
            q, r = torch.empty(10, 3, device="cuda"), torch.empty(50, 3, device="cuda")
            d, i = knn(q, r, 7)
        assert d.shape == (10, 7) and i.dtype == torch.int64, (d.shape, i.dtype)
        assert d.device.type == "cuda", d.device
        q, r = torch.empty(9, 3, device="meta"), torch.empty(50, 3, device="meta")
        f = torch.empty(50, 4, device="meta")
        assert knn_aggregate(q, r, f, 7, 0.1).shape == (9, 4)
        """,
    ),
    "05_warp_radius": (
        ("01_eager_baseline",),
        "",
        """
        small = (p_query[:100], p_ref, feats, prob.radius, prob.sigma)
        want = _radius_aggregate_brute(*small)
        assert torch.allclose(radius_aggregate(*small), want, atol=1e-5)
        torch.library.opcheck(radius_aggregate, small)
        compiled = torch.compile(lambda *a: radius_aggregate(*a), fullgraph=True)
        assert torch.allclose(compiled(*small), want, atol=1e-5)
        assert ours.shape == (500, 1) and torch.isfinite(ours).all()
        """,
    ),
    "06_warp_backward": (
        ("01_eager_baseline",),
        "",
        """
        q, grad_out = p_query[:100], torch.randn(100, prob.hidden)
        x = feats.clone().requires_grad_()
        y = feats.clone().requires_grad_()
        radius_aggregate(q, p_ref, x, prob.radius, prob.sigma).backward(grad_out)
        _radius_aggregate_brute(q, p_ref, y, prob.radius, prob.sigma).backward(
            grad_out
        )
        assert torch.allclose(x.grad, y.grad, atol=1e-5), "feats gradient"
        torch.library.opcheck(radius_aggregate, (q, p_ref, x, prob.radius, prob.sigma))
        try:
            radius_aggregate(q.clone().requires_grad_(), p_ref, x, 0.3, 0.1)
        except ValueError as e:
            assert "p_query" in str(e), e
        else:
            raise AssertionError("a position gradient was not refused")
        assert len(ours) == 5 and all(map(math.isfinite, ours)), ours
        """,
    ),
    "09_cuda_knn": (
        ("01_eager_baseline",),
        "",
        """
        q, r, x = _check_knn_aggregate(knn_aggregate)
        torch.library.opcheck(torch.ops.tutorial.knn, (q, r, prob.k))
        assert len(ours) == 5 and all(map(math.isfinite, ours)), ours
        """,
    ),
    "10_ptx_gather": (
        ("01_eager_baseline",),
        "dev = prob.device\nsearch = lambda q, r, k: knn(q, r, k)  # chapter 1's knn\n",
        """
        q, r, x = _check_knn_aggregate(knn_aggregate)
        d, i = knn(q, r, prob.k)
        torch.library.opcheck(gather, (torch.softmax(-d / prob.sigma, 1), i, x))
        assert len(ours) == 5 and all(map(math.isfinite, ours)), ours
        """,
    ),
    "14_real_clouds": (
        ("01_eager_baseline",),
        "",
        """
        q, r = p_query[:64], p_ref[:500]
        torch.library.opcheck(tree_knn, (q, r, prob.k))
        _check_search_and_model(*tree_knn(q, r, prob.k), q, r, knn_aggregate)
        """,
    ),
    "15_shipping": (
        ("01_eager_baseline",),
        "",
        """
        q, r = p_query[:64], p_ref[:500]
        distances = torch.empty(64, prob.k)
        indices = torch.empty(64, prob.k, dtype=torch.long)
        knn_into(q, r, prob.k, distances, indices)
        _check_search_and_model(distances, indices, q, r, knn_aggregate)
        torch.library.opcheck(knn_into, (q, r, prob.k, distances, indices))
        """,
    ),
    "16_your_model": (
        (),
        "",
        """
        q, r = p_query[:64], p_ref[:300]
        q_at, r_at = torch.tensor([0, 30, 64]), torch.tensor([0, 100, 300])
        distances, offsets, indices = radius_search(q, r, 0.5, q_at, r_at)
        d = _pairwise(q, r)
        one_cloud = cloud_of(q_at, q)[:, None] == cloud_of(r_at, r)[None, :]
        want = (d <= 0.5) & one_cloud
        assert torch.equal(offsets.diff(), want.sum(1)), "neighbours per query"
        rows = edge_rows(offsets, len(indices))
        assert want[rows, indices].all(), "a neighbour out of range or cloud"
        assert torch.allclose(distances, d[rows, indices], atol=1e-6), "distances"
        torch.library.opcheck(radius_search, (q, r, 0.5, q_at, r_at))
        q64, r64 = q.double().requires_grad_(), r.double().requires_grad_()
        search = lambda a, b: radius_search(a, b, 0.5, q_at, r_at)[0]
        assert torch.autograd.gradcheck(search, (q64, r64)), "gradient"
        points, at = p_ref[:300], torch.tensor([0, 120, 300])
        labels = torch.tensor([0, 2])
        torch.manual_seed(prob.seed)
        model = Classifier(3, n_centres=8, radius=0.5, width=16)
        compiled = torch.compile(model, fullgraph=True, dynamic=True)
        optimiser = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(3):
            loss = torch.nn.functional.cross_entropy(compiled(points, at), labels)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0], losses
        with torch.no_grad():
            scores = compiled(points, at)
            assert scores.shape == (2, 3), scores.shape
            assert torch.allclose(scores, model(points, at), atol=1e-5), "compiled"
        """,
    ),
    "08_triton_knn": (
        ("01_eager_baseline",),
        "import triton\nimport triton.language as tl\n",
        """
        clouds = (p_query, p_ref, feats)
        mine = [t[:n].clone().requires_grad_() for t, n in zip(clouds, (64, 256, 256))]
        brute = [t.clone().detach().requires_grad_() for t in mine]
        out, w, idx = knn_aggregate_t(*mine, prob.k, prob.sigma)
        want = _knn_aggregate_brute(*brute, prob.k, prob.sigma)
        assert torch.allclose(out, want, atol=1e-5), "output"
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
        want.backward(grad_out)
        for name, a, b in zip(("p_query", "p_ref", "feats"), mine, brute):
            assert torch.allclose(a.grad, b.grad, atol=1e-4), f"{name} gradient"
        torch.library.opcheck(knn_aggregate_t, (*mine, prob.k, prob.sigma))
        assert len(ours) == 5 and all(map(math.isfinite, ours)), ours
        """,
    ),
}


#: Chapters whose library is the book's own compiled one: the recipe imports it and
#: calls nothing else of the package (the import, and the calls it may make).
LIBRARY = {
    "14_real_clouds": ("import extkernels as ek", ("ek.knn(",)),
    "15_shipping": ("from extkernels.ops import fused", ("fused.knn_out(",)),
}
BLOCKED = 'sys.modules["extkernels"] = None'


def recipe(name: str) -> list[str]:
    """The sources of a chapter's cells tagged ``recipe``, in order."""
    nb = nbformat.read(ROOT / "book" / f"{name}.ipynb", as_version=4)
    return [
        c.source
        for c in nb.cells
        if c.cell_type == "code" and "recipe" in c.metadata.get("tags", [])
    ]


@pytest.mark.parametrize("name", sorted(CHAPTERS))
def test_recipe_names_nothing_of_the_book(name):
    cells = recipe(name)
    assert cells, f"{name}: no cell is tagged recipe"
    allowed = LIBRARY.get(name, ("", ()))[1]
    uses = [
        line
        for c in cells
        for line in c.splitlines()
        if ("extkernels" in line or "ek." in line or "fused." in line)
        and not any(call in line for call in allowed)
    ]
    assert not uses, f"{name}: recipe cells use the book's package: {uses}"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CHAPTERS))
def test_recipe_runs_in_a_fresh_process_without_the_book(name, tmp_path):
    needs, imports, use = CHAPTERS[name]
    cells = [cell for chapter in (*needs, name) for cell in recipe(chapter)]
    preamble = PREAMBLE
    if name in LIBRARY:  # the chapter's library is the package's compiled one
        preamble = preamble.replace(BLOCKED, LIBRARY[name][0])
    script = "\n\n".join(
        [preamble, imports, *cells, textwrap.dedent(use), 'print("recipe ok")']
    )
    (tmp_path / "recipe.py").write_text(script)  # Triton and Warp read their sources
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "recipe.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0 and "recipe ok" in result.stdout, (
        f"{name}'s recipe failed outside the book:\n{result.stderr[-4000:]}"
    )
