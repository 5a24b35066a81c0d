"""How `rewy-hf parity` shows its result: a progress bar, a table, a verdict."""

from __future__ import annotations

import contextlib
import sys

from .comparison import ParityResult, group_summary


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
        lines.append(f"\noptimizer step (SGD): worst update rel err {worst.rel_err:.2e} ({worst.name[7:]})  "
                     f"{'OK' if all(r.ok for r in result.update) else 'FAIL'}")
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
