"""What a recipe run writes through Accelerate: its checkpoints, its final model (and LoRA adapter),
and the dispatch report that goes with each of them.

Every function here is a collective: all processes call it, the main one writes the shared files.
Directories are written as ``.NAME.partial`` and renamed when complete (``checkpoint.commit``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from . import checkpoint as ckpt


def save_checkpoint(accelerator, model, tokenizer, out_dir: Path, step: int, trainer_state: dict,
                    keep: int, patch_report) -> Path:
    """``checkpoint-<step>/``: the training state for --resume, the model as a ``save_pretrained`` directory,
    the tokenizer and ``trainer_state``; then older checkpoints beyond ``keep`` are pruned (0 keeps all)
    and the dispatch report is rewritten. Returns the checkpoint's path."""
    from accelerate.utils import DistributedType

    main_proc = accelerator.is_main_process
    partial, final = ckpt.partial_path(out_dir, step), ckpt.final_path(out_dir, step)
    if main_proc:
        shutil.rmtree(partial, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial / ckpt.TRAINING_STATE_DIR), safe_serialization=True)
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    state_dict = accelerator.get_state_dict(model) if fsdp else None
    accelerator.unwrap_model(model).save_pretrained(partial, state_dict=state_dict, is_main_process=main_proc,
                                                    safe_serialization=True)
    per_rank = gather_dispatch()
    if main_proc:
        tokenizer.save_pretrained(partial)
        ckpt.write_state(partial, trainer_state)
        ckpt.commit(partial, final)
        ckpt.prune(out_dir, keep)
        write_dispatch_report(out_dir, patch_report, per_rank)
    accelerator.wait_for_everyone()
    return final


def save_final(accelerator, model, tokenizer, out_dir: Path, lora: bool) -> tuple[Path, Path | None]:
    """``final/``: the full model (LoRA merged in), loadable with AutoModelForCausalLM; ``final-adapter/``
    for LoRA runs. Written atomically like checkpoints."""
    from accelerate.utils import DistributedType

    main_proc = accelerator.is_main_process
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    state_dict = accelerator.get_state_dict(model) if fsdp else None
    unwrapped = accelerator.unwrap_model(model)
    final, adapter = out_dir / "final", (out_dir / "final-adapter" if lora else None)
    if main_proc:
        if lora:
            part = out_dir / ".final-adapter.partial"
            shutil.rmtree(part, ignore_errors=True)
            unwrapped.save_pretrained(part, state_dict=state_dict, safe_serialization=True)
            tokenizer.save_pretrained(part)
            ckpt.commit(part, adapter)
            if state_dict is not None:
                unwrapped.load_state_dict(state_dict, strict=False)
            unwrapped = unwrapped.merge_and_unload()
            state_dict = None
        part = out_dir / ".final.partial"
        shutil.rmtree(part, ignore_errors=True)
        unwrapped.save_pretrained(part, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(part)
        ckpt.commit(part, final)
    accelerator.wait_for_everyone()
    return final, adapter


def gather_dispatch() -> list:
    """Every rank's own dispatch counts (a collective: all ranks call it). Each process
    patches and dispatches on its own, so one rank silently running the original
    backward would not show in rank 0's counts."""
    from accelerate.utils import gather_object

    import rewy_hf

    return gather_object([rewy_hf.dispatch_report()])


def served_by(dispatch: dict) -> str:
    """Which backend served each op's forward calls, e.g. ``gated_delta_rule: triton 600``: a GPU run
    whose cores ran the torch backend shows it here."""
    return "; ".join(f"{op}: " + ", ".join(f"{b} {n}" for b, n in sorted(c.get("backends", {}).items()))
                     for op, c in sorted(dispatch["ops"].items()))


def write_dispatch_report(out_dir: Path, patch_report, per_rank: list) -> None:
    (out_dir / "dispatch_report.json").write_text(json.dumps(
        {"patch_report": patch_report.to_dict() if patch_report else None,
         "dispatch": per_rank[0], "dispatch_per_rank": per_rank}, indent=1) + "\n")
