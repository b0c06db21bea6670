"""Where a measurement ran: the names of the data files by their hardware, and one run
card for the files of several runs."""

import pytest

from extkernels import provenance


@pytest.mark.parametrize(
    "hardware, slug",
    [
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100-80gb-hbm3"),
        ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
        ("CPU", "cpu"),
    ],
)
def test_a_data_file_is_named_by_its_hardware(hardware, slug):
    assert provenance.hardware_slug(hardware) == slug
    assert provenance.data_file("geometry", hardware) == f"geometry-{slug}.json"


def test_a_nameless_hardware_is_refused():
    with pytest.raises(ValueError, match="hardware"):
        provenance.hardware_slug("NVIDIA ")


def test_a_merged_run_card_lists_each_date_once_in_order():
    metas = [
        {"hardware": "GPU", "date": d}
        for d in ("2026-01-03T10:00", "2026-01-02T09:00, 2026-01-03T10:00")
    ]
    assert provenance.joined_meta(metas)["date"] == "2026-01-02T09:00, 2026-01-03T10:00"
