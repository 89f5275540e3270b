"""Learning curves as inline SVG, drawn on the server: no JavaScript library, nothing fetched from the internet.

Each chart plots one or more ``Metric`` values against the step; hovering a point shows its step and value.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any

CHARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward_mean",)),
    ("loss", ("loss",)),
    ("clip and masked fractions", ("clip_fraction", "masked_fraction", "truncated_fraction")),
    ("staleness (policy versions)", ("staleness_mean", "staleness_max")),
    ("engine-vs-trainer logprob mismatch", ("logprob_mismatch_mean", "logprob_mismatch_mean_fresh")),
    ("policy probe after publish: worst service", ("policy_probe_max_mean_abs_diff", "policy_probe_failures")),
    ("tokens/s", ("tokens_per_s",)),
    ("advantage", ("advantage_mean", "advantage_std")),
    ("gradient norm", ("grad_norm",)),
)
"""Chart title and the metric names it plots (a chart without any of them in the run is left out)."""

COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea")
WIDTH, HEIGHT, PAD_LEFT, PAD_RIGHT, PAD_TOP, PAD_BOTTOM = 420, 200, 52, 12, 38, 28
MAX_MARKERS = 200


def _fmt(value: float) -> str:
    return f"{value:.3g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"


def line_chart(title: str, steps: list[int], series: dict[str, list[float | None]]) -> str:
    """One SVG chart of ``series`` (name → value per step, ``None`` where a step has none)."""
    points = [(s, v) for values in series.values() for s, v in zip(steps, values)
              if v is not None and math.isfinite(v)]
    if not points:
        return ""
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) or 1) * 0.05, y1 + (abs(y1) or 1) * 0.05
    plot_w, plot_h = WIDTH - PAD_LEFT - PAD_RIGHT, HEIGHT - PAD_TOP - PAD_BOTTOM

    def xy(step: float, value: float) -> tuple[float, float]:
        return (PAD_LEFT + (step - x0) / (x1 - x0) * plot_w, PAD_TOP + (1 - (value - y0) / (y1 - y0)) * plot_h)

    parts = [f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}">',
             f'<text x="{PAD_LEFT}" y="16" class="chart-title">{escape(title)}</text>',
             f'<rect x="{PAD_LEFT}" y="{PAD_TOP}" width="{plot_w}" height="{plot_h}" class="plot"/>']
    for value in (y0, (y0 + y1) / 2, y1):
        _, y = xy(x0, value)
        parts.append(f'<line x1="{PAD_LEFT}" x2="{WIDTH - PAD_RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
                     f'<text x="{PAD_LEFT - 4}" y="{y + 4:.1f}" class="tick" text-anchor="end">{_fmt(value)}</text>')
    for value in (x0, x1):
        x, _ = xy(value, y0)
        parts.append(f'<text x="{x:.1f}" y="{HEIGHT - 10}" class="tick" text-anchor="middle">{value:g}</text>')
    parts.append(f'<text x="{PAD_LEFT + plot_w / 2:.0f}" y="{HEIGHT - 10}" class="tick" '
                 'text-anchor="middle">step</text>')
    legend_x = PAD_LEFT
    for index, (name, values) in enumerate(series.items()):
        color = COLORS[index % len(COLORS)]
        drawn = [(s, v) for s, v in zip(steps, values) if v is not None and math.isfinite(v)]
        if not drawn:
            continue
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(s, v) for s, v in drawn))
        parts.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.6"/>')
        every = max(1, math.ceil(len(drawn) / MAX_MARKERS))
        for s, v in drawn[::every]:
            x, y = xy(s, v)
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.6" fill="{color}">'
                         f'<title>{escape(name)} at step {s}: {_fmt(v)}</title></circle>')
        parts.append(f'<line x1="{legend_x}" x2="{legend_x + 12}" y1="26" y2="26" stroke="{color}" stroke-width="2"/>'
                     f'<text x="{legend_x + 15}" y="29" class="legend">{escape(name)}</text>')
        legend_x += 6 * len(name) + 30
    parts.append("</svg>")
    return "".join(parts)


def metric_charts(metrics: list[dict[str, Any]]) -> list[str]:
    """The charts of ``CHARTS`` that a run's metrics (ascending steps) have values for."""
    steps = [m["step"] for m in metrics]
    charts = []
    for title, names in CHARTS:
        series = {name: [m["values"].get(name) for m in metrics] for name in names}
        series = {name: values for name, values in series.items() if any(v is not None for v in values)}
        svg = line_chart(title, steps, series) if series else ""
        if svg:
            charts.append(svg)
    return charts
