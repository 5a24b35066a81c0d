"""Training helpers behind ``recipes/finetune*.py``: data packing and a byte tokenizer
(``data``), the LR schedule (``schedule``), atomic checkpoints (``checkpoint``),
metrics and the loss-curve PNG (``metrics``), and the recipe loop (``recipe``).

Nothing here imports FLA at import time, so a recipe can switch on Triton's CPU
interpreter first (see ``rewy_hf.cpu_triton``).
"""
