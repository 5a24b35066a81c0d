"""The benchmark engine behind `rewy-hf bench`.

``config``: what is measured (boundaries, shapes, device defaults; the suite
in ``bench_shapes.json``). ``op_bench``: one op configuration, its sides,
gradient check and timing; ``op_run``: a whole op-level run. ``model_bench``:
one model's training step, unpatched against patched. ``timing``: the
alternating rounds and peak memory. ``autotune_picks``: forgetting Triton's
picks between shapes. ``output``: tables, Markdown and plots; ``merge``:
combining several runs' JSON into one report. The modules not named here
are developer benchmarks, run as scripts.
"""
