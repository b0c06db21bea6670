"""The committed benchmark results, as the results page shows them (chapter 1 explains
the protocol; the results page at the front of the book reads them).

``python -m extkernels.benchmark --json FILE`` writes one JSON file: ``meta`` (hardware,
date, versions, sizes, repeats), ``rows`` (one per variant: medians, spreads, speedups,
peak memory) and ``runs`` (every run). :func:`load` reads it back; :func:`book_table`
and :func:`anchor_table` turn it into the page's two tables.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from . import clouds
from .provenance import data_file, short_uuid
from .reference import anchor_figures, not_like_for_like
from .timing import summary

__all__ = [
    "BENCHMARK",
    "SHIPPING",
    "load",
    "recorded",
    "source",
    "run_card",
    "gpus",
    "machines_table",
    "runs_per_variant",
    "book_table",
    "floors_table",
    "ranked",
    "by_workload",
    "anchor_table",
    "clouds_table",
    "is_floor",
    "at_size",
    "tree_times",
    "radius_times",
    "variant_quotes",
]


def load(path: str | Path) -> tuple[dict, pd.DataFrame]:
    """The benchmark command's JSON: its ``meta`` and its rows indexed by variant."""
    data = json.loads(Path(path).read_text())
    df = pd.DataFrame(data["rows"]).set_index("variant")
    # JSON keeps a missing value (peak memory on a CPU) as null: numbers again, NaN for
    # those.
    numeric = [
        c for c in df if c.endswith(("_ms", "_min", "_max", "_speedup", "_mb", "_s"))
    ]
    df[numeric] = df[numeric].apply(pd.to_numeric, errors="coerce")
    return data["meta"], df


# The benchmark command's results on the book's GPU, relative to book/ (chapters run
# there)
BENCHMARK = f"data/{data_file('benchmark')}"

# The benchmark command's runs of chapter 15's variants (a first call that builds the
# libraries just in time, packaged projectors beside compiled ones), in a run of their
# own
SHIPPING = f"data/{data_file('benchmark-shipping')}"


def recorded(names: list[str], path: str | Path = BENCHMARK) -> pd.DataFrame:
    """The rows of ``names`` in the benchmark command's results (``path``), in that
    order, with the file's ``meta`` in ``attrs["meta"]``: the table a chapter shows
    for variants the benchmark command times (each one number in the whole book).
    ``extkernels.benchmark.run_all(names, repeats=5)`` times them on the machine at
    hand instead.

    Raises:
        KeyError: a name the file holds no row for (its message lists them).
    """
    meta, df = load(path)
    missing = [n for n in names if n not in df.index]
    if missing:
        raise KeyError(f"names: no row in {path} for {missing}")
    out = df.loc[list(names)]
    out.attrs["meta"] = meta
    return out


def source(table: pd.DataFrame) -> str:
    """Where a :func:`recorded` table comes from, for the line under it."""
    meta = table.attrs["meta"]
    return (
        f"{meta['hardware']}, benchmark command, {runs_per_variant(table)} fresh "
        f"processes per variant, {measured(meta)} UTC"
    )


def runs_per_variant(df: pd.DataFrame) -> str:
    """How many fresh-process runs the variants of a table had: "5", or "3 to 5" when
    they differ."""
    lo, hi = int(df["repeats"].min()), int(df["repeats"].max())
    return str(lo) if lo == hi else f"{lo} to {hi}"


def run_card(meta: dict, df: pd.DataFrame) -> pd.DataFrame:
    """What produced a benchmark file (``meta``, and its table ``df``): hardware, when,
    runs per variant, sizes and software versions, as a one-column table."""
    sizes = meta.get("sizes", {})
    card = {
        "hardware": meta["hardware"],
        "measured (UTC)": measured(meta),
        "runs per variant": runs_per_variant(df),
        "kNN clouds": f"{sizes['n_ref']:,} reference points" if sizes else "",
        "radius clouds": f"{sizes['n_ref_radius']:,} reference points" if sizes else "",
        "queries": f"{sizes['n_query']:,}" if sizes else "",
        **meta.get("versions", {}),
    }
    if "GPU UUID" in card:
        card["GPU UUID"] = gpus(card["GPU UUID"])
    return pd.Series(card, name="benchmark run").to_frame()


def gpus(uuids: str) -> str:
    """A run card's ``GPU UUID`` (every value of a merged file, ``"; "`` between) in
    short: how many GPUs ran the runs, then the first eight digits of each UUID
    (``not recorded`` for runs that predate the record)."""
    ids = uuids.split("; ")
    n = sum(u != "not recorded" for u in ids)
    short = [u if u == "not recorded" else f"{short_uuid(u)}…" for u in ids]
    return f"{n} GPU{'' if n == 1 else 's'}: {', '.join(short)}"


def machines_table(df: pd.DataFrame) -> pd.DataFrame:
    """The machines file (:func:`~extkernels.benchmark.merge_machines`: one variant
    timed again on each GPU a campaign ran on) as the results page shows it: a row per
    GPU, the first digits of its UUID, with the day it ran and the forward and training
    milliseconds (median and range of its runs). Not its first call, which on each
    machine paid for building the extensions from cold."""
    out = summary(df)[["forward ms", "training ms"]]
    out.insert(0, "date", df["date"])
    return out.rename_axis(f"GPU ({', '.join(sorted(set(df['timed'])))})")


def measured(meta: dict) -> str:
    """When the run started, UTC to the minute; for a merged file (one benchmark call
    per batch of variants), the first and the last start."""
    starts = sorted(d.strip() for d in meta["date"].split(","))
    first, last = (d.replace("T", " ")[:16] for d in (starts[0], starts[-1]))
    return first if first == last else f"{first} to {last}"


def is_floor(df: pd.DataFrame) -> pd.Series:
    """Which rows are floors: the model with no aggregation at all, a bound on what any
    variant can take rather than a variant to rank."""
    return pd.Series(df.index.str.contains("floor"), index=df.index)


def book_table(df: pd.DataFrame, chapters: dict[str, int]) -> pd.DataFrame:
    """Every variant: its chapter, then the chapters' own summary of its timings
    (:func:`~extkernels.timing.summary`: median and range of the runs, speedups, peak
    MiB). Floors get no speedups: they aggregate nothing."""
    out = summary(df)
    out.insert(0, "chapter", [chapters.get(v, "") for v in df.index])
    for column in ("× eager fwd", "× eager train"):
        if column in out:
            out[column] = out[column].astype(object).where(~is_floor(df), "")
    return out


def ranked(df: pd.DataFrame) -> pd.DataFrame:
    """The variants of ``df`` that aggregate (floors left out), the kNN projector's
    first, then the radius projector's, each from the shortest training step to the
    longest (:func:`by_workload`): the order in which the results page lists them."""
    return pd.concat(by_workload(df[~is_floor(df)]).values())


def by_workload(df: pd.DataFrame, *, sort: bool = True) -> dict[str, pd.DataFrame]:
    """The rows of ``df`` split by workload, keyed ``"kNN projector"`` and ``"radius
    projector"`` (the panels of :func:`~extkernels.plotting.timing_panels`), each from
    the shortest training step to the longest unless ``sort`` is false."""
    parts = {}
    for prefix, title in (("knn/", "kNN projector"), ("radius/", "radius projector")):
        part = df[df.index.str.startswith(prefix)]
        parts[title] = part.sort_values("train_ms") if sort else part
    return parts


def floors_table(df: pd.DataFrame, chapters: dict[str, int]) -> pd.DataFrame:
    """The floors of ``df`` as :func:`book_table` shows a variant, without the speedup
    columns: a floor aggregates nothing, so it is faster than no variant at anything."""
    out = book_table(df[is_floor(df)], chapters)
    return out.drop(columns=[c for c in ("× eager fwd", "× eager train") if c in out])


def anchor_table(df: pd.DataFrame) -> pd.DataFrame:
    """The variants of the anchor tutorial: the figures it published (one A100) and its
    code as this book timed it on an H200 (``reference.anchor_figures``), beside this
    book's medians of ``df`` (ms forward / training)."""
    rows = {}
    for column, figures in anchor_figures.items():
        for variant, (fwd, train) in figures.items():
            rows.setdefault(variant, {})[column] = f"{fwd:.1f} / {train:.1f}"
    out = pd.DataFrame(rows).T
    mine = [
        f"{df.loc[v, 'forward_ms']:.3g} / {df.loc[v, 'train_ms']:.3g}"
        if v in df.index
        else ""
        for v in out.index
    ]
    out["this book (median)"] = mine
    out["same computation?"] = [
        f"no: {not_like_for_like[v]}" if v in not_like_for_like else "yes"
        for v in out.index
    ]
    return out.fillna("").rename_axis("variant")


def clouds_table(df: pd.DataFrame) -> pd.DataFrame:
    """Variants timed on another cloud (``name@cloud``, chapter 14), each beside the
    same variant on the book's cloud: forward and training-step milliseconds, and
    their ratios to the book's cloud's."""
    elsewhere = {name.partition("@")[0] for name in df.index if "@" in name}
    rows = []
    for name in df.index:
        base, _, cloud = name.partition("@")
        if base not in df.index or base not in elsewhere:
            continue
        rows.append(
            {
                "variant": base,
                "cloud": cloud or "normal",
                "forward ms": df.loc[name, "forward_ms"],
                "train ms": df.loc[name, "train_ms"],
                "forward / normal": df.loc[name, "forward_ms"]
                / df.loc[base, "forward_ms"],
                "train / normal": df.loc[name, "train_ms"] / df.loc[base, "train_ms"],
            }
        )
    return pd.DataFrame(rows).set_index(["variant", "cloud"]).round(3)


def at_least(x: float, digits: int = 0) -> str:
    """``x`` rounded down, for an "at least" claim."""
    return f"{math.floor(round(x * 10**digits, 9)) / 10**digits:.{digits}f}"


def at_most(x: float, digits: int = 0) -> str:
    """``x`` rounded up, for an "at most" claim."""
    return f"{math.ceil(round(x * 10**digits, 9)) / 10**digits:.{digits}f}"


def against_book_cloud(ratio: pd.Series) -> str:
    """A method's time on every cloud over its time on the book's cloud (``normal``),
    as a predicate for prose: "is no slower …" or "takes at most …×"."""
    others = ratio.drop("normal")
    if others.max() <= 1.0:
        return "is no slower on any cloud than on the book's cloud"
    return (
        f"takes at most {at_most(others.max(), 1)}× its time on the book's cloud on "
        f"every cloud (the slowest: {others.idxmax()})"
    )


# ---- chapter 14's geometry command (extkernels.experiments.geometry) -------------


def at_size(times: pd.DataFrame, n: int, methods, column: str = "ms") -> pd.DataFrame:
    """Milliseconds at ``n`` points, a row per cloud, a column per method: the median
    (``column="ms"``), the fastest run (``"min"``) or the slowest (``"max"``)."""
    part = times.xs(n, level="n")[column].unstack("method")
    return part[[m for m in methods if m in part]].reindex(list(clouds.GEOMETRIES))


def tree_times(
    times: pd.DataFrame, method: str = "fused", rival: str = "cuml"
) -> pd.DataFrame:
    """Per cloud: ``method``'s search at 10^5 and 10^6 points, and ``rival``'s time at
    10^6 over ``method``'s (medians of the same runs)."""
    small, large = (
        at_size(times, 100_000, [method, rival]),
        at_size(times, 1_000_000, [method, rival]),
    )
    out = pd.DataFrame(
        {
            "ms at 10⁵": small[method],
            "ms at 10⁶": large[method],
            f"x {rival} at 10⁶": large[rival] / large[method],
        }
    )
    return out.round(3)


def radius_times(times: pd.DataFrame, n: int = clouds.RADIUS_N) -> pd.DataFrame:
    """Per cloud: each radius method's milliseconds at ``n`` points and its ratio to
    its time on the book's cloud (medians)."""
    ms = at_size(times, n, ["fused-radius", "warp-radius"])
    out = ms.copy()
    for method in ms.columns:
        out[f"{method} / normal"] = ms[method] / ms.loc["normal", method]
    return out.round(3)


def variant_quotes(parts: dict[str, pd.DataFrame]) -> dict[str, float | int | str]:
    """The numbers chapter 12 quotes from the benchmark's table of every variant:
    ``parts`` maps ``"kNN projector"`` and ``"radius projector"`` to their rows sorted
    by ``train_ms``. For each workload (``knn_*``, ``radius_*``): the fastest exact
    variant (the floors aggregate nothing), its training step, the fastest forward, the
    slowest training step and the number of variants; the runner-up (``*_runner_up``,
    its step ``*_runner_up_train``), the fastest of the others that is not the fastest
    with an option added (``+inductor-defaults``: the same projector with one setting
    changed, not another way to build it)."""
    out = {}
    for workload, part in parts.items():
        exact = part[~part.index.str.contains("floor")]
        key = "knn" if workload.startswith("kNN") else "radius"
        best = exact.index[0]
        others = exact.index[1:]
        second = others[~others.str.startswith(f"{best}+")][0]
        out[f"{key}_best"] = best
        out[f"{key}_best_train"] = float(exact["train_ms"].iloc[0])
        out[f"{key}_runner_up"] = second
        out[f"{key}_runner_up_train"] = float(exact.at[second, "train_ms"])
        out[f"{key}_best_fwd"] = float(exact["forward_ms"].min())
        out[f"{key}_worst_train"] = float(exact["train_ms"].iloc[-1])
        out[f"{key}_n_variants"] = len(part)
    return out
