"""What a `rewy-hf bench` run does for the first time, and in which training step: every Triton
kernel compile (a build, or a load from Triton's cache), every first call of a new attention
signature (mask or none, causal or not, shape, dtype), with its synchronised time, and the start of
every training step, as one timestamped log.

    cd /tmp && python $REPO/dev/first_calls.py --log calls.log bench --model qwen3.5-gva-1b-248k \\
        --packed --lift-gdn-guard --no-documents-check --steps 8 --sides unpatched-eager

Everything after ``--log FILE`` is the ``rewy-hf`` command line. For a step that is slower than its
neighbours, the lines between its ``step`` line and the next one say what it did first: a Triton
compile there is a kernel variant or tuning the run had not needed before; an attention line is a
scaled-dot-product-attention signature the process had not run before (a packed row of one document,
for one, takes transformers' plain causal path instead of a block-diagonal mask).
"""

from __future__ import annotations

import argparse
import runpy
import sys
import time

import torch
import torch.nn.functional as F


class CallLog:
    def __init__(self, path: str):
        self.out = open(path, "w", buffering=1)
        self.t0 = time.perf_counter()
        self.steps = 0
        self.signatures: set[tuple] = set()

    def line(self, what: str) -> None:
        self.out.write(f"{time.perf_counter() - self.t0:9.2f} {what}\n")

    def triton_compile(self, *args, **kwargs) -> bool:
        fn = kwargs.get("fn")
        self.line(f"compile {getattr(fn, 'name', '?')} {str(kwargs.get('repr', ''))[:200]}")
        return False                # go on compiling

    def wrap_step(self, step):
        def logged(*args, **kwargs):
            self.line(f"step {self.steps}")
            self.steps += 1
            return step(*args, **kwargs)
        return logged

    def wrap_attention(self, sdpa):
        def logged(q, k, v, attn_mask=None, *args, **kwargs):
            key = ("mask" if attn_mask is not None else "no mask", "causal" if kwargs.get("is_causal") else "-",
                   tuple(q.shape), str(q.dtype).removeprefix("torch."), "grad" if q.requires_grad else "no grad")
            if key in self.signatures:
                return sdpa(q, k, v, attn_mask, *args, **kwargs)
            self.signatures.add(key)
            sync = torch.cuda.synchronize if q.is_cuda else (lambda: None)
            sync()
            t = time.perf_counter()
            out = sdpa(q, k, v, attn_mask, *args, **kwargs)
            sync()
            self.line(f"attention first call {' '.join(map(str, key))}: {1e3 * (time.perf_counter() - t):.1f} ms")
            return out
        return logged


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", required=True, help="the log to write")
    args, command = parser.parse_known_args(argv)
    if not command:
        parser.error("give the rewy-hf command line after --log FILE, e.g. bench --model ...")
    log = CallLog(args.log)
    try:
        from triton import knobs
    except ImportError:
        knobs = None
    if knobs is not None and hasattr(knobs.runtime, "jit_cache_hook"):
        knobs.runtime.jit_cache_hook = log.triton_compile
    else:                           # an older Triton: steps and attention only
        log.line("this Triton has no compile hook (triton.knobs.runtime.jit_cache_hook): compiles are not logged")
    from rewy_hf.bench import compile_bench, model_bench, packed_bench

    # transformers looks the function up at each call, so the wrapper sees every attention layer
    F.scaled_dot_product_attention = log.wrap_attention(F.scaled_dot_product_attention)
    for module in (packed_bench, compile_bench, model_bench):      # each holds its own name for it
        module.train_step = log.wrap_step(module.train_step)
    sys.argv = ["rewy-hf", *command]
    runpy.run_module("rewy_hf", run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
