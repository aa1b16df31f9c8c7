"""The SVG charts of the HTML pages (dashboards/report.py line_chart, the job page's): axis
labels that say the value of their gridline, legends that stay in their room, one series per
GPU row."""

from __future__ import annotations

import re
from dataclasses import replace
from html.parser import HTMLParser

import pytest

from gpuslo.dashboards.report import LEGEND_CHARS, line_chart, nice_top, tick_labels
from gpuslo.rules.jobreport import GpuPoint, JobGpu, JobReport
from tests.helpers import T0

FORMATS = ("{:.0f}", "{:g}", "{:.0%}", "{:.1%}")  # every y_fmt the pages use
TOPS = sorted(
    {nice_top(v * 10.0**e) for v in (0.3, 0.9, 1.7, 3.6, 4.2, 7.3) for e in range(-3, 7)}
    | {9.5, 79.6, 39.5, 0.3, 1.0, 2.0, 0.02}  # a GPU's framebuffer in GiB is any number
)


def _value(label: str) -> float:
    return float(label.rstrip("%")) / (100 if label.endswith("%") else 1)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("top", TOPS)
def test_every_axis_label_says_its_gridline(top: float, fmt: str) -> None:
    """At "{:.0f}" a 2 GiB axis was labelled 0, 0, 1, 2, 2 and a 9.5 GiB one had "10" at 9.5."""
    labels = tick_labels(top, fmt)
    assert len(set(labels)) == 5, labels
    for i, label in enumerate(labels):
        assert abs(_value(label) - top * i / 4) <= 0.005 * top, (labels, i)
    svg = line_chart("t", {"s": [(T0, top / 3)]}, T0, T0 + 60, top, fmt)
    assert re.findall(r'class="ylab">([^<]*)<', svg) == labels


class Legend(HTMLParser):
    def __init__(self, svg: str) -> None:
        super().__init__(convert_charrefs=True)
        self.entries: list[list[str]] = []
        self._in: str | None = None
        self.feed(svg)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "text" and dict(attrs).get("class") == "legend":
            self.entries.append(["", ""])
            self._in = "text"
        elif tag == "title" and self._in == "text":
            self._in = "title"

    def handle_endtag(self, tag: str) -> None:
        self._in = "text" if tag == "title" and self._in == "title" else None if tag == "text" else self._in

    def handle_data(self, data: str) -> None:
        if self._in:
            self.entries[-1][self._in == "title"] += data


def test_a_long_series_name_stays_in_its_legend_entry() -> None:
    """A 256-character node name ran across the other entries and off the chart; cut in the
    middle, the ends (a node's GPU, a MIG instance) still tell the series apart, and the whole
    name is the tooltip."""
    names = ["n" * 240 + "/0 1g.10gb gi1 ci0", "n" * 240 + "/0 1g.10gb gi2 ci0", "short", "\u202e" * 30]
    svg = line_chart("t", {n: [(T0, 0.5)] for n in names}, T0, T0 + 60, 1.0, "{:.0%}")
    entries = Legend(svg).entries
    assert [len(text) <= LEGEND_CHARS for text, _ in entries] == [True] * 4
    assert len({text for text, _ in entries}) == 4 and entries[2] == ["short", "short"]
    assert [title for _, title in entries[:2]] == names[:2] and entries[3][1] == "\\u202e" * 30


def _gpu(gi: int | None, ci: int | None, uuid: str, activity: float) -> JobGpu:
    return JobGpu(node="n1", gpu=0, uuid=uuid, model="H100", mig_gi=gi, mig_ci=ci, mig_profile="1g.10gb" if gi is not None else None,
                  share=1.0, shared=False, held_gpu_hours=1.0, active_gpu_hours=activity, idle_gpu_hours=0.0,
                  idle_share=0.0, utilization=activity, peak_activity=activity, peak_fb_mib=100.0, fb_total_mib=9728.0,
                  samples=6, activity_samples=6, first_sample=T0, last_sample=T0 + 3000,
                  series=tuple(GpuPoint(T0 + 600 * k, activity, 100.0) for k in range(6)))  # fmt: skip


@pytest.mark.parametrize(
    "gpus",
    [
        # two MIG instances of one profile on one GPU; two compute instances of one GPU instance
        [_gpu(1, 0, "MIG-a", 0.2), _gpu(2, 0, "MIG-b", 0.8)],
        [_gpu(1, 0, "MIG-a", 0.2), _gpu(1, 1, "MIG-b", 0.8)],
        # a GPU replaced under the same index during the job
        [_gpu(None, None, "GPU-a", 0.2), _gpu(None, None, "GPU-b", 0.8)],
    ],
    ids=["two-instances", "two-compute-instances", "replaced-gpu"],
)
def test_each_gpu_row_is_its_own_series(gpus: list[JobGpu]) -> None:
    """The job page keyed its series by "node/gpu profile": one of two such rows was not drawn."""
    from gpuslo.dashboards.jobpage import render

    r = JobReport(cluster="c1", scheduler="slurm", id="1", request_id="1", name="j", user="u", account="a",
                  queue="q", from_=T0, to=T0 + 3600, bucket_s=600, submitted=T0, started=T0, ended=None,
                  end_state=None, gpus_requested=2.0, gpus=tuple(gpus), held_gpu_hours=2.0, active_gpu_hours=1.0,
                  idle_gpu_hours=0.0, idle_share=0.0, utilization=0.5, peak_fb_mib=100.0, wait_s=0.0,
                  starvation=None, rightsize=None, energy=None, idle_threshold=0.05, min_idle_s=0.0,
                  notes=())  # fmt: skip
    charts = re.findall(r'<svg class="chart".*?</svg>', render(r), flags=re.S)
    assert len(charts) == 2
    for svg in charts:
        assert len(re.findall(r'<polyline class="series"', svg)) == 2
        assert len({t for _, t in Legend(svg).entries}) == 2


@pytest.mark.parametrize(("values", "target"), [([0.3], 0.99), ([2.0, 3.6], 7.5), ([], 0.8), ([0.0], 0.05)])
def test_a_target_is_drawn_at_its_value_on_an_axis_fitted_to_the_data(
    values: list[float], target: float
) -> None:
    """An axis fitted to an SLI of 30 % (top 40 %) drew the 99 % objective on its top line."""
    svg = line_chart(
        "t", {"s": [(T0 + i, v) for i, v in enumerate(values)]}, T0, T0 + 60, None, "{:g}", target=target
    )
    top = _value(re.findall(r'class="ylab">([^<]*)<', svg)[-1])
    assert top >= target
    grid = [float(y) for y in re.findall(r'y1="([\d.]+)"[^>]*class="grid"', svg)]
    (y,) = (float(v) for v in re.findall(r'y1="([\d.]+)"[^>]*class="target"', svg))
    bottom, top_y = grid[0], grid[-1]
    assert y == pytest.approx(bottom - (bottom - top_y) * target / top, abs=0.1)


@pytest.mark.parametrize(
    ("held", "want_runs"),
    [
        (range(60), [(0, 60)]),  # every bucket
        ([*range(20), *range(40, 60)], [(0, 20), (40, 60)]),  # its agent down 20 min in the middle
        (range(30, 60), [(30, 60)]),  # a requeued job's second GPU: the first half was on another
        ([0, 2, 4], [(0, 1), (2, 3), (4, 5)]),  # every other bucket
        ([], []),
    ],
    ids=["all", "agent-down", "second-half", "alternate", "none"],
)
def test_a_gpu_without_samples_for_a_while_is_a_gap_in_time(
    held: range | list[int], want_runs: list[tuple[int, int]]
) -> None:
    """One GPU over [T0, T0+3600) in 60 buckets of 60 s, with a sample (activity 1.0) in the
    buckets ``held``: the page's line breaks where a bucket has none and the text's sparkline (24
    characters, 2.5 buckets each) has a space for each group of buckets without one. The line
    was drawn across the gap, and the sparkline left the empty buckets out (a job on two GPUs one
    after the other showed each busy the whole time)."""
    from gpuslo.app.jobtext import report as text
    from gpuslo.dashboards.jobpage import render

    pts = tuple(GpuPoint(T0 + 60 * k, 1.0, 100.0) for k in held)
    g = replace(_gpu(None, None, "GPU-a", 1.0), series=pts)
    r = JobReport(cluster="c1", scheduler="slurm", id="1", request_id="1", name="j", user="u", account="a",
                  queue="q", from_=T0, to=T0 + 3600, bucket_s=60, submitted=T0, started=T0, ended=None,
                  end_state=None, gpus_requested=1.0, gpus=(g,), held_gpu_hours=1.0, active_gpu_hours=1.0,
                  idle_gpu_hours=0.0, idle_share=0.0, utilization=1.0, peak_fb_mib=100.0, wait_s=0.0,
                  starvation=None, rightsize=None, energy=None, idle_threshold=0.05, min_idle_s=0.0,
                  notes=())  # fmt: skip
    for svg in re.findall(r'<svg class="chart".*?</svg>', render(r), flags=re.S):
        lines = re.findall(r'<polyline class="series"[^>]*points="([^"]*)"', svg)
        assert [len(p.split()) for p in lines] == [b - a for a, b in want_runs]
    # the sparkline: group k of 24 holds buckets [60k // 24, 60(k+1) // 24): full if any has a sample
    spark = "".join(
        "█" if any(60 * k // 24 <= b < 60 * (k + 1) // 24 for b in held) else " " for k in range(24)
    )
    (row,) = [line for line in text(r).splitlines() if line.startswith("n1 GPU 0")]
    assert spark.strip() == "" or spark in row  # (a table row ends with no trailing spaces)


def test_a_none_breaks_a_line() -> None:
    svg = line_chart("t", {"s": [(T0, 0.1), (T0 + 1, None), (T0 + 2, 0.3), (T0 + 3, 0.4)], "e": [(T0, None)]},
                     T0, T0 + 60, 1.0, "{:.0%}")  # fmt: skip
    assert [len(p.split()) for p in re.findall(r'points="([^"]*)"', svg)] == [1, 2]
    assert "nodata" not in svg.split("</title>")[1]
    assert 'class="nodata"' in line_chart("t", {"s": [(T0, None)]}, T0, T0 + 60, 1.0, "{:.0%}")
