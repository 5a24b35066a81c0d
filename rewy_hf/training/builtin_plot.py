"""The loss plot without matplotlib: a PNG drawn with nothing beyond zlib.

``render`` draws what the matplotlib plot shows, in a plainer hand. At the top, the title (its
lines wrapped to the width). Under it, one panel per series, stacked over a shared step axis (the
recipe's: loss, learning rate, gradient norm), each with its label above it, a frame, y ticks at
round values with their labels and a light grid, vertical grid lines at the step ticks, and the
curve; the first panel also marks its lowest point with a red square. Under the bottom panel, the
step ticks (round integers) and the word "step". Non-finite values are left out of a curve.

Text is a 3x5 pixel font drawn at twice its size: digits, letters (capitals, apart from a small x),
and ``. , : ; - + = / ( ) _ % ' < >``; other characters are left blank.
"""

from __future__ import annotations

import math
import os
import struct
import textwrap
import zlib
from dataclasses import dataclass
from pathlib import Path

WIDTH = 800
LEFT, RIGHT = 84, 20                  # room for y tick labels on the left
TITLE_LINE = 14                       # pixels a title line takes
FIRST_PANEL, OTHER_PANEL = 230, 100   # panel heights: the first series (the loss) gets the most room
PANEL_GAP = 30                        # above each panel: its label
BOTTOM = 44                           # under the last panel: step ticks and "step"
SCALE = 2                             # font pixels per glyph pixel
ADVANCE = 4 * SCALE                   # pixels a character takes
INK, GRID, FRAME = (0, 0, 0), (215, 215, 215), (90, 90, 90)
BEST = (214, 39, 40)
#: curve colours, one per panel (matplotlib's first three)
COLOURS = ((31, 119, 180), (255, 127, 14), (44, 160, 44))

# 3x5 glyphs, rows top to bottom, '#' = ink; letters are drawn as these capitals.
_GLYPHS = {
    "0": "###|#.#|#.#|#.#|###", "1": ".#.|##.|.#.|.#.|###", "2": "###|..#|###|#..|###", "3": "###|..#|###|..#|###",
    "4": "#.#|#.#|###|..#|..#", "5": "###|#..|###|..#|###", "6": "###|#..|###|#.#|###", "7": "###|..#|..#|..#|..#",
    "8": "###|#.#|###|#.#|###", "9": "###|#.#|###|..#|###",
    "A": ".#.|#.#|###|#.#|#.#", "B": "##.|#.#|##.|#.#|##.", "C": ".##|#..|#..|#..|.##", "D": "##.|#.#|#.#|#.#|##.",
    "E": "###|#..|##.|#..|###", "F": "###|#..|##.|#..|#..", "G": ".##|#..|#.#|#.#|.##", "H": "#.#|#.#|###|#.#|#.#",
    "I": "###|.#.|.#.|.#.|###", "J": "..#|..#|..#|#.#|.#.", "K": "#.#|#.#|##.|#.#|#.#", "L": "#..|#..|#..|#..|###",
    "M": "#.#|###|###|#.#|#.#", "N": "##.|#.#|#.#|#.#|#.#", "O": ".#.|#.#|#.#|#.#|.#.", "P": "##.|#.#|##.|#..|#..",
    "Q": ".#.|#.#|#.#|##.|.##", "R": "##.|#.#|##.|#.#|#.#", "S": ".##|#..|.#.|..#|##.", "T": "###|.#.|.#.|.#.|.#.",
    "U": "#.#|#.#|#.#|#.#|###", "V": "#.#|#.#|#.#|#.#|.#.", "W": "#.#|#.#|###|###|#.#", "X": "#.#|#.#|.#.|#.#|#.#",
    "Y": "#.#|#.#|.#.|.#.|.#.", "Z": "###|..#|.#.|#..|###", "x": "...|#.#|.#.|#.#|...",
    ".": "...|...|...|...|.#.", ",": "...|...|...|.#.|#..", ":": "...|.#.|...|.#.|...", ";": "...|.#.|...|.#.|#..",
    "-": "...|...|###|...|...", "+": "...|.#.|###|.#.|...", "=": "...|###|...|###|...", "/": "..#|..#|.#.|#..|#..",
    "(": ".#.|#..|#..|#..|.#.", ")": ".#.|..#|..#|..#|.#.", "_": "...|...|...|...|###", "%": "#.#|..#|.#.|#..|#.#",
    "'": ".#.|.#.|...|...|...", "<": "..#|.#.|#..|.#.|..#", ">": "#..|.#.|..#|.#.|#..", " ": "...|...|...|...|...",
}


@dataclass
class Panel:
    """Where one series was drawn: its label, its frame (left, top, right, bottom, in pixels) and how
    many of its points were finite."""
    label: str
    box: tuple[int, int, int, int]
    points: int


class Canvas:
    """An RGB image of white rows, with the few drawing operations the plot needs."""

    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.rows = [bytearray(b"\xff" * (3 * width)) for _ in range(height)]

    def set(self, x: int, y: int, rgb) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            self.rows[y][3 * x:3 * x + 3] = bytes(rgb)

    def pixel(self, x: int, y: int) -> tuple[int, int, int]:
        return tuple(self.rows[y][3 * x:3 * x + 3])

    def line(self, x0: int, y0: int, x1: int, y1: int, rgb, thick: int = 1) -> None:
        """Bresenham's line, ``thick`` pixels tall."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for o in range(thick):
                self.set(x0, y0 + o, rgb)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def dotted(self, x0: int, y0: int, x1: int, y1: int) -> None:
        """A light horizontal or vertical grid line."""
        if y0 == y1:
            for x in range(x0, x1, 4):
                self.set(x, y0, GRID)
        else:
            for y in range(y0, y1, 4):
                self.set(x0, y, GRID)

    def text(self, x: int, y: int, s: str) -> None:
        for ch in s:
            glyph = _GLYPHS.get(ch) or _GLYPHS.get(ch.upper(), _GLYPHS[" "])
            for r, row in enumerate(glyph.split("|")):
                for c, px in enumerate(row):
                    if px == "#":
                        for dy in range(SCALE):
                            for dx in range(SCALE):
                                self.set(x + c * SCALE + dx, y + r * SCALE + dy, INK)
            x += ADVANCE

    def png(self) -> bytes:
        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        raw = b"".join(b"\x00" + bytes(row) for row in self.rows)   # filter type 0 on every row
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def nice_ticks(lo: float, hi: float, count: int = 4, integer: bool = False) -> list[float]:
    """Round values (1, 2, 2.5 or 5 times a power of ten) from ``lo`` to ``hi``: about ``count`` of them,
    and at least two (a finer spacing where the first choice leaves one)."""
    if not hi > lo:
        return [lo]
    mag = 10.0 ** math.floor(math.log10((hi - lo) / count))
    steps = [m * mag * 10 ** e for e in (-1, 0, 1) for m in (1, 2, 2.5, 5)]
    chosen = next(i for i, step in enumerate(steps) if step >= (hi - lo) / count * (1 - 1e-9))
    for step in reversed(steps[:chosen + 1]):
        if integer:
            step = max(1, round(step))
        first = math.ceil(lo / step - 1e-9)
        ticks = [(first + i) * step for i in range(int((hi - lo) / step) + 2)]
        ticks = [t for t in ticks if lo - 1e-9 * step <= t <= hi + 1e-9 * step]
        if len(ticks) >= 2 or (integer and step == 1):
            break
    return [int(round(t)) for t in ticks] if integer else ticks


def tick_labels(ticks: list[float]) -> list[str]:
    """The ticks' labels: plain decimals, as many as the spacing needs (5.525 beside 5.55, 200 beside 400);
    below 0.001 or from a million up, as few significant digits as keep each label within a thousandth of
    a spacing of its value, exponents shortened (1.5e-05 -> 1.5e-5)."""
    spacing = min((abs(b - a) for a, b in zip(ticks, ticks[1:])), default=0.0) or abs(ticks[0]) or 1.0
    if all(v == 0 or 1e-3 <= abs(v) < 1e6 for v in ticks):
        decimals = max(0, 1 - math.floor(math.log10(spacing)))
        return ["0" if v == 0 else f"{v:.{decimals}f}".rstrip("0").rstrip(".") if decimals else f"{v:.0f}"
                for v in ticks]
    for digits in range(1, 10):
        labels = [f"{v:.{digits}g}" for v in ticks]
        if all(abs(float(t) - v) <= spacing * 1e-3 for t, v in zip(labels, ticks)):
            break
    return [_short_exponent(t) for t in labels]


def _short_exponent(text: str) -> str:
    if "e" not in text:
        return text
    mantissa, exponent = text.split("e")
    return f"{mantissa}e{int(exponent)}"


def render(steps: list[int], series: list[tuple[str, list[float]]], title: str = "") -> tuple[Canvas, list[Panel]]:
    """The plot of ``series`` (label, one value per step) over ``steps``, under ``title``."""
    chars = (WIDTH - 16) // ADVANCE
    title_lines = [part for line in title.splitlines() for part in textwrap.wrap(line, chars)]
    top = 8 + TITLE_LINE * len(title_lines)
    heights = [FIRST_PANEL] + [OTHER_PANEL] * (len(series) - 1)
    canvas = Canvas(WIDTH, top + sum(h + PANEL_GAP for h in heights) + BOTTOM)
    for n, line in enumerate(title_lines):
        canvas.text(8, 6 + TITLE_LINE * n, line)
    x_lo, x_hi = (min(steps), max(steps)) if steps else (0, 1)
    if x_hi == x_lo:
        x_hi = x_lo + 1
    x_ticks = nice_ticks(x_lo, x_hi, 6, integer=True)
    left, right = LEFT, WIDTH - RIGHT

    def px(s: float) -> int:
        return left + round((s - x_lo) / (x_hi - x_lo) * (right - left))

    panels = []
    for n, ((label, values), height) in enumerate(zip(series, heights)):
        box = (left, top + PANEL_GAP, right, top + PANEL_GAP + height)
        pts = [(s, v) for s, v in zip(steps, values) if v is not None and math.isfinite(v)]
        canvas.text(left, box[1] - 16, _panel_label(label, pts if n == 0 else []))
        _draw_panel(canvas, box, pts, [px(t) for t in x_ticks], px, COLOURS[n % len(COLOURS)], mark_lowest=n == 0)
        panels.append(Panel(label, box, len(pts)))
        top = box[3]
    for t in x_ticks:
        canvas.text(px(t) - ADVANCE * len(str(t)) // 2, top + 6, str(t))
    canvas.text((left + right) // 2 - 2 * ADVANCE, top + 24, "step")
    return canvas, panels


def _panel_label(label: str, pts: list[tuple[int, float]]) -> str:
    if not pts:
        return label
    step, lowest = min(pts, key=lambda p: p[1])
    return f"{label} (lowest {lowest:.5g} at step {step})"


def _draw_panel(canvas: Canvas, box, pts, x_ticks_px: list[int], px, colour, mark_lowest: bool) -> None:
    left, top, right, bottom = box
    for gx in x_ticks_px:
        canvas.dotted(gx, top + 1, gx, bottom)
    if pts:
        ys = [v for _, v in pts]
        y_lo, y_hi = min(ys), max(ys)
        pad = (y_hi - y_lo) * 0.05 or abs(y_hi) * 0.05 or 1.0
        y_lo, y_hi = y_lo - pad, y_hi + pad

        def py(v: float) -> int:
            return bottom - round((v - y_lo) / (y_hi - y_lo) * (bottom - top))

        ticks = nice_ticks(y_lo, y_hi, 6 if mark_lowest else 3)
        for t, text in zip(ticks, tick_labels(ticks)):
            gy = py(t)
            canvas.dotted(left + 1, gy, right, gy)
            canvas.line(left - 4, gy, left, gy, FRAME)
            canvas.text(left - 6 - ADVANCE * len(text), gy - 5, text)
        prev = None
        for s, v in pts:
            cur = (px(s), py(v))
            if prev is not None:
                canvas.line(*prev, *cur, colour, thick=2)
            prev = cur
        if len(pts) == 1:
            canvas.line(prev[0] - 3, prev[1], prev[0] + 3, prev[1], colour, thick=2)
        if mark_lowest:
            s, v = min(pts, key=lambda p: p[1])
            for dx in range(-3, 4):
                for dy in range(-3, 4):
                    canvas.set(px(s) + dx, py(v) + dy, BEST)
    for a, b in (((left, top), (right, top)), ((left, bottom), (right, bottom)),
                 ((left, top), (left, bottom)), ((right, top), (right, bottom))):
        canvas.line(*a, *b, FRAME)


def write_png(steps: list[int], series: list[tuple[str, list[float]]], path: str | os.PathLike,
              title: str = "") -> list[Panel]:
    """``render`` to a PNG file at ``path``; returns the panels drawn."""
    canvas, panels = render(steps, series, title)
    Path(path).write_bytes(canvas.png())
    return panels
