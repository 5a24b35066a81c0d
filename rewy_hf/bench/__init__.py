"""The benchmark engine behind `rewy-hf bench` (docs/bench.md says what each level measures).

``config``: what is measured and the record of the machine; ``op_bench``: one op configuration as a
``rows.OpRow``, ``op_run`` a whole op-level run, ``timing`` its rounds and peak memory; ``model_bench``,
``compile_bench`` and ``packed_bench``: a model's training step two ways, four ways, and on packed rows;
``cp_bench``: one row split across processes; ``kernel_profile``, ``autotune_picks`` and
``fla_backends``: where time goes, Triton's picks, FLA's optional backends; ``tables`` and ``plots``
show results; ``runner`` runs the command from its options.
"""
