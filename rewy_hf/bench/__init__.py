"""The benchmark engine behind `rewy-hf bench`.

``config``: what is measured (boundaries, shapes, device defaults; the suite
in ``bench_shapes.json``) and the record of the machine. ``op_bench``: one op
configuration, its sides, gradient checks and timing, as an ``rows.OpRow``;
``op_run``: a whole op-level run. ``model_bench``: one model's training step,
unpatched against patched; ``compile_bench`` the same four ways, eager and
compiled; ``packed_bench`` over packed rows; ``cp_bench`` one row split across
processes. ``timing``: the alternating rounds and peak memory;
``kernel_profile``: where a run's time goes; ``autotune_picks``: forgetting
Triton's picks between shapes; ``fla_backends``: FLA's optional backends.
``tables`` and ``plots`` show the results; ``merge`` combines several runs'
JSON into one report; ``runner`` runs the command from its options.
"""
