"""How `rewy-hf parity` shows its result: a progress bar, a table, a verdict; with ``--packed``, a
table of the packed row against its documents."""

from __future__ import annotations

import contextlib
import sys

from .comparison import ParityResult, group_summary
from .packed import CHUNK, PackedResult


@contextlib.contextmanager
def progress_bar(total: int, desc: str):
    from tqdm.auto import tqdm

    with tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=False) as bar:
        yield lambda step: bar.update(1)


def _fmt(x: float | None, spec: str = ".2e") -> str:
    return "-" if x is None else format(x, spec)


def format_result(result: ParityResult, *, model: str, dtype: str, device: str) -> str:
    tol = result.tolerance
    d = result.to_dict()
    compiled = "" if result.compile_backend is None else f", both sides compiled ({result.compile_backend})"
    lines = [f"rewy-hf parity: {model} ({dtype}, {device}, {len(result.losses)} step(s){compiled})", ""]
    u, p = result.losses[-1]
    lines.append(f"loss (last step)  unpatched {u:.6f}  patched {p:.6f}  "
                 f"max rel diff {result.loss_rel_err:.2e}  (tol {tol.loss_rel:.0e})  "
                 f"{'OK' if result.loss_rel_err <= tol.loss_rel else 'FAIL'}")
    gu, gp = result.grad_norms[-1]
    lines.append(f"gradient norm     unpatched {gu:.6g}  patched {gp:.6g}  "
                 f"rel diff {abs(gp - gu) / max(gu, 1e-30):.2e}  (last step, all trainable parameters)")
    lines.append("")
    rows = [(g["group"], str(g["params"]), _fmt(g["max_rel_err"]), f"{g['min_cosine']:.8f}",
             g["worst_param"], "OK" if g["ok"] else "FAIL") for g in group_summary(result.params)]
    header = ("layer / group", "params", "max rel err", "min cosine", "worst parameter", "status")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines += [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]
    if result.update:
        worst = max(result.update, key=lambda r: r.rel_err)
        lines.append(f"\noptimizer step (SGD): worst update rel err {worst.rel_err:.2e} beyond the rounding of the "
                     f"updated weights ({worst.name[7:]})  {'OK' if all(r.ok for r in result.update) else 'FAIL'}")
    ms, speed = d["backward_ms"], d["backward_speedup"]
    lines.append(f"backward time (median): unpatched {_fmt(ms['unpatched'], '.1f')} ms, "
                 f"patched {_fmt(ms['patched'], '.1f')} ms" + (f"  ({speed:.2f}x)" if speed else ""))
    lines.append(f"optimized backward calls: {result.optimized_backward_calls}")
    failing = sorted(result.failing(), key=lambda r: -r.rel_err)
    if failing:
        lines.append("\nworst offenders:")
        lines += [f"  {r.name}: rel err {r.rel_err:.2e}, cosine {r.cosine:.6f}" for r in failing[:5]]
    tiny = [r for r in result.params if r.tiny]
    if tiny:
        lines.append(f"\n{len(tiny)} gradient(s) below 1e-4 of the largest were judged against that floor "
                     f"(e.g. {tiny[0].name})")
    n = len(result.params)
    lines.append("")
    if result.ok:
        lines.append(f"PARITY HOLDS: loss and all {n} gradients within tolerance "
                     f"(loss {tol.loss_rel:.0e}, gradient {tol.grad_rel:.0e} relative)")
    else:
        layers = sorted({r.group.removeprefix("update:") for r in failing})
        lines.append(f"PARITY VIOLATED in {len(failing)} tensor(s) (layers: {', '.join(layers) or 'loss'})")
    return "\n".join(lines)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header).rstrip(), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r).rstrip()
                                                                                      for r in rows]


def format_packed(result: PackedResult, *, model: str, dtype: str, device: str) -> str:
    tol = result.tolerance
    lines = [f"rewy-hf parity --packed: {model} ({dtype}, {device})", "",
             f"one packed row of {sum(result.lengths)} tokens, {len(result.lengths)} documents "
             f"({' + '.join(map(str, result.lengths))}; bounds at {', '.join(map(str, result.bounds))}, "
             f"chunk {CHUNK}),",
             "each model against itself running the documents one by one: the logits, and the gradients of a "
             "loss summed over tokens", ""]
    rows = [(r.model, r.given, _fmt(r.logits.rel_err), _fmt(r.worst_gradient.rel_err), r.worst_gradient.name,
             "OK" if r.ok else ("FAIL" if r.model == "patched" else "LEAKS")) for r in result.rows]
    lines += _table(("model", "row given as", "logits rel err", "max grad rel err", "worst parameter", "verdict"),
                    rows)
    lines.append(f"\ntolerance: {tol.grad_rel:.0e} relative on the logits and each gradient ({dtype})")
    lines.append(f"optimized backward calls (patched): {result.optimized_backward_calls}")
    if result.unpatched_leaks:
        lines.append("\nthe unpatched model leaks across packed documents: its packed row's logits or gradients "
                     "are not its documents' (shown for comparison; the verdict is the patched model's)")
    failing = result.failing()
    if failing:
        lines.append("\nworst offenders (patched):")
        lines += [f"  {g.name}: rel err {g.rel_err:.2e}, cosine {g.cosine:.6f} (row given as {given})"
                  for g, given in failing[:5]]
        if dtype in ("bfloat16", "float16"):
            lines.append(f"  in {dtype} this can be rounding: a token whose top-k router scores nearly tie may "
                         "pick another expert in the packed row than alone; --dtype float32 tells it from a leak")
    lines.append("")
    if result.ok:
        lines.append(f"PACKED ROWS HOLD: the patched model's packed row matches its documents run one by one "
                     f"(logits and all {len(result.rows[0].gradients)} gradients within {tol.grad_rel:.0e} relative)")
    else:
        lines.append(f"PACKED ROWS VIOLATED: the patched model's packed row differs from its documents run one by "
                     f"one in {len(failing)} tensor(s)")
    return "\n".join(lines)
