"""The spend chart: running cost over turns as numbers for an inline SVG polyline (no script, no library)."""

from __future__ import annotations

from dataclasses import dataclass

WIDTH, HEIGHT, PAD = 480, 160, 28


@dataclass(frozen=True)
class Chart:
    """What the template draws: the polyline's points, the dots, and the axis labels."""

    points: str
    dots: list[tuple[float, float, str]]
    max_cost: float
    first_turn: int
    last_turn: int
    width: int = WIDTH
    height: int = HEIGHT
    pad: int = PAD


def spend_chart(spend: list[tuple[int, float]]) -> Chart | None:
    """A chart of (turn, running cost) points, oldest first; None when there is nothing to draw."""
    if not spend:
        return None
    turns = [t for t, _ in spend]
    lo, hi = min(turns), max(turns)
    top = max(c for _, c in spend) or 1.0
    span = (hi - lo) or 1

    def xy(turn: int, cost: float) -> tuple[float, float]:
        x = PAD + (turn - lo) / span * (WIDTH - 2 * PAD)
        y = HEIGHT - PAD - cost / top * (HEIGHT - 2 * PAD)
        return round(x, 1), round(y, 1)

    coords = [xy(t, c) for t, c in spend]
    dots = [(x, y, f"turn {t}: ${c:.4f}") for (x, y), (t, c) in zip(coords, spend, strict=True)]
    return Chart(points=" ".join(f"{x},{y}" for x, y in coords), dots=dots, max_cost=top, first_turn=lo,
                 last_turn=hi)
