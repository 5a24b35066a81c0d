"""What `rewy-hf bench` measures: ops, policies, boundaries, shapes, the defaults
that depend on the device, and the record of the machine a run measured on."""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from importlib import resources

from .. import settings
from ..op_inputs import LOWER_BOUND, STRONG_DECAY, Shape

BOUNDARIES = ("B", "FB")

# The second gradient check of the vector-gated ops (op_inputs.BOUND_OPS), as the tables and JSON state it.
BOUND_CHECK = (f"KDA and GDN2 also on gates near FLA's safe lower bound ({LOWER_BOUND:g} * sigmoid(x + 3), "
               "safe_gate=True on both sides); a row passes when both checks do")
# The second gradient check of GDN (op_inputs.STRONG_OPS).
STRONG_CHECK = (f"GDN also under strong decay (log-gate {STRONG_DECAY:g} + at most 0.1 per token); a row passes "
                "when both checks do")

# The CPU comparison runs a token-by-token reference recurrence as its
# baseline; at the GPU suite's sizes one call would take minutes, so CPU runs
# default to this small shape instead (and say so).
CPU_SUITE = ({"B": 1, "T": 512, "H": 2},)
CPU_HEAD_DIM = 64


# Defaults that depend on the device, as (cuda, cpu).
OP_REPS, OP_WARMUP = (5, 3), (3, 1)
MODEL_STEPS, MODEL_WARMUP, MODEL_SEQ_LEN, MODEL_DTYPE = (10, 2), (2, 1), (4096, 128), ("bfloat16", "float32")
# --packed: on CUDA one row of 8,192 tokens and 50 steps, so that a tuning stall has room to show after the
# first few; on CPU a row of 256 (the documents check needs 2,048 whatever the row).
PACKED_STEPS, PACKED_SEQ_LEN = (50, 4), (8192, 256)
MODEL_DTYPES = ("bfloat16", "float32")


def on_cpu(device: str) -> int:
    """Index into the (cuda, cpu) default pairs above."""
    return int(device != "cuda")


@dataclass(frozen=True)
class CustomShape:
    """A shape from the command line; K and V may be left to the device default."""
    B: int
    T: int
    H: int
    K: int | None = None
    V: int | None = None
    N: int = 0

    def resolve(self, head_dim: int) -> Shape:
        return Shape(self.B, self.T, self.H, self.K or head_dim, self.V or head_dim, self.N)


SUITE = "suite"


def suite_file() -> dict:
    """The six-shape GPU suite shipped with the package."""
    return json.loads(resources.files(__package__).joinpath("bench_shapes.json").read_text(encoding="utf-8"))


def resolve_shapes(specs: list | None, device: str) -> tuple[list[Shape], str]:
    """The shapes to run and a sentence saying where they came from."""
    specs = specs or [SUITE]
    if device == "cuda":
        data = suite_file()
        suite = [Shape(s["B"], s["T"], s["H"], data["K"], data["V"]) for s in data["shapes"]]
        head_dim, origin = data["K"], "the six-shape suite (rewy_hf/bench/bench_shapes.json)"
    else:
        suite = [Shape(s["B"], s["T"], s["H"], CPU_HEAD_DIM, CPU_HEAD_DIM) for s in CPU_SUITE]
        head_dim = CPU_HEAD_DIM
        origin = ("the CPU suite (B,T,H = " + "; ".join(f"{s['B']},{s['T']},{s['H']}" for s in CPU_SUITE)
                  + f", K = V = {CPU_HEAD_DIM}; the GPU suite is too large for the CPU reference recurrence)")
    shapes: list[Shape] = []
    for spec in specs:
        for shape in (suite if spec == SUITE else [spec.resolve(head_dim)]):
            if shape not in shapes:
                shapes.append(shape)
    if SUITE not in specs:
        origin = f"custom shapes (K = V = {head_dim} where not given)"
    return shapes, origin


def expand(values: list[str] | None, allowed: tuple[str, ...], every: str, default: tuple[str, ...]) -> list[str]:
    """'all' / 'both' mean every choice; order follows ``allowed``; duplicates collapse."""
    if not values:
        return list(default)
    if every in values:
        return list(allowed)
    return [v for v in allowed if v in values]


def given(args, *flags: str) -> list[str]:
    """Those of the options ``flags`` (spelled as on the command line) that ``args`` sets."""
    return [flag for flag in flags if getattr(args, flag[2:].replace("-", "_"))]


def check_T(shape: Shape, max_tokens: int) -> int:
    """T for the gradient check: the timed T unless B*T*H exceeds ``max_tokens``; then
    the largest multiple of the 64-token chunk that fits (at least one chunk)."""
    if shape.B * shape.T * shape.H <= max_tokens:
        return shape.T
    return min(shape.T, max(64, shape.N, (max_tokens // (shape.B * shape.H)) // 64 * 64))


def environment(device: str) -> dict:
    """The run's device and the versions that shape what it times."""
    import torch

    from ..environment import package_version, rewy_hf_version

    if device == "cuda":
        name = torch.cuda.get_device_name()
    else:
        name = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads)"
    return {"device": device, "device_name": name,
            "versions": {"torch": torch.__version__, "triton": package_version("triton"),
                         "flash-linear-attention": package_version("flash-linear-attention"),
                         "fla-core": package_version("fla-core"), "rewy-hf": rewy_hf_version(),
                         "transformers": package_version("transformers"),
                         # FLA dispatches GDN to FlashQLA when it is installed: the baseline then is FlashQLA.
                         "flash-qla": package_version("flash-qla"),
                         "tilelang": package_version("tilelang"), "python": platform.python_version()},
            # a fault or the finite check changes what is timed
            "rewy_env": settings.current()}
