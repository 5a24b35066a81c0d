"""Training helpers behind ``recipes/finetune*.py``: the recipe's command line
(``options``), the model and tokenizer it trains (``model_setup``), data packing
and a byte tokenizer (``data``), the LR schedule (``schedule``), atomic
checkpoints and their soundness check (``checkpoint``), the lock and clean-up of the output
directory (``output_dir``), metrics and the loss-curve PNG (``metrics``), the
training loop (``recipe``) with its default corpus (``corpus.txt``, package
data), and the comparison of several runs' metrics (``compare_runs``,
``python -m rewy_hf.training.compare_runs``).

Nothing here imports FLA at import time, so a recipe can switch on Triton's CPU
interpreter first (see ``rewy_hf.cpu_triton``).
"""
