"""Batches of labelled clouds (extkernels.pointsets) and the PointNet++ layer on them
(extkernels.pointnet): deterministic batches, consistent offsets, balanced classes,
the layer's shapes, its two neighbour forms agreeing, and a compiled graph."""

import pytest
import torch

import extkernels as ek
from extkernels import pointnet, pointsets
from extkernels.ops import batches


@pytest.fixture(scope="module")
def sets():
    return pointsets.PointSets(8, 40, 90, seed=3)


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_batch_depends_on_the_seed_and_its_index_only(sets):
    again = pointsets.PointSets(8, 40, 90, seed=3)
    assert _same(sets.batch(2), again.batch(2))
    assert _same(sets.batch(2), sets[2])
    assert not torch.equal(sets.batch(2).points, sets.batch(3).points)
    other = pointsets.PointSets(8, 40, 90, seed=4)
    assert not torch.equal(sets.batch(2).points, other.batch(2).points)


@pytest.mark.parametrize("index", [0, 1, 7])
def test_offsets_describe_the_points(sets, index):
    points, offsets, labels = sets.batch(index)
    assert points.dtype == torch.float32 and points.shape[1] == 3
    assert torch.isfinite(points).all()
    assert batches.check_offsets("offsets", offsets, points.shape[0]) == 8
    assert labels.shape == (8,) and labels.dtype == torch.int64
    sizes = offsets.diff()
    assert ((sizes >= 40) & (sizes <= 90)).all(), sizes
    # a mesh fills [-1, 1]^3 at most; a rotation keeps it within the unit box's corner
    assert points.norm(dim=1).max() <= 3**0.5 + 1e-5


@pytest.mark.parametrize(("n_clouds", "want"), [(8, [2, 2, 2, 2]), (6, [2, 2, 1, 1])])
def test_classes_are_balanced(n_clouds, want):
    sets = pointsets.PointSets(n_clouds, 10, 20, seed=0)
    for index in range(3):
        labels = sets.batch(index).labels
        assert torch.bincount(labels, minlength=4).tolist() == want


def test_the_order_of_classes_is_shuffled(sets):
    orders = {tuple(sets.batch(i).labels.tolist()) for i in range(6)}
    assert len(orders) > 1


def test_a_cloud_is_its_mesh_turned():
    sets = pointsets.PointSets(4, 500, 500, seed=1, classes=("gimbal ring",))
    points, offsets, _ = sets.batch(0)
    clouds = [
        points[a:b].double() for a, b in zip(offsets[:-1], offsets[1:], strict=True)
    ]
    # a rotation about the mesh's box centre keeps each point's distance from it
    radii = [c.norm(dim=1).sort().values for c in clouds]
    assert (radii[0].median() - radii[1].median()).abs() < 0.05
    assert not torch.allclose(clouds[0].mean(0), clouds[1].mean(0), atol=1e-2)


def test_rotations_are_rotations():
    turns = pointsets.random_rotations(16, torch.Generator().manual_seed(0))
    eye = torch.eye(3, dtype=torch.float64).expand(16, 3, 3)
    assert torch.allclose(turns @ turns.transpose(1, 2), eye, atol=1e-12)
    assert torch.allclose(torch.linalg.det(turns), torch.ones(16, dtype=torch.float64))


@pytest.mark.parametrize(
    ("args", "options", "match"),
    [
        ((4, 10, 5), {}, "min_points"),
        ((0, 10, 20), {}, "n_clouds"),
        ((4, 10, 20), {"classes": ("teapot",)}, "classes"),
    ],
)
def test_bad_arguments_are_named(args, options, match):
    with pytest.raises(ValueError, match=match):
        pointsets.PointSets(*args, **options)


def test_centres_are_distinct_rows_of_their_own_cloud():
    offsets = torch.tensor([0, 10, 10 + 37, 10 + 37 + 8])
    rows = pointnet.centre_rows(offsets, 8).view(3, 8)
    for b in range(3):
        assert ((rows[b] >= offsets[b]) & (rows[b] < offsets[b + 1])).all()
        assert rows[b].unique().numel() == 8


@pytest.mark.parametrize("neighbours", ["csr", "padded"])
def test_the_layer_and_the_classifier_have_their_shapes(sets, neighbours):
    points, offsets, _ = sets.batch(0)
    layer = pointnet.SetAbstraction(16, 0.3, 24, neighbours=neighbours)
    centres, feats = layer(points, offsets)
    assert centres.shape == (8 * 16, 3) and feats.shape == (8 * 16, 24)
    assert torch.isfinite(feats).all()
    model = pointnet.Classifier(4, n_centres=16, width=24, neighbours=neighbours)
    assert model(points, offsets).shape == (8, 4)


def test_csr_and_padded_agree_when_every_neighbour_fits(sets):
    points, offsets, _ = sets.batch(1)
    scores = {}
    for neighbours in ("csr", "padded"):
        torch.manual_seed(0)
        model = pointnet.Classifier(
            4, n_centres=16, radius=0.3, neighbours=neighbours, max_neighbours=90
        )
        scores[neighbours] = model(points, offsets)
    assert torch.allclose(scores["csr"], scores["padded"], atol=1e-5)


@pytest.mark.parametrize(("neighbours", "train"), [("csr", True), ("padded", False)])
def test_the_classifier_compiles_as_one_graph(sets, neighbours, train):
    # the training step for the CSR form; the padded form's forward alone (its
    # backward has no data-dependent size), to keep the compile time of the suite short
    points, offsets, labels = sets.batch(0)
    torch.manual_seed(0)
    model = pointnet.Classifier(4, n_centres=8, width=16, neighbours=neighbours)
    compiled = torch.compile(model, fullgraph=True)
    if train:
        loss = torch.nn.functional.cross_entropy(compiled(points, offsets), labels)
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
    with torch.no_grad():
        assert torch.allclose(
            compiled(points, offsets), model(points, offsets), atol=1e-5
        )


def test_fit_trains_and_accuracy_counts():
    sets = pointsets.PointSets(4, 30, 40, seed=0)
    torch.manual_seed(0)
    model = pointnet.Classifier(4, n_centres=8, width=16)
    losses = pointnet.fit(model, sets, 3, lr=1e-2)
    assert len(losses) == 3 and all(map(torch.isfinite, torch.tensor(losses)))
    share = pointnet.accuracy(model, sets, range(3, 5))
    assert 0.0 <= share <= 1.0 and share * 8 == int(share * 8)


@pytest.mark.parametrize("neighbours", ["csr", "padded"])
def test_every_radius_search_backend_gives_the_same_scores(sets, neighbours):
    points, offsets, _ = sets.batch(2)
    scores = []
    for backend in ek.backends("radius_search"):
        torch.manual_seed(0)
        model = pointnet.Classifier(
            4, n_centres=16, radius=0.3, neighbours=neighbours, backend=backend
        )
        scores.append(model(points, offsets))
    assert len(scores) >= 2
    for other in scores[1:]:
        torch.testing.assert_close(other, scores[0], rtol=1e-5, atol=1e-5)


def test_time_steps_times_each_backend_form_mode_and_pass():
    sets = pointsets.PointSets(2, 30, 40, seed=0)
    times = pointnet.time_steps(sets, 1, 1, backends=("fused",), n_centres=4, width=8)
    assert times.index.names == ["backend", "neighbours", "mode", "pass"]
    assert set(times.index.get_level_values("backend")) == {"fused"}
    assert len(times) == 2 * 2 * 2  # forms, modes, passes
    ms = times[["min ms", "median ms", "max ms"]]
    assert (ms > 0).all().all()
    assert (ms["min ms"] <= ms["median ms"]).all()
    assert (ms["median ms"] <= ms["max ms"]).all()
