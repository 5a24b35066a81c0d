"""Training helpers behind ``recipes/finetune*.py``: the recipe's command line
(``options``), the model and tokenizer it trains (``model_setup``), data packing
and a byte tokenizer (``data``), the LR schedule (``schedule``), atomic
checkpoints and their soundness check (``checkpoint``), the lock and clean-up of the output
directory (``output_dir``), ``metrics.jsonl`` (``metrics``), the loss plot
(``loss_plot``; ``builtin_plot`` draws it without matplotlib), the end summary
(``summary``), ``--no-progress``'s switches (``progress``), the run itself
(``recipe``, with ``resume``, ``loop`` for the training steps and ``saving``) with
its default corpus (``corpus.txt``, package data). Comparing several runs' metrics is a developer
script, ``dev/compare_runs.py``.

Nothing here imports FLA at import time, so a recipe can switch on Triton's CPU
interpreter first (see ``rewy_hf.cpu_triton``).
"""
