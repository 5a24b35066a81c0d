"""The benchmark engine behind `rewy-hf bench` (docs/bench.md says what each level measures).

``config``: what is measured and the record of the machine; ``op_bench``: one op configuration as a
``rows.OpRow``, ``op_run`` a whole op-level run, ``timing`` its rounds and peak memory; ``model_bench``,
``compile_bench`` and ``packed_bench``: a model's training step two ways, four ways, and on packed rows;
``kernel_profile``, ``autotune_picks``, ``triton_builds`` and ``fla_backends``: GPU time by kernel family,
Triton's picks forgotten between shapes, Triton's builds, FLA's optional backends; ``tables`` and
``plots`` show results; ``runner`` runs the command from its options. The developer measurements
(context parallelism, peers, kernel profiles, combined reports) are dev/bench_lab's.
"""
