"""``metrics.jsonl`` (one JSON object per optimizer step) and the loss-curve PNG.

The PNG uses matplotlib when it is installed (the optional ``train`` extra);
otherwise a small built-in renderer draws axes, the curve and numeric labels
(no dependencies beyond zlib), so a plot is always written.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from pathlib import Path

class MetricsWriter:
    """Appends records to ``path``. With ``resume_step``, first drops records of steps after it
    (written by a run that died before its next checkpoint), so the file stays one clean sequence."""

    def __init__(self, path: str | os.PathLike, resume_step: int | None = None):
        self.path = Path(path)
        if resume_step is None:
            self.path.write_text("")
        else:
            kept = [r for r in read_metrics(self.path) if r["step"] <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: str | os.PathLike) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:   # a torn last line from a killed run
            break
    return out


def plot_loss(records: list[dict], path: str | os.PathLike) -> str:
    """Write the loss curve to ``path``; returns which renderer drew it ("matplotlib" or "builtin")."""
    steps = [r["step"] for r in records]
    losses = [r["loss"] for r in records]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _png_plot(steps, losses, path)
        return "builtin"
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, losses, lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return "matplotlib"


# --- built-in renderer -----------------------------------------------------------------------------
# 3x5 glyphs, rows top to bottom, '#' = ink.
_GLYPHS = {
    "0": "###|#.#|#.#|#.#|###", "1": ".#.|##.|.#.|.#.|###", "2": "###|..#|###|#..|###", "3": "###|..#|###|..#|###",
    "4": "#.#|#.#|###|..#|..#", "5": "###|#..|###|..#|###", "6": "###|#..|###|#.#|###", "7": "###|..#|..#|..#|..#",
    "8": "###|#.#|###|#.#|###", "9": "###|#.#|###|..#|###", ".": "...|...|...|...|.#.", "-": "...|...|###|...|...",
    "e": "...|###|#.#|##.|.##", "+": "...|.#.|###|.#.|...", "l": "##.|.#.|.#.|.#.|###", "o": "...|###|#.#|#.#|###",
    "s": "...|.##|##.|..#|##.", "t": ".#.|###|.#.|.#.|.##", "p": "...|###|#.#|###|#..", " ": "...|...|...|...|...",
}


def _text(img, x: int, y: int, s: str, scale: int = 2) -> None:
    for ch in s:
        rows = _GLYPHS.get(ch, _GLYPHS[" "]).split("|")
        for r, row in enumerate(rows):
            for c, px in enumerate(row):
                if px == "#":
                    for dy in range(scale):
                        for dx in range(scale):
                            _set(img, x + c * scale + dx, y + r * scale + dy, (0, 0, 0))
        x += 4 * scale


def _set(img, x: int, y: int, rgb) -> None:
    h, w = len(img), len(img[0]) // 3
    if 0 <= x < w and 0 <= y < h:
        img[y][3 * x:3 * x + 3] = bytes(rgb)


def _line(img, x0: int, y0: int, x1: int, y1: int, rgb) -> None:
    dx, dy = abs(x1 - x0), -abs(y1 - y0)
    sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
    err = dx + dy
    while True:
        for o in (0, 1):
            _set(img, x0, y0 + o, rgb)
        if x0 == x1 and y0 == y1:
            return
        e2 = 2 * err
        if e2 >= dy:
            err += dy
            x0 += sx
        if e2 <= dx:
            err += dx
            y0 += sy


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def _png_plot(steps: list[int], losses: list[float], path, width: int = 640, height: int = 400) -> None:
    img = [bytearray(b"\xff" * (3 * width)) for _ in range(height)]
    left, right, top, bottom = 70, width - 20, 20, height - 40
    _line(img, left, top, left, bottom, (0, 0, 0))
    _line(img, left, bottom, right, bottom, (0, 0, 0))
    pts = [(s, v) for s, v in zip(steps, losses) if math.isfinite(v)]
    if pts:
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        x_lo, x_hi = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
        y_lo, y_hi = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1
        px = lambda s: left + round((s - x_lo) / (x_hi - x_lo) * (right - left))     # noqa: E731
        py = lambda v: bottom - round((v - y_lo) / (y_hi - y_lo) * (bottom - top))   # noqa: E731
        for frac in (0.25, 0.5, 0.75, 1.0):   # light grid
            gy = bottom - round(frac * (bottom - top))
            for gx in range(left + 1, right, 4):
                _set(img, gx, gy, (210, 210, 210))
        prev = None
        for s, v in pts:
            cur = (px(s), py(v))
            if prev is not None:
                _line(img, *prev, *cur, (31, 119, 180))
            prev = cur
        if len(pts) == 1:
            _line(img, cur[0] - 2, cur[1], cur[0] + 2, cur[1], (31, 119, 180))
        _text(img, 4, top, _fmt(y_hi))
        _text(img, 4, bottom - 10, _fmt(y_lo))
        _text(img, left, bottom + 8, str(x_lo))
        _text(img, right - 8 * len(str(x_hi)), bottom + 8, str(x_hi))
    _text(img, (left + right) // 2 - 16, bottom + 20, "step")
    _text(img, 4, (top + bottom) // 2, "loss")

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + bytes(row) for row in img)
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    Path(path).write_bytes(png)
