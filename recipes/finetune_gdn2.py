#!/usr/bin/env python
"""Fine-tune (or pre-train from a preset) a GDN2 causal LM with rewy-hf's delta-rule backward.

    python recipes/finetune_gdn2.py                       # tiny GDN2 preset, bundled corpus, runs on CPU
    python recipes/finetune_gdn2.py --max-steps 20 --seq-len 128 --batch-size 4 --output-dir outputs/demo
    accelerate launch --config_file recipes/configs/single_gpu.yaml recipes/finetune_gdn2.py \
        --model gdn2-350m --seq-len 2048 --batch-size 8 --max-steps 2000
    python recipes/finetune_gdn2.py --resume --output-dir outputs/demo   # continue from the latest checkpoint

Same options as recipes/finetune.py (this is that recipe with the GDN2 tiny preset as the default
--model); `--help` lists them. The loop lives in rewy_hf/training/recipe.py.
"""

import sys

from rewy_hf.training.recipe import main

if __name__ == "__main__":
    sys.exit(main(default_model="gdn2-tiny", prog="finetune_gdn2.py"))
