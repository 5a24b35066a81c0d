"""The developer bench: `rewy-hf bench` with the measurements and reports made for working on rewy-hf
itself rather than for checking it on one's own machine.

Run from a clone, outside the repository root (its ``kernels/`` folder would shadow Hugging Face's
``kernels`` package): ``cd /tmp && python $REPO/dev/bench_lab [options]``. It takes every option of
the installed `rewy-hf bench` and runs its op and model levels as that command does, and adds:

- ``--peers`` (``peers``): further baselines timed beside FLA as installed (FLA's Triton path,
  FlashQLA's own entry), each gradient-checked;
- ``--kernel-profile`` (``kernels``): where each side's time goes, kernel by kernel; op-level rows on a
  GPU also record the autotune picks each kernel ran with (``op_level`` adds all three to the
  installed op level);
- ``--context-parallel`` (``context_parallel``): one packed row split across the processes of a
  torchrun launch, rewy's op against FLA's on every slice;
- ``--from-json`` (``reports``, ``merge``, ``rows``): the tables of kept ``--json`` files, without
  running anything; several op-level files of one setup combine into one report, model-level runs of
  some ``--sides`` each into one table; ``--markdown``: the tables as Markdown, as docs/ publishes them.

``command`` builds the parser (the installed one plus these options) and runs what they ask for.
"""
