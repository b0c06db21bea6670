"""Batches of clouds as packed points with offsets (extkernels.ops.batches): the
converters from the libraries' layouts and the checks of offsets."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from extkernels.ops import batches


def _padded(lengths, p=5, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    points = torch.randn(len(lengths), p, d, generator=g)
    return points, torch.tensor(lengths, dtype=torch.int64)


@pytest.mark.parametrize("lengths", [[3, 0, 5, 1], [5], [0, 0], []])
def test_pack_and_pad_are_inverse(lengths):
    points, lens = _padded(lengths)
    packed, offsets = batches.pack_padded(points, lens)
    assert offsets.dtype == torch.int64
    assert offsets.tolist() == [0, *lens.cumsum(0).tolist()]
    for b, n in enumerate(lengths):  # cloud b's points, in order, at its rows
        assert torch.equal(packed[offsets[b] : offsets[b + 1]], points[b, :n])
    padded, back = batches.pad_packed(packed, offsets, fill=-1.0)
    assert back.tolist() == lengths
    for b, n in enumerate(lengths):
        assert torch.equal(padded[b, :n], points[b, :n])
        assert (padded[b, n:] == -1.0).all()


def test_offsets_from_a_batch_vector_count_each_cloud():
    batch = torch.tensor([0, 0, 2, 2, 2, 3])
    assert batches.offsets_from_batch(batch).tolist() == [0, 2, 2, 5, 6]
    # trailing empty clouds exist only when the caller names them
    assert batches.offsets_from_batch(batch, num_clouds=6).tolist() == [
        0,
        2,
        2,
        5,
        6,
        6,
        6,
    ]
    empty = torch.empty(0, dtype=torch.int64)
    assert batches.offsets_from_batch(empty, num_clouds=2).tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    "batch, num_clouds, match",
    [
        (torch.tensor([0, 1, 0]), None, "batch: expected the points sorted"),
        (torch.tensor([0.0, 1.0]), None, "batch: expected a 1-D int64"),
        (torch.tensor([-1, 0]), None, "batch: expected cloud indices >= 0"),
        (torch.tensor([0, 3]), 2, "num_clouds: expected at least 4"),
    ],
)
def test_a_bad_batch_vector_is_named(batch, num_clouds, match):
    with pytest.raises((TypeError, ValueError), match=match):
        batches.offsets_from_batch(batch, num_clouds)


@pytest.mark.parametrize(
    "offsets, n, error, match",
    [
        (torch.tensor([0, 2, 5], dtype=torch.int32), 5, TypeError, "int64"),
        (torch.tensor([[0, 5]]), 5, ValueError, r"shape \(B \+ 1,\)"),
        (torch.empty(0, dtype=torch.int64), 0, ValueError, r"shape \(B \+ 1,\)"),
        (torch.tensor([1, 5]), 5, ValueError, "starting at 0, got 1"),
        (torch.tensor([0, 4, 2, 5]), 5, ValueError, "non-decreasing"),
        (torch.tensor([0, 2, 4]), 5, ValueError, "number of points, 5, got 4"),
        ([0, 5], 5, TypeError, "torch.Tensor"),
    ],
)
def test_bad_offsets_are_refused_by_name(offsets, n, error, match):
    with pytest.raises(error, match=f"my_offsets: .*{match}"):
        batches.check_offsets("my_offsets", offsets, n)


def test_offsets_values_are_not_read_while_tracing():
    # metadata is checked on fake tensors, the values (which need the host) are not
    with FakeTensorMode():
        fake = torch.empty(4, dtype=torch.int64)
        assert batches.check_offsets("query_offsets", fake, 10) == 3
        with pytest.raises(TypeError, match="query_offsets: expected int64"):
            batches.check_offsets("query_offsets", fake.int(), 10)


def test_queries_and_references_come_in_as_many_clouds():
    q, r = torch.tensor([0, 2, 4]), torch.tensor([0, 3, 3, 6])
    with pytest.raises(ValueError, match="query_offsets, ref_offsets: .* 2 and 3"):
        batches.check_batch(q, r, 4, 6)
    assert batches.check_batch(q, torch.tensor([0, 3, 6]), 4, 6) == 2


def test_a_cloud_too_small_for_k_is_named():
    q = torch.tensor([0, 2, 2, 5])  # cloud 1 has no queries: its size does not matter
    r = torch.tensor([0, 8, 9, 11])
    batches.check_clouds_hold(q, torch.tensor([0, 8, 8, 16]), 4)
    with pytest.raises(ValueError, match="cloud 2 to hold at least k = 4 .* got 2"):
        batches.check_clouds_hold(q, r, 4)


@pytest.mark.parametrize(
    "lengths, match",
    [
        (torch.tensor([1.0, 2.0]), "lengths: expected an integer tensor"),
        (torch.tensor([1, -1]), "lengths: expected no negative length"),
        (torch.tensor([[1, 2]]), "lengths: expected a 1-D tensor"),
    ],
)
def test_bad_lengths_are_refused_by_name(lengths, match):
    with pytest.raises((TypeError, ValueError), match=match):
        batches.offsets_from_lengths(lengths)


def test_padded_clouds_longer_than_their_padding_are_refused():
    points, _ = _padded([2, 2], p=3)
    with pytest.raises(ValueError, match="lengths: expected at most 3 points"):
        batches.pack_padded(points, torch.tensor([2, 4]))
    with pytest.raises(ValueError, match=r"lengths: expected shape \(2,\)"):
        batches.pack_padded(points, torch.tensor([2]))
