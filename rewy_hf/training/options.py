"""The command line of the fine-tuning recipes: options, their defaults, and the checks of their values.

Every bad value is refused with a ``RecipeError`` that names the option and the fix.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch

from ..command_line import CORES, HelpFormatter
from ..patching.patch import FALLBACKS
from ..validation import BACKENDS, POLICIES

BUNDLED_CORPUS = Path(__file__).resolve().with_name("corpus.txt")   # package data: there in every install
DEFAULT_MODEL = "gdn2-tiny"
# torch's dtype names on the command line, accelerate's names for them
MIXED_PRECISION = {"bfloat16": "bf16", "float16": "fp16"}

#: Linear layer names that LoRA targets when present: the token mixers' q/k/v/o (and fused in/out)
#: projections of GDN2 / FLA, Qwen3.5 / Qwen3-Next and Kimi-Linear layers, and the MLP projections.
#: Gate/decay projections (GDN2 f/b/w/g_proj, Qwen in_proj_a/b, Kimi f_*/g_*) stay frozen.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_qkvz", "in_proj_z", "out_proj",
                "gate_proj", "up_proj", "down_proj")


class RecipeError(RuntimeError):
    """Bad command-line input; the message names the fix."""


def build_parser(default_model: str = DEFAULT_MODEL, prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, formatter_class=HelpFormatter,
                                description="Fine-tune a delta-rule causal LM (GDN2, Qwen3.5, Kimi-Linear, FLA models, "
                                "...) with rewy-hf's backward. Run with `python` or `accelerate launch`.")
    a = p.add_argument
    a("--model", default=default_model, help="preset (gdn2-tiny, gdn2-small, gdn2-350m, gdn2-1b, gdn2-1b-hybrid, or "
      "a rewy preset such as tiny-qwen3.5), a local directory, or a hub id")
    a("--revision", default=None, help="hub revision (branch, tag or commit)")
    a("--trust-remote-code", action="store_true", help="let transformers run the model repository's own code")
    a("--data", default=None, help="a .txt file, a .jsonl file of {\"text\": ...} records, or a `datasets` name "
      "(needs `datasets`) (default: the corpus shipped with rewy-hf, rewy_hf/training/corpus.txt)")
    a("--data-split", default="train", help="split for a `datasets` name")
    a("--seq-len", type=int, default=512, help="tokens per training sequence")
    a("--batch-size", type=int, default=8, help="sequences per device per micro-step")
    a("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    a("--lr", type=float, default=3e-4, help="peak learning rate")
    a("--min-lr-ratio", type=float, default=0.1, help="final LR as a fraction of --lr")
    a("--warmup-steps", type=int, default=100, help="linear warmup steps (capped at --max-steps)")
    a("--max-steps", type=int, default=1000, help="optimizer steps")
    a("--weight-decay", type=float, default=0.01, help="AdamW weight decay on matrices")
    a("--max-grad-norm", type=float, default=1.0, help="clip gradients to this global norm; 0 = no clipping "
      "(the norm is still logged)")
    a("--mixed-precision", choices=("auto", "no", *MIXED_PRECISION), default="auto",
      help="auto: the accelerate config's setting if launched with one, else bfloat16 on a GPU and none on CPU; "
           "float16 needs a GPU (Accelerate runs no float16 autocast on CPU, so it is refused there)")
    a("--compile", choices=("auto", "on", "off"), default="auto",
      help="torch.compile the model (in place: checkpoints keep their names); auto: on with CUDA, off on CPU, "
           "where compiling costs more than a short run gains")
    a("--gradient-checkpointing", action="store_true",
      help="recompute activations in backward to save memory; compiled, the checkpointed layers compile too "
           "(the run sets dynamo's skip_fwd_side_effects_in_bwd_under_checkpoint; docs/usage.md)")
    a("--context-parallel", action="store_true",
      help="every process trains on the same --batch-size windows, joined into one packed row and split across "
           "the processes (rewy + FLA's context-parallel protocol): sequences batch-size x seq-len tokens long "
           "over N GPUs hold 1/N of the activations each. Needs --core rewy, a model whose token mixers are all "
           "delta-rule layers of fla.models or rewy's GDN2 (e.g. gdn2-1b), and batch-size x seq-len divisible "
           "by the number of processes")
    a("--lora", action="store_true", help="train LoRA adapters only (PEFT)")
    a("--lora-r", type=int, default=16, help="LoRA rank")
    a("--lora-alpha", type=int, default=32, help="LoRA scaling numerator")
    a("--lora-dropout", type=float, default=0.0, help="dropout on the LoRA input")
    a("--lora-targets", default=None, help=f"comma-separated Linear names (default: those of {','.join(LORA_TARGETS)} "
      "present in the model)")
    a("--core", choices=CORES, default="rewy",
      help="rewy: patch_model(backend=--backend) before accelerator.prepare; original: unpatched, the model's own "
           "delta-rule core (needs a GPU)")
    a("--backend", choices=BACKENDS, default="auto",
      help="rewy's backend with --core rewy: auto (the Triton backward on CUDA, packed sequences included; the "
           "torch backend on CPU), torch, or triton (CUDA only)")
    a("--policy", choices=POLICIES, default="recompute", help="what the rewy backward keeps from the forward")
    a("--fallback", choices=FALLBACKS, default="error",
      help="calls rewy cannot serve: raise (error) or run the original core")
    a("--output-dir", default="outputs/finetune", help="checkpoints, metrics.jsonl, loss_curve.png, "
      "dispatch_report.json, final/")
    a("--overwrite-output-dir", action="store_true",
      help="start afresh in an --output-dir that holds an earlier run: delete its checkpoints, metrics and final "
           "model first (other files stay); without it such a directory is refused")
    a("--save-every", type=int, default=500, help="checkpoint every N optimizer steps (0: only at the end)")
    a("--keep-checkpoints", type=int, default=0, help="keep only the newest N checkpoints (0: keep all)")
    a("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
      help="resume from the latest checkpoint in --output-dir, or from the given checkpoint directory")
    a("--stop-after", type=int, default=None, metavar="STEP",
      help="stop after this optimizer step as if interrupted (no final save; the schedule still "
           "follows --max-steps); for testing resume")
    a("--log-every", type=int, default=1, help="print a log line every N steps (metrics.jsonl gets every step)")
    a("--seed", type=int, default=0, help="seed of the weights of a preset, the data order and LoRA")
    a("--no-progress", action="store_true", help="no tqdm progress bar")
    return p


#: integer options and their least value, with what that value means where it is special
_INT_MINIMA = {"seq_len": (1, ""), "batch_size": (1, ""), "grad_accum": (1, ""), "max_steps": (1, ""),
               "log_every": (1, ""), "lora_r": (1, ""), "lora_alpha": (1, ""), "warmup_steps": (0, ""),
               "save_every": (0, "0: only at the end"), "keep_checkpoints": (0, "0: keep all")}
#: float options: (low, low allowed, high, high allowed, what the value is); NaN and infinities never pass
_FLOAT_RANGES = {"lr": (0.0, False, math.inf, False, ""),
                 "min_lr_ratio": (0.0, True, 1.0, True, "the final LR as a fraction of --lr"),
                 "weight_decay": (0.0, True, math.inf, False, ""),
                 "max_grad_norm": (0.0, True, math.inf, False, "0: no clipping"),
                 "lora_dropout": (0.0, True, 1.0, False, "a probability")}


def check_args(args) -> None:
    for name, (least, note) in _INT_MINIMA.items():
        value = getattr(args, name)
        if value < least:
            raise RecipeError(f"{_flag(name)} must be at least {least}{_note(note)}, got {value}")
    for name, bounds in _FLOAT_RANGES.items():
        value = getattr(args, name)
        if not _in_range(value, *bounds[:4]):
            raise RecipeError(f"{_flag(name)} must be {_range_text(*bounds[:4])}{_note(bounds[4])}, got {value}")
    if args.resume is not None and args.overwrite_output_dir:
        raise RecipeError("--overwrite-output-dir deletes the run that --resume would continue; pass one of them")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _note(note: str) -> str:
    return f" ({note})" if note else ""


def _in_range(value: float, lo: float, lo_ok: bool, hi: float, hi_ok: bool) -> bool:
    if not math.isfinite(value):
        return False
    return (value > lo or (lo_ok and value == lo)) and (value < hi or (hi_ok and value == hi))


def _range_text(lo: float, lo_ok: bool, hi: float, hi_ok: bool) -> str:
    """"in [0, 1)" style, or "a finite number > 0" where there is no upper bound."""
    if math.isinf(hi):
        return f"a finite number {'>=' if lo_ok else '>'} {lo:g}"
    return f"in {'[' if lo_ok else '('}{lo:g}, {hi:g}{']' if hi_ok else ')'}"


def compile_choice(choice: str) -> tuple[bool, str]:
    """(compile or not, why), for the run's output."""
    if choice != "auto":
        return choice == "on", f"--compile {choice}"
    if torch.cuda.is_available():
        return True, ("--compile auto: on with CUDA, where a compiled patched ~1 B hybrid trained 1.63-1.64x as "
                      "fast per step as unpatched eager and 1.21-1.28x as fast as unpatched compiled on an H200 "
                      "(docs/performance.md); --compile off to skip the first step's compile")
    return False, "--compile auto: off on CPU"


def accelerate_mixed_precision(choice: str) -> str | None:
    """What Accelerator(mixed_precision=...) takes for the --mixed-precision choice."""
    if choice != "auto":
        return MIXED_PRECISION.get(choice, choice)
    if os.environ.get("ACCELERATE_MIXED_PRECISION"):
        return None   # launched with an accelerate config: it decides
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
