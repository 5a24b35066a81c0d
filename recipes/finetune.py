#!/usr/bin/env python
"""Fine-tune any delta-rule causal LM that rewy-hf patches (GDN2, Qwen3.5 / Qwen3-Next, Kimi-Linear,
FLA DeltaNet / GatedDeltaNet / KDA, ...), or any causal LM at all with --core original.

    python recipes/finetune.py --model Qwen/Qwen3.5-0.8B --data my.jsonl --seq-len 2048 ...
    accelerate launch --config_file recipes/configs/ddp.yaml recipes/finetune.py --model ...

The loop lives in rewy_hf/training/recipe.py; `--help` lists every option. See recipes/README.md.
"""

import sys

from rewy_hf.training.recipe import main

if __name__ == "__main__":
    sys.exit(main(prog="finetune.py"))
