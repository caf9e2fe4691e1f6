"""Line charts as inline SVG, drawn on the server: the dashboard runs no JavaScript.

Only presentation attributes and classes are used (the dashboard's Content-Security-Policy
allows no ``style`` attributes); colours come from the page's stylesheet.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from markupsafe import Markup, escape

_W, _H = 560, 200
_LEFT, _RIGHT, _TOP, _BOTTOM = 52, 12, 12, 30


def _ticks(low: float, high: float, count: int = 4) -> list[float]:
    """Round tick values covering [low, high]."""
    if high <= low:
        return [low]
    raw = (high - low) / count
    step = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 2.5, 5, 10):
        if raw <= step * factor:
            step *= factor
            break
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


def _label(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def line_chart(points: Sequence[tuple[float, float]], *, title: str, x_label: str) -> Markup:
    """A chart of ``points`` (x, y), with axes, ticks, and each point's value on hover."""
    if not points:
        return Markup('<p class="empty">No {} yet.</p>').format(title.lower())
    xs = [float(x) for x, _ in points]
    ys = [float(y) for _, y in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    pad = (y1 - y0) * 0.08 or max(abs(y0) * 0.1, 0.1)
    y0, y1 = y0 - pad, y1 + pad
    plot_w, plot_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM

    def px(x: float) -> float:
        return _LEFT + (x - x0) / (x1 - x0) * plot_w

    def py(y: float) -> float:
        return _TOP + (1 - (y - y0) / (y1 - y0)) * plot_h

    parts = [
        Markup('<svg class="chart" viewBox="0 0 {} {}" role="img" aria-label="{}">').format(_W, _H, title),
        Markup("<title>{}</title>").format(title),
    ]
    for tick in _ticks(y0, y1):
        y = py(tick)
        parts.append(
            Markup('<line class="grid" x1="{}" x2="{}" y1="{:.1f}" y2="{:.1f}"/>').format(_LEFT, _W - _RIGHT, y, y)
        )
        parts.append(Markup('<text class="tick" x="{}" y="{:.1f}" text-anchor="end">{}</text>').format(
            _LEFT - 6, y + 4, _label(tick)))  # fmt: skip
    for tick in _ticks(x0, x1, 6):
        if tick == int(tick):
            parts.append(Markup('<text class="tick" x="{:.1f}" y="{}" text-anchor="middle">{}</text>').format(
                px(tick), _H - _BOTTOM + 16, int(tick)))  # fmt: skip
    parts.append(Markup('<text class="axis" x="{}" y="{}" text-anchor="middle">{}</text>').format(
        _LEFT + plot_w / 2, _H - 2, x_label))  # fmt: skip
    line = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys, strict=True))
    parts.append(Markup('<polyline class="line" points="{}"/>').format(line))
    for x, y in zip(xs, ys, strict=True):
        dot = Markup('<circle class="dot" cx="{:.1f}" cy="{:.1f}" r="3"><title>{} {}: {}</title></circle>')
        parts.append(dot.format(px(x), py(y), x_label, _label(x), escape(f"{y:.4g}")))
    parts.append(Markup("</svg>"))
    return Markup("").join(parts)
