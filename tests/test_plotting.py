"""extkernels.plotting: timing_panels, timing_bars and range_bars."""

import pandas as pd
import pytest


def test_timing_panels_draws_a_panel_per_workload_with_every_variant():
    import matplotlib

    matplotlib.use("Agg")
    from extkernels import plotting

    def frame(names):
        return pd.DataFrame(
            {"forward_ms": [1.0, 2.0, 3.0][: len(names)], "train_ms": 2.0},
            index=names,
        )

    parts = {"kNN": frame(["knn/a", "knn/b", "knn/c"]), "radius": frame(["radius/a"])}
    fig = plotting.timing_panels(parts, title="every variant", hardware="NVIDIA X")
    assert [ax.get_title(loc="left") for ax in fig.axes] == ["kNN", "radius"]
    labels = [[t.get_text() for t in ax.get_yticklabels()] for ax in fig.axes]
    assert labels == [["knn/a", "knn/b", "knn/c"], ["radius/a"]]
    assert "NVIDIA X" in fig._suptitle.get_text()
    assert len(fig.axes[0].patches) == 6  # a forward and a training bar per variant


def test_timing_bars_label_each_median_alike_and_keep_the_legend_by_the_axes():
    import matplotlib

    matplotlib.use("Agg")
    from extkernels import plotting

    df = pd.DataFrame(
        {"forward_ms": [0.0709, 3.2], "train_ms": [87.94, 144.0]},
        index=["knn/a", "knn/b"],
    )
    fig = plotting.timing_bars(df, title="t", hardware="NVIDIA X", log=True)
    (ax,) = fig.axes
    labels = sorted(t.get_text() for t in ax.texts)
    assert labels == sorted(["0.071", "3.20", "87.9", "144"])
    # the log axis's labels are plain numbers, and none of them on a minor tick
    fig.canvas.draw()
    ticks = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert ticks and all("10^" not in t and "$" not in t for t in ticks)
    assert not [t for t in ax.get_xticklabels(minor=True) if t.get_text()]
    # the legend sits just under the axes, not at the figure's far foot
    legend = fig.legends[0].get_window_extent()
    axes = ax.get_tightbbox()
    assert 0 <= axes.y0 - legend.y1 < 0.05 * fig.bbox.height


def test_timing_panels_legend_covers_no_panel_or_title():
    import matplotlib

    matplotlib.use("Agg")
    from extkernels import plotting

    long = "knn/cuml-op+compile+rmm-rapids"  # a long name narrows the axes
    df = pd.DataFrame({"forward_ms": [1.0, 2.0], "train_ms": [2.0, 3.0]}, [long, "k/b"])
    fig = plotting.timing_panels(
        {"kNN projector": df, "radius projector": df}, title="t", hardware="NVIDIA X"
    )
    fig.canvas.draw()
    legend = fig.legends[0].get_window_extent()
    for ax in fig.axes:
        for box in (ax.get_window_extent(), ax.title.get_window_extent()):
            assert not legend.overlaps(box), (legend, box)
    assert not legend.overlaps(fig._suptitle.get_window_extent())


def test_range_bars_draws_a_panel_per_group_with_its_whiskers():
    import matplotlib

    matplotlib.use("Agg")
    from extkernels import plotting

    index = pd.MultiIndex.from_tuples(
        [
            ("F = 25", "gather", "C++"),
            ("F = 25", "gather", "PTX"),
            ("F = 32", "scatter", "C++"),
        ],
        names=["features", "piece", "written in"],
    )
    df = pd.DataFrame(
        {"us": [13.6, 9.5, 20.3], "p20": [13.0, 9.4, 19.6], "p80": [13.9, 10.7, 21.1]},
        index=index,
    )
    fig = plotting.range_bars(
        df,
        value="us",
        low="p20",
        high="p80",
        title="t",
        hardware="NVIDIA X",
        xlabel="µs per call",
        by=["features", "piece"],
    )
    assert [ax.get_title(loc="left") for ax in fig.axes] == [
        "F = 25 · gather",
        "F = 32 · scatter",
    ]
    labels = [[t.get_text() for t in ax.get_yticklabels()] for ax in fig.axes]
    assert labels == [["C++", "PTX"], ["C++"]]
    assert sorted(t.get_text() for ax in fig.axes for t in ax.texts) == sorted(
        ["13.6", "9.50", "20.3"]
    )
    # each whisker spans low to high
    bars = next(c for c in fig.axes[0].containers if hasattr(c, "errorbar"))
    (_, caps, _) = bars.errorbar.lines
    ends = sorted(x for cap in caps for x in cap.get_xdata())
    assert ends == pytest.approx(sorted([13.0, 13.9, 9.4, 10.7]))
    assert fig.axes[-1].get_xlabel() == "µs per call"
