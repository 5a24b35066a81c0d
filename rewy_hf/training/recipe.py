"""The fine-tuning loop behind ``recipes/finetune.py`` and ``recipes/finetune_gdn2.py``.

``main(argv)`` parses the command line, runs, and returns an exit code (2 with a
one-line ``error: ...`` on bad input); ``train(args)`` returns a ``RunResult``.
Order of operations: Accelerator -> claim ``--output-dir`` (writable, locked, no earlier run
unless resuming or overwriting) -> pick and check the resume checkpoint -> data -> model (+ LoRA) ->
``patch_model`` (``--core rewy``) -> ``accelerator.prepare`` -> load the resume state -> loop. Everything
that can refuse the command line comes before the data and the model are loaded.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..models.causal_masks import causal_only_masks
from . import checkpoint as ckpt
from . import output_dir
from .data import DataError, WindowSampler, pack, read_documents
from .context_split import check as check_split
from .context_split import row_split
from .metrics import MetricsWriter, plot_loss, read_metrics
from .model_setup import check_runs_here, cpu_size_warning, load_model_and_tokenizer, lora_targets
from .options import (BUNDLED_CORPUS, DEFAULT_MODEL, RecipeError, accelerate_mixed_precision, build_parser,
                      check_args, compile_choice)
from .schedule import build_scheduler


@dataclass
class RunResult:
    output_dir: Path
    final_step: int
    losses: list[float] = field(default_factory=list)   # this invocation's steps only
    checkpoints: list[Path] = field(default_factory=list)
    final_model_dir: Path | None = None
    adapter_dir: Path | None = None
    trainable_params: int = 0
    total_params: int = 0


# --- the run ----------------------------------------------------------------------------------------

def train(args) -> RunResult:
    check_args(args)
    from rewy_hf.cpu_triton import enable_cpu_interpreter

    enable_cpu_interpreter()   # no-op with CUDA; must precede the first `import fla`
    warnings.filterwarnings("ignore", message="Triton is not supported on current platform")

    from accelerate import Accelerator

    if args.core == "original" and not torch.cuda.is_available():
        raise RecipeError("--core original runs FLA's own Triton kernels, which need a CUDA GPU; on CPU use "
                          "--core rewy (the default), which runs rewy's kernels")
    if args.backend == "triton" and not torch.cuda.is_available():
        raise RecipeError("--backend triton needs a CUDA GPU; on CPU use --backend auto (the default) or torch")

    # Several processes on a machine without CUDA (torchrun, or accelerate launch --cpu): Accelerate
    # forms their process group (gloo) only when told the run is on the CPU; otherwise each process
    # would run alone, as the main one.
    launched_on_cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    accelerator = Accelerator(mixed_precision=accelerate_mixed_precision(args.mixed_precision),
                              step_scheduler_with_optimizer=False, cpu=launched_on_cpu)
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        # Accelerate sets up float16 autocast and loss scaling only off the CPU: the run would train in
        # float32 while its log says fp16.
        asked = ("--mixed-precision float16" if args.mixed_precision == "float16"
                 else "the accelerate config's mixed_precision fp16")
        raise RecipeError(f"{asked} on CPU: Accelerate runs no float16 autocast (nor loss scaling) on CPU, so "
                          "the run would train in float32 under an fp16 label; use --mixed-precision bfloat16 "
                          "(CPU autocast) or --mixed-precision no, or run on a CUDA GPU")
    check_runs_here(args, accelerator.device)
    out_dir = Path(args.output_dir)
    # Before any heavy work: an unwritable or busy --output-dir, or an earlier run in it, fails at once.
    lock = _on_main(accelerator, lambda: output_dir.claim(out_dir, fresh=args.resume is None,
                                                          overwrite=args.overwrite_output_dir))
    try:
        with _checkpointed_layers_compile(args):
            return _run(args, accelerator, out_dir)
    finally:
        if accelerator.is_main_process:
            output_dir.release_lock(lock)


def _checkpointed_layers_compile(args):
    """With --gradient-checkpointing, dynamo compiles a checkpointed patched layer instead of running
    it eagerly: the only forward side effect there is the patched layer's push onto rewy's
    active-layer stack, which the backward's rerun need not replay (its region already holds rewy's
    op; docs/usage.md). A dynamo setting, set for the run only."""
    config = torch._dynamo.config
    if not (args.gradient_checkpointing and args.core == "rewy"
            and hasattr(config, "skip_fwd_side_effects_in_bwd_under_checkpoint")):
        return contextlib.nullcontext()
    return config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)


def _on_main(accelerator, fn):
    """``fn()`` run by the main process only, its result sent to every process; a RecipeError there is
    raised on every process, so no process goes on to wait for a main process that has given up."""
    from accelerate.utils import broadcast_object_list

    value, error = None, None
    if accelerator.is_main_process:
        try:
            value = fn()
        except RecipeError as exc:
            error = str(exc)
    value, error = broadcast_object_list([value, error])
    if error is not None:
        raise RecipeError(error)
    return value


def _resume_target(args, out_dir: Path, run_config: dict) -> tuple[Path, dict] | None:
    """(checkpoint, its trainer state) for --resume, after checking it is sound and of this run."""
    if args.resume is None:
        return None
    if args.resume == "latest":
        resume_from = _latest_sound_checkpoint(out_dir)
    else:
        resume_from = Path(args.resume)
        if not (resume_from / ckpt.STATE_FILE).is_file():
            raise RecipeError(f"--resume {resume_from}: not a complete checkpoint (no {ckpt.STATE_FILE})")
        problem = ckpt.damage(resume_from)
        if problem is not None:
            raise RecipeError(f"--resume {resume_from}: {problem[0]} is damaged ({problem[1]}); "
                              + _earlier_checkpoint_hint(resume_from))
    state = ckpt.read_state(resume_from)
    diff = ckpt.identity_diff(state["config"], run_config)
    if diff:
        raise RecipeError(f"--resume {resume_from}: it belongs to a run with other settings (checkpoint vs now): "
                          + ", ".join(diff) + "; resume with the checkpoint's settings, or start a new run in "
                          "another --output-dir")
    return resume_from, state


def _latest_sound_checkpoint(out_dir: Path) -> Path:
    """The newest complete checkpoint that is not damaged; each damaged newer one is skipped with a warning."""
    found = ckpt.list_checkpoints(out_dir)
    if not found:
        if output_dir.previous_outputs(out_dir):
            # A fresh run is refused there too (output_dir.claim): name the one way forward.
            raise RecipeError(f"--resume: no complete checkpoint in {out_dir}: the run there stopped before its "
                              "first save, so there is nothing to resume; start it again with "
                              "--overwrite-output-dir in place of --resume, or pass another --output-dir")
        raise RecipeError(f"--resume: no complete checkpoint in {out_dir}; run without --resume to start fresh")
    damaged = []
    for _, path in reversed(found):
        problem = ckpt.damage(path)
        if problem is None:
            return path
        damaged.append(f"{problem[0]} ({problem[1]})")
        warnings.warn(f"--resume: {problem[0]} is damaged ({problem[1]}); skipping {path.name} for the "
                      "previous checkpoint", RuntimeWarning, stacklevel=2)
    raise RecipeError(f"--resume: every checkpoint in {out_dir} is damaged: " + "; ".join(damaged)
                      + "; start afresh with --overwrite-output-dir")


def _earlier_checkpoint_hint(checkpoint: Path) -> str:
    previous = ckpt.previous_sound(checkpoint)
    if previous is None:
        return f"there is no earlier complete checkpoint in {checkpoint.parent}; start afresh"
    return f"resume from the previous complete checkpoint instead: --resume {previous}"


def _finished(out_dir: Path, step: int, max_steps: int) -> bool:
    return step >= max_steps and (out_dir / "final").is_dir()


def _run(args, accelerator, out_dir: Path) -> RunResult:
    from accelerate.utils import DistributedType, set_seed

    import rewy_hf

    main_proc = accelerator.is_main_process
    say = accelerator.print
    data_spec = args.data or str(BUNDLED_CORPUS)
    set_seed(args.seed)
    world = accelerator.num_processes
    run_config = {k: getattr(args, k) for k in vars(args)} | {"data": data_spec, "world_size": world}

    check_split(args, world, on_cpu=accelerator.device.type == "cpu")
    # Resume target before any heavy work: a bad --resume should fail at once.
    target = _on_main(accelerator, lambda: _resume_target(args, out_dir, run_config))
    resume_from, state = target if target is not None else (None, None)
    if state is not None and _finished(out_dir, state["step"], args.max_steps):
        # Resuming would retrain nothing and only rewrite final/, the plot and the dispatch report.
        say(f"the run in {out_dir} is complete: {resume_from.name} is at step {state['step']} of "
            f"--max-steps {args.max_steps} and {out_dir / 'final'} exists; nothing to resume")
        adapter = out_dir / "final-adapter" if args.lora else None
        return RunResult(out_dir, state["step"], final_model_dir=out_dir / "final", adapter_dir=adapter)

    try:
        docs = read_documents(data_spec, split=args.data_split)
    except DataError as exc:
        raise RecipeError(str(exc)) from None
    model, tokenizer, source = load_model_and_tokenizer(args)
    try:
        windows = pack(docs, tokenizer, args.seq_len)
    except DataError as exc:
        raise RecipeError(str(exc)) from None
    del docs

    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if args.lora:
        from peft import LoraConfig, get_peft_model

        targets = lora_targets(model, args.lora_targets)
        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha,
                                                 lora_dropout=args.lora_dropout, target_modules=targets,
                                                 task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    if main_proc and (warning := cpu_size_warning(model, args, accelerator.device)):
        print(warning, file=sys.stderr, flush=True)

    patch_report = None
    rewy_hf.reset_dispatch_report()
    if args.core == "rewy":
        patch_report = rewy_hf.patch_model(model, backend=args.backend, policy=args.policy, fallback=args.fallback)

    compiled, compile_why = compile_choice(args.compile)
    if compiled:
        # nn.Module.compile compiles in place: the state dict, PEFT wrapping and checkpoints keep their names.
        model.compile()

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 and not getattr(p, "_no_weight_decay", False) else no_decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                                  fused=True)   # one kernel over all parameters (CUDA and CPU)
    scheduler = build_scheduler(optimizer, min(args.warmup_steps, args.max_steps), args.max_steps, args.min_lr_ratio)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    start_step, tokens_seen = 0, 0
    if resume_from is not None:
        _load_training_state(accelerator, resume_from)
        start_step, tokens_seen = state["step"], state["tokens_seen"]
        say(f"resumed from {resume_from} at step {start_step}")

    if main_proc:
        if args.overwrite_output_dir:
            # Cleared only now, so a run that fails to start leaves the earlier run in place.
            output_dir.clear_previous(out_dir)
        (out_dir / "run_config.json").write_text(json.dumps(
            run_config | {"model_source": source, "trainable_params": trainable, "total_params": total,
                          "num_windows": windows.shape[0], "tokenizer": type(tokenizer).__name__,
                          "patch_report": patch_report.to_dict() if patch_report else None}, indent=1) + "\n")
        if patch_report is not None:
            say(str(patch_report))
    accelerator.wait_for_everyone()
    metrics = MetricsWriter(out_dir / "metrics.jsonl", resume_step=start_step if resume_from else None) \
        if main_proc else None

    split = row_split(args, world, accelerator.process_index, accelerator.device)
    # Context parallel: every process reads the same windows, of which it trains its slice.
    readers, reader = (1, 0) if split else (world, accelerator.process_index)
    sampler = WindowSampler(windows.shape[0], args.batch_size, readers, reader, args.seed)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * readers
    result = RunResult(out_dir, start_step, trainable_params=trainable, total_params=total)
    say(f"training {type(accelerator.unwrap_model(model)).__name__} ({trainable:,} trainable / {total:,} params) on "
        f"{windows.shape[0]} windows of {args.seq_len + 1} tokens, {world} process(es), device {accelerator.device}, "
        f"mixed precision {accelerator.mixed_precision}, core {args.core}, "
        f"{split.describe() + ', ' if split else ''}torch.compile "
        f"{'on' if compiled else 'off'} ({compile_why})"
        + (f", backend {args.backend}" if args.core == "rewy" else ""))

    def save(step: int) -> None:
        partial, final = ckpt.partial_path(out_dir, step), ckpt.final_path(out_dir, step)
        if main_proc:
            shutil.rmtree(partial, ignore_errors=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(partial / ckpt.TRAINING_STATE_DIR), safe_serialization=True)
        fsdp = accelerator.distributed_type == DistributedType.FSDP
        state_dict = accelerator.get_state_dict(model) if fsdp else None
        accelerator.unwrap_model(model).save_pretrained(partial, state_dict=state_dict, is_main_process=main_proc,
                                                        safe_serialization=True)
        per_rank = _gather_dispatch()
        if main_proc:
            tokenizer.save_pretrained(partial)
            ckpt.write_state(partial, {"step": step, "tokens_seen": tokens_seen, "config": run_config})
            ckpt.commit(partial, final)
            ckpt.prune(out_dir, args.keep_checkpoints)
            _write_dispatch_report(out_dir, patch_report, per_rank)
        accelerator.wait_for_everyone()
        result.checkpoints.append(final)

    end_step = args.max_steps if args.stop_after is None else min(args.max_steps, args.stop_after)
    bar = None
    if not args.no_progress and accelerator.is_local_main_process and end_step > start_step:
        from tqdm.auto import tqdm

        bar = tqdm(total=args.max_steps, initial=start_step, desc="train", dynamic_ncols=True)

    # Windows are whole unpadded rows: a hybrid's attention then needs no mask, compiled or not.
    masks = causal_only_masks(accelerator.unwrap_model(model))
    no_cache = _no_cache_kwargs(accelerator.unwrap_model(model))
    model.train()
    for step in range(start_step, end_step):
        t0 = time.perf_counter()
        lr = optimizer.param_groups[0]["lr"]
        loss_sum = torch.zeros((), device=accelerator.device)
        for micro in range(args.grad_accum):
            batch = windows[sampler.indices(step * args.grad_accum + micro)].to(accelerator.device)
            ctx = accelerator.no_sync(model) if micro < args.grad_accum - 1 else _null()
            # Context parallel: the backward too runs in the split, as checkpointed layers rerun forwards there.
            with ctx, (split.active(model) if split else _null()):
                if split:
                    loss = split.loss(model, batch, masks)
                else:
                    logits = model(input_ids=batch[:, :-1], attention_mask=masks, **no_cache).logits
                    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
                accelerator.backward(loss / args.grad_accum)
            loss_sum += loss.detach()
        clip = args.max_grad_norm if args.max_grad_norm > 0 else float("inf")
        grad_norm = accelerator.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step_loss = accelerator.reduce(loss_sum / args.grad_accum, reduction="mean").item()
        grad_norm = float(grad_norm)
        if accelerator.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        tokens_seen += tokens_per_step
        done = step + 1
        record = {"step": done, "loss": step_loss, "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_s": tokens_per_step / dt, "step_time_s": dt, "tokens_seen": tokens_seen,
                  "epoch": round(sampler.epoch((done) * args.grad_accum), 4)}
        if accelerator.device.type == "cuda":
            record["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        result.losses.append(step_loss)
        result.final_step = done
        if metrics is not None:
            metrics.write(record)
        if not math.isfinite(step_loss):
            raise RuntimeError(f"loss is {step_loss} at step {done}; lower --lr or check the data")
        if bar is not None:
            bar.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", step_s=f"{dt:.2f}")
            bar.update(1)
        elif done % args.log_every == 0 or done == end_step:
            say(f"step {done}/{args.max_steps} loss {step_loss:.4f} lr {lr:.3g} grad_norm {grad_norm:.3g} "
                f"tok/s {record['tokens_per_s']:.0f} step_s {dt:.2f}")
        if (args.save_every and done % args.save_every == 0) or done == args.max_steps:
            save(done)
    if bar is not None:
        bar.close()

    if result.final_step >= args.max_steps:
        result.final_model_dir, result.adapter_dir = _save_final(accelerator, model, tokenizer, out_dir, args.lora)
    per_rank = _gather_dispatch()
    if main_proc:
        _write_dispatch_report(out_dir, patch_report, per_rank)
        records = read_metrics(out_dir / "metrics.jsonl")
        renderer = plot_loss(records, out_dir / "loss_curve.png") if records else None
        say(f"\noutputs in {out_dir.resolve()}:")
        say(f"  metrics:          {out_dir / 'metrics.jsonl'}")
        if renderer:
            say(f"  loss curve:       {out_dir / 'loss_curve.png'} ({renderer})")
        say(f"  dispatch report:  {out_dir / 'dispatch_report.json'}")
        if per_rank[0].get("ops"):
            say(f"  delta-rule cores: {_served_by(per_rank[0])} (rank 0)")
            on_torch = any("torch" in c.get("backends", {}) for c in per_rank[0]["ops"].values())
            if accelerator.device.type == "cuda" and on_torch:
                say("  warning: some delta-rule calls ran rewy's torch backend on the GPU, which is slower than "
                    "the Triton kernels (--backend auto picks it for float64 inputs and key head dims above 256; "
                    "--backend triton refuses such calls with the reason)")
        for c in ckpt.list_checkpoints(out_dir):
            say(f"  checkpoint:       {c[1]}")
        if result.final_model_dir:
            say(f"  final model:      {result.final_model_dir}")
        if result.adapter_dir:
            say(f"  LoRA adapter:     {result.adapter_dir}")
        if result.final_step < args.max_steps:
            say(f"  stopped at step {result.final_step} of {args.max_steps}; continue with --resume")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return result


def _load_training_state(accelerator, checkpoint: Path) -> None:
    """accelerator.load_state, with a failure (damage the cheap check in ``ckpt.damage`` cannot see, such as
    flipped bytes) reported as the checkpoint's, not as a bare library error."""
    try:
        accelerator.load_state(str(checkpoint / ckpt.TRAINING_STATE_DIR))
    except Exception as exc:   # whatever the loaders raise on a bad file: torch, safetensors, pickle
        raise RecipeError(f"--resume {checkpoint}: cannot load {checkpoint / ckpt.TRAINING_STATE_DIR} "
                          f"({type(exc).__name__}: {exc}); " + _earlier_checkpoint_hint(checkpoint)) from exc


def _no_cache_kwargs(model) -> dict:
    """``use_cache=False`` for a forward that takes it: transformers' models build a cache when their
    config says use_cache, state writes a training step never reads (a model of remote code may not
    take the argument at all)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {"use_cache": False} if "use_cache" in inspect.signature(base.forward).parameters else {}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _save_final(accelerator, model, tokenizer, out_dir: Path, lora: bool):
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


def _gather_dispatch() -> list:
    """Every rank's own dispatch counts (a collective: all ranks call it). Each process
    patches and dispatches on its own, so one rank silently running the original
    backward would not show in rank 0's counts."""
    from accelerate.utils import gather_object

    import rewy_hf

    return gather_object([rewy_hf.dispatch_report()])


def _served_by(dispatch: dict) -> str:
    """Which backend served each op's forward calls, e.g. ``gated_delta_rule: triton 600``: a GPU run
    whose cores ran the torch backend shows it here."""
    return "; ".join(f"{op}: " + ", ".join(f"{b} {n}" for b, n in sorted(c.get("backends", {}).items()))
                     for op, c in sorted(dispatch["ops"].items()))


def _write_dispatch_report(out_dir: Path, patch_report, per_rank: list) -> None:
    (out_dir / "dispatch_report.json").write_text(json.dumps(
        {"patch_report": patch_report.to_dict() if patch_report else None,
         "dispatch": per_rank[0], "dispatch_per_rank": per_rank}, indent=1) + "\n")


def main(argv: list[str] | None = None, default_model: str = DEFAULT_MODEL, prog: str | None = None) -> int:
    args = build_parser(default_model, prog).parse_args(argv)
    try:
        train(args)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
