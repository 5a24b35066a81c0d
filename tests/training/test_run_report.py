"""What a recipe run reports: the end summary (final and best loss, wall time, tokens/s, peak memory)
in its output and in run_config.json, the loss plot with its title and its loss, learning-rate and
gradient-norm panels (matplotlib and the built-in renderer), and --no-progress, which leaves stderr
without a progress bar, the checkpoint writer's included.

One 4-step run of the tiny GDN2 preset (checkpoints at 2 and 4, final/) is the material for the
summary and --no-progress; the plots are drawn from made-up records.
"""

from __future__ import annotations

import io
import json
import math
import re
import resource
import struct
import sys
import time
import zlib
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch
from support.recipe_runs import metrics, reset_accelerate

from rewy_hf.training import recipe

TINY = ["--model", "gdn2-tiny", "--seq-len", "32", "--batch-size", "1", "--warmup-steps", "1", "--max-steps", "4",
        "--save-every", "2", "--no-progress"]
BAR_MARKS = ("\r", "it/s", "%|", "Writing model shards")


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def _bar_switches() -> tuple[bool, bool]:
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as transformers_logging

    return transformers_logging.is_progress_bar_enabled(), are_progress_bars_disabled()


@pytest.fixture(scope="module")
def reported_run(tmp_path_factory):
    """The run, with what it printed, the title it gave its plot, and the clock and RSS around it."""
    out = tmp_path_factory.mktemp("report") / "tiny-run"
    titles = []
    real_plot = recipe.plot_loss

    def plot_and_keep_title(records, path, title=""):
        titles.append(title)
        return real_plot(records, path, title)

    switches = _bar_switches()
    capture = pytest.MonkeyPatch()
    capture.setattr(recipe, "plot_loss", plot_and_keep_title)
    stdout, stderr = io.StringIO(), io.StringIO()
    rss_before, t0 = _rss_bytes(), time.perf_counter()
    try:
        with redirect_stdout(stdout), redirect_stderr(stderr):
            rc = recipe.main([*TINY, "--output-dir", str(out)])
    finally:
        capture.undo()
        reset_accelerate()
    elapsed, rss_after = time.perf_counter() - t0, _rss_bytes()
    assert rc == 0, stderr.getvalue()[-3000:]
    return {"out": out, "stdout": stdout.getvalue(), "stderr": stderr.getvalue(), "titles": titles,
            "elapsed": elapsed, "rss": (rss_before, rss_after), "switches": (switches, _bar_switches())}


def _line(text: str, pattern: str) -> tuple[str, ...]:
    match = re.search(pattern, text)
    assert match, f"no line matching {pattern!r} in:\n{text}"
    return match.groups()


def test_summary_agrees_with_the_logged_steps(reported_run):
    records = metrics(reported_run["out"])
    losses = [r["loss"] for r in records]
    summary = json.loads((reported_run["out"] / "run_config.json").read_text())["summary"]
    # final = the last logged loss, best = the lowest, at its own step
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert (summary["final_step"], summary["final_loss"]) == (4, losses[-1])
    best = min(range(4), key=losses.__getitem__)
    assert (summary["best_step"], summary["best_loss"]) == (best + 1, losses[best])
    # tokens/s: the training tokens over the time spent in the steps, not over the wall time
    step_time = sum(r["step_time_s"] for r in records)
    assert summary["tokens"] == records[-1]["tokens_seen"] == 4 * 32
    assert summary["step_time_s"] == pytest.approx(step_time, rel=1e-9)
    assert summary["tokens_per_s"] == pytest.approx(128 / step_time, rel=1e-9)
    assert (summary["steps_run"], summary["first_step_run"], summary["last_step_run"]) == (4, 1, 4)
    # the wall time covers the steps, loading and saving, and lies within the call
    assert step_time < summary["wall_time_s"] <= reported_run["elapsed"]
    # the peak RSS of this process, in bytes: between its peak before the run and after it
    before, after = reported_run["rss"]
    assert before <= summary["peak_memory_bytes"] <= after
    assert summary["peak_memory_source"] == "peak RSS of the process, from resource.getrusage"


def test_summary_is_printed_with_the_paths(reported_run):
    out, text = reported_run["out"], reported_run["stdout"]
    summary = json.loads((out / "run_config.json").read_text())["summary"]
    final, final_step = _line(text, r"final loss:\s+([\d.]+) at step (\d+)")
    best, best_step = _line(text, r"best loss:\s+([\d.]+) at step (\d+)")
    assert float(final) == pytest.approx(summary["final_loss"], abs=5e-5) and int(final_step) == 4
    assert float(best) == pytest.approx(summary["best_loss"], abs=5e-5) and int(best_step) == summary["best_step"]
    wall, in_steps = _line(text, r"wall time:\s+([\d.]+) s, ([\d.]+) s of it in training steps 1-4")
    assert float(wall) == pytest.approx(summary["wall_time_s"], abs=0.05)
    assert float(in_steps) == pytest.approx(summary["step_time_s"], abs=0.005)
    rate, tokens = _line(text, r"tokens/s:\s+(\d+) \((\d+) training tokens in [\d.]+ s of steps 1-4\)")
    assert abs(int(rate) - summary["tokens_per_s"]) <= 0.5 and int(tokens) == 128
    (mib,) = _line(text, r"peak memory:\s+([\d,.]+) MiB \(peak RSS of the process, from resource.getrusage\)")
    assert float(mib.replace(",", "")) == pytest.approx(summary["peak_memory_bytes"] / 2**20, abs=0.05)
    # the paths are still listed after it
    assert text.index("peak memory:") < text.index(f"  metrics:          {out / 'metrics.jsonl'}")
    assert f"  final model:      {out / 'final'}" in text and f"  checkpoint:       {out / 'checkpoint-4'}" in text


def test_no_progress_leaves_stderr_without_bars(reported_run):
    err = reported_run["stderr"]
    assert not [mark for mark in BAR_MARKS if mark in err], err[-2000:]
    # checkpoints and final/ were written (through save_pretrained, which draws a bar unless told not to)
    assert (reported_run["out"] / "checkpoint-2" / "model.safetensors").is_file()
    assert (reported_run["out"] / "final" / "model.safetensors").is_file()
    before, after = reported_run["switches"]
    assert after == before, "the libraries' progress-bar switches are as they were before the run"


def test_the_plot_title_names_the_run_and_its_settings(reported_run):
    (title,) = reported_run["titles"]
    name_line, settings = title.split("\n")
    assert name_line == "tiny-run: gdn2-tiny"
    for part in ("4 steps", "batch 1 x seq-len 32", "lr 0.0003 (warmup 1, cosine to 0.1x)", "float32 weights",
                 "patched (rewy, backend auto)", "compile off"):
        assert part in settings, (part, settings)
    assert "(matplotlib)" in reported_run["stdout"]
    assert (reported_run["out"] / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- the progress-bar switches -----------------------------------------------------------------------

def _draw_bars() -> None:
    from huggingface_hub.utils import tqdm as hub_tqdm
    from transformers.utils import logging as transformers_logging

    for _ in transformers_logging.tqdm(range(2), desc="Writing model shards"):
        pass
    for _ in hub_tqdm(range(2), desc="Downloading"):
        pass


def test_bars_off_silences_transformers_and_the_hub_and_restores_them(capfd):
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    from rewy_hf.training.progress import bars_off

    _draw_bars()
    err = capfd.readouterr().err
    assert "Writing model shards" in err and "Downloading" in err   # the bars this test looks for do show
    with bars_off():
        _draw_bars()
    assert capfd.readouterr().err == ""
    _draw_bars()
    assert "Writing model shards" in capfd.readouterr().err
    with bars_off(False):
        _draw_bars()
    assert "Downloading" in capfd.readouterr().err
    # a group switched off before the run stays off after it, the rest on
    disable_progress_bars("some.group")
    try:
        with bars_off():
            assert are_progress_bars_disabled()
        assert are_progress_bars_disabled("some.group") and not are_progress_bars_disabled()
    finally:
        enable_progress_bars()


def test_datasets_bars_off_restores_the_switch():
    import datasets

    from rewy_hf.training.progress import datasets_bars_off

    assert not datasets.are_progress_bars_disabled()
    with datasets_bars_off():
        assert datasets.are_progress_bars_disabled()
    assert not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        with datasets_bars_off():
            pass
        assert datasets.are_progress_bars_disabled()   # off before, off after
    finally:
        datasets.enable_progress_bars()


# --- the plot ----------------------------------------------------------------------------------------

def _records(n: int = 30) -> list[dict]:
    """A falling loss with a dip at step 17, a warmup-cosine LR, a decaying gradient norm."""
    out = []
    for s in range(1, n + 1):
        loss = 6.0 - 2.0 * s / n + (-1.5 if s == 17 else 0.0)
        lr = 3e-4 * min(1.0, s / 5) * (0.55 + 0.45 * math.cos(math.pi * s / n))
        out.append({"step": s, "loss": loss, "lr": lr, "grad_norm": 4.0 / s ** 0.5})
    return out


def test_matplotlib_plot_has_the_three_panels_under_the_title():
    from rewy_hf.training.loss_plot import loss_figure

    records = _records()
    fig = loss_figure(records, "run-a: gdn2-tiny\n30 steps, batch 2 x seq-len 80")
    axes = fig.get_axes()
    assert [ax.get_title(loc="left") for ax in axes] == ["loss", "learning rate", "gradient norm (before clipping)"]
    assert fig._suptitle.get_text() == "run-a: gdn2-tiny\n30 steps, batch 2 x seq-len 80"
    for ax, key in zip(axes, ("loss", "lr", "grad_norm")):
        curve = ax.get_lines()[0]
        assert list(curve.get_xdata()) == list(range(1, 31))
        assert list(curve.get_ydata()) == [r[key] for r in records]
    # the lowest loss is marked where it is, and named with its step
    best = [line for line in axes[0].get_lines() if line.get_label().startswith("lowest")]
    assert [(line.get_xdata()[0], line.get_ydata()[0]) for line in best] == [(17, records[16]["loss"])]
    assert best[0].get_label() == f"lowest {records[16]['loss']:.4f} (step 17)"
    # whole steps on the shared axis
    fig.canvas.draw()
    ticks = [t for t in axes[-1].get_xticks() if 1 <= t <= 30]
    assert ticks and all(float(t).is_integer() for t in ticks)


def _decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and RGB rows of a PNG as the built-in renderer writes it (one IDAT, filter 0)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    pos, idat = 8, b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        if data[pos + 4:pos + 8] == b"IDAT":
            idat += data[pos + 8:pos + 8 + length]
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = 3 * width + 1
    assert all(raw[r * stride] == 0 for r in range(height))
    return width, height, [raw[r * stride + 1:(r + 1) * stride] for r in range(height)]


def _count(rows: list[bytes], box, rgb) -> int:
    left, top, right, bottom = box
    return sum(tuple(rows[y][3 * x:3 * x + 3]) == rgb for y in range(top, bottom) for x in range(left, right))


def test_builtin_renderer_draws_the_title_and_three_panels(tmp_path, monkeypatch):
    from rewy_hf.training import builtin_plot
    from rewy_hf.training.loss_plot import plot_loss, series

    monkeypatch.setitem(sys.modules, "matplotlib", None)          # as where it is not installed
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    records, path = _records(), tmp_path / "plot.png"
    assert plot_loss(records, path, "run-a: gdn2-tiny\n30 steps, batch 2 x seq-len 80") == "builtin"
    width, height, rows = _decode_png(path.read_bytes())

    canvas, panels = builtin_plot.render(*series(records), "run-a: gdn2-tiny\n30 steps, batch 2 x seq-len 80")
    assert (width, height) == (canvas.width, canvas.height) and rows == [bytes(r) for r in canvas.rows]
    assert [p.label for p in panels] == ["loss", "learning rate", "gradient norm (before clipping)"]
    assert all(p.points == 30 for p in panels)
    # stacked top to bottom, each panel holding its own curve's colour and no other's
    assert all(a.box[3] < b.box[1] for a, b in zip(panels, panels[1:]))
    for panel, colour in zip(panels, builtin_plot.COLOURS):
        assert _count(rows, panel.box, colour) > 100, panel.label
        others = [c for c in builtin_plot.COLOURS if c != colour]
        assert all(_count(rows, panel.box, c) == 0 for c in others), panel.label
    # two title lines of ink above the first panel's label
    title_band = (0, 0, width, panels[0].box[1] - 20)
    assert _count(rows, title_band, builtin_plot.INK) > 200
    inked = [builtin_plot.INK in _pixels(rows[y]) for y in range(title_band[3])]
    assert sum(1 for y in range(1, len(inked)) if inked[y] and not inked[y - 1]) + inked[0] == 2
    # the lowest loss is marked at step 17, left of the middle of the 30 steps
    left, top, right, bottom = panels[0].box
    red = [x for y in range(top, bottom) for x in range(left, right) if tuple(rows[y][3 * x:3 * x + 3]) ==
           builtin_plot.BEST]
    middle = left + round(16 / 29 * (right - left))
    assert red and abs(sum(red) / len(red) - middle) <= 1


def _pixels(row: bytes):
    return {tuple(row[i:i + 3]) for i in range(0, len(row), 3)}


def test_builtin_tick_labels_are_round_and_as_precise_as_their_spacing():
    from rewy_hf.training.builtin_plot import nice_ticks, tick_labels

    ticks = nice_ticks(5.51, 5.61, 6)
    assert ticks == pytest.approx([5.52, 5.54, 5.56, 5.58, 5.60]) and tick_labels(ticks) == \
        ["5.52", "5.54", "5.56", "5.58", "5.6"]
    assert tick_labels(nice_ticks(0.9, 1.0, 4)) == ["0.9", "0.925", "0.95", "0.975", "1"]
    assert tick_labels(nice_ticks(1e-6, 3.2e-5, 3)) == ["1e-5", "2e-5", "3e-5"]
    assert nice_ticks(1, 1000, 6, integer=True) == [200, 400, 600, 800, 1000]
    assert nice_ticks(1, 4, 6, integer=True) == [1, 2, 3, 4]


# --- the summary's own arithmetic --------------------------------------------------------------------

def test_summary_of_a_resumed_run_and_on_cuda(monkeypatch):
    from rewy_hf.training.summary import CUDA_ALLOCATED, StepClock, summarize

    records = [{"step": s, "loss": v} for s, v in ((1, 3.0), (2, 2.5), (3, 2.7), (4, 2.6))]
    clock = StepClock()
    clock.add(3, 0.5, 1000)   # resumed at step 2: this process ran steps 3-4
    clock.add(4, 0.25, 1000)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)
    summary = summarize(records, clock, 10.0, torch.device("cuda"), processes=2)
    assert (summary.final_step, summary.final_loss, summary.best_step, summary.best_loss) == (4, 2.6, 2, 2.5)
    assert summary.tokens_per_s == pytest.approx(2000 / 0.75)
    assert summary.peak_memory_bytes == 3 * 2**30 and summary.peak_memory_source == f"{CUDA_ALLOCATED}, main process"
    lines = "\n".join(summary.lines())
    assert "final loss:       2.6000 at step 4" in lines and "best loss:        2.5000 at step 2" in lines
    assert "wall time:        10.0 s, 0.75 s of it in training steps 3-4" in lines
    assert "tokens/s:         2667 (2,000 training tokens in 0.75 s of steps 3-4)" in lines
    assert "peak memory:      3,072.0 MiB (torch.cuda.max_memory_allocated, main process)" in lines

    empty = summarize([], StepClock(), 1.0, torch.device("cpu"))
    assert empty.final_loss is None and empty.tokens_per_s is None
    assert "final loss:       none (no step logged)" in "\n".join(empty.lines())
