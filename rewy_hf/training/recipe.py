"""The fine-tuning loop behind ``recipes/finetune.py`` and ``recipes/finetune_gdn2.py``.

``main(argv)`` parses the command line, runs, and returns an exit code (2 with a
one-line ``error: ...`` on bad input); ``train(args)`` returns a ``RunResult``.
Order of operations: Accelerator -> claim ``--output-dir`` (writable, locked, no earlier run
unless resuming or overwriting) -> pick and check the resume checkpoint -> data -> model (+ LoRA) ->
``patch_model`` (``--core rewy``) -> ``accelerator.prepare`` -> load the resume state -> loop
(``loop.TrainLoop``) -> ``final/`` -> the dispatch report, the loss plot and the end summary. Everything
that can refuse the command line comes before the data and the model are loaded. With
``--no-progress`` no progress bar is drawn anywhere in the run (``progress``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import checkpoint as ckpt
from . import output_dir
from .context_split import check as check_split
from .data import DataError, pack, read_documents
from .loop import TrainLoop
from .loss_plot import plot_loss
from .metrics import read_metrics
from .model_setup import check_runs_here, cpu_size_warning, load_model_and_tokenizer, lora_targets
from .options import (BUNDLED_CORPUS, DEFAULT_MODEL, RecipeError, accelerate_mixed_precision, build_parser,
                      check_args, compile_choice)
from .progress import bars_off
from .resume import finished, load_training_state, resume_target
from .saving import gather_dispatch, save_final, served_by, write_dispatch_report
from .schedule import build_scheduler
from .summary import RunSummary, summarize


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
    summary: RunSummary | None = None   # on the main process, once the run has finished its steps


# --- the run ----------------------------------------------------------------------------------------

def train(args) -> RunResult:
    started = time.perf_counter()
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
        with _checkpointed_layers_compile(args), bars_off(args.no_progress):
            return _run(args, accelerator, out_dir, started)
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


def _run(args, accelerator, out_dir: Path, started: float) -> RunResult:
    """The run after the output directory is claimed: the resume check, the data and the model, the
    steps, and what the run leaves behind. ``started`` is when ``train`` began, for the wall time."""
    from accelerate.utils import set_seed

    say, world = accelerator.print, accelerator.num_processes
    set_seed(args.seed)
    run_config = {k: getattr(args, k) for k in vars(args)} | {"data": args.data or str(BUNDLED_CORPUS),
                                                                "world_size": world}
    check_split(args, world, on_cpu=accelerator.device.type == "cpu")
    # Resume target before any heavy work: a bad --resume should fail at once.
    target = _on_main(accelerator, lambda: resume_target(args, out_dir, run_config))
    resume_from, state = target if target is not None else (None, None)
    if state is not None and finished(out_dir, state["step"], args.max_steps):
        say(f"the run in {out_dir} is complete: {resume_from.name} is at step {state['step']} of "
            f"--max-steps {args.max_steps} and {out_dir / 'final'} exists; nothing to resume")
        adapter = out_dir / "final-adapter" if args.lora else None
        return RunResult(out_dir, state["step"], final_model_dir=out_dir / "final", adapter_dir=adapter)

    windows, model, tokenizer, source = _data_and_model(args)
    model = _adapt_model(args, model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    if accelerator.is_main_process and (warning := cpu_size_warning(model, args, accelerator.device)):
        print(warning, file=sys.stderr, flush=True)
    patch_report = _patch(args, model)
    compiled, compile_why = compile_choice(args.compile)
    if compiled:
        # nn.Module.compile compiles in place: the state dict, PEFT wrapping and checkpoints keep their names.
        model.compile()
    model, optimizer, scheduler = accelerator.prepare(model, *_optimizer_and_schedule(args, model))

    start_step, tokens_seen = 0, 0
    if resume_from is not None:
        load_training_state(accelerator, resume_from)
        start_step, tokens_seen = state["step"], state["tokens_seen"]
        say(f"resumed from {resume_from} at step {start_step}")
    if accelerator.is_main_process:
        _start_outputs(args, out_dir, run_config | {
            "model_source": source, "trainable_params": trainable, "total_params": total,
            "num_windows": windows.shape[0], "tokenizer": type(tokenizer).__name__,
            "patch_report": patch_report.to_dict() if patch_report else None})
        if patch_report is not None:
            say(str(patch_report))
    accelerator.wait_for_everyone()

    result = RunResult(out_dir, start_step, trainable_params=trainable, total_params=total)
    loop = TrainLoop(args, accelerator, model, optimizer, scheduler, windows, tokenizer, out_dir, run_config,
                     patch_report, result)
    say(f"training {type(accelerator.unwrap_model(model)).__name__} ({trainable:,} trainable / {total:,} params) on "
        f"{windows.shape[0]} windows of {args.seq_len + 1} tokens, {world} process(es), device {accelerator.device}, "
        f"mixed precision {accelerator.mixed_precision}, core {args.core}, "
        f"{loop.split.describe() + ', ' if loop.split else ''}torch.compile "
        f"{'on' if compiled else 'off'} ({compile_why})"
        + (f", backend {args.backend}" if args.core == "rewy" else ""))
    end_step = args.max_steps if args.stop_after is None else min(args.max_steps, args.stop_after)
    loop.run(start_step, end_step, tokens_seen, resumed=resume_from is not None)

    if result.final_step >= args.max_steps:
        result.final_model_dir, result.adapter_dir = save_final(accelerator, model, tokenizer, out_dir, args.lora)
    weights = str(next(accelerator.unwrap_model(model).parameters()).dtype).removeprefix("torch.")
    _finish(args, accelerator, result, loop, patch_report, _plot_title(args, accelerator, out_dir, compiled, weights),
            started)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return result


# --- the steps of the run -----------------------------------------------------------------------------

def _data_and_model(args):
    """(windows, model, tokenizer, where the model came from): the documents of --data packed into
    --seq-len + 1 token windows by the model's tokenizer."""
    try:
        docs = read_documents(args.data or str(BUNDLED_CORPUS), split=args.data_split, progress=not args.no_progress)
    except DataError as exc:
        raise RecipeError(str(exc)) from None
    model, tokenizer, source = load_model_and_tokenizer(args)
    try:
        windows = pack(docs, tokenizer, args.seq_len)
    except DataError as exc:
        raise RecipeError(str(exc)) from None
    return windows, model, tokenizer, source


def _adapt_model(args, model):
    """The model as the run trains it: activation checkpointing and LoRA adapters where asked for."""
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable()
    if args.lora:
        from peft import LoraConfig, get_peft_model

        targets = lora_targets(model, args.lora_targets)
        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha,
                                                 lora_dropout=args.lora_dropout, target_modules=targets,
                                                 task_type="CAUSAL_LM"))
    return model


def _patch(args, model):
    """rewy's core in the model's delta-rule layers (--core rewy); its report, or None (--core original).
    The dispatch counts start from zero either way."""
    import rewy_hf

    rewy_hf.reset_dispatch_report()
    if args.core != "rewy":
        return None
    return rewy_hf.patch_model(model, backend=args.backend, policy=args.policy, fallback=args.fallback)


def _optimizer_and_schedule(args, model):
    """AdamW (weight decay on matrices only) and the warmup-cosine schedule."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 and not getattr(p, "_no_weight_decay", False) else no_decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                                  fused=True)   # one kernel over all parameters (CUDA and CPU)
    scheduler = build_scheduler(optimizer, min(args.warmup_steps, args.max_steps), args.max_steps, args.min_lr_ratio)
    return optimizer, scheduler


def _start_outputs(args, out_dir: Path, config: dict) -> None:
    """Main process: the earlier run's files gone (--overwrite-output-dir), run_config.json written."""
    if args.overwrite_output_dir:
        # Cleared only now, so a run that fails to start leaves the earlier run in place.
        output_dir.clear_previous(out_dir)
    (out_dir / "run_config.json").write_text(json.dumps(config, indent=1) + "\n")


def _plot_title(args, accelerator, out_dir: Path, compiled: bool, weights: str) -> str:
    """The loss plot's title: the run's name (its --output-dir) and model, then its main settings
    (``weights``: the model's parameter dtype, what a run without mixed precision computes in)."""
    shape = f"batch {args.batch_size} x seq-len {args.seq_len}"
    if args.grad_accum > 1:
        shape += f" x {args.grad_accum} micro-steps"
    if accelerator.num_processes > 1:
        shape += f" x {accelerator.num_processes} processes"
    settings = [f"{args.max_steps} steps", shape,
                f"lr {args.lr:g} (warmup {args.warmup_steps}, cosine to {args.min_lr_ratio:g}x)",
                f"{weights} weights" + ("" if accelerator.mixed_precision == "no"
                                        else f", {accelerator.mixed_precision} autocast"),
                f"patched (rewy, backend {args.backend})" if args.core == "rewy" else "unpatched (--core original)",
                f"compile {'on' if compiled else 'off'}"]
    settings += [name for on, name in ((args.lora, f"LoRA r {args.lora_r}"),
                                       (args.gradient_checkpointing, "gradient checkpointing"),
                                       (args.context_parallel, "context parallel")) if on]
    return f"{out_dir.resolve().name}: {args.model}\n" + ", ".join(settings)


def _finish(args, accelerator, result: RunResult, loop: TrainLoop, patch_report, title: str, started: float) -> None:
    """The dispatch report, the loss plot, the end summary (also stored in run_config.json) and the list
    of what the run wrote. All processes take part in the gather; the main one writes and prints."""
    per_rank = gather_dispatch()
    if not accelerator.is_main_process:
        return
    out_dir, say = result.output_dir, accelerator.print
    write_dispatch_report(out_dir, patch_report, per_rank)
    records = read_metrics(out_dir / "metrics.jsonl")
    renderer = plot_loss(records, out_dir / "loss_curve.png", title) if records else None
    result.summary = summarize(records, loop.clock, time.perf_counter() - started, accelerator.device,
                               accelerator.num_processes)
    config_file = out_dir / "run_config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"summary": result.summary.to_dict()},
                                      indent=1) + "\n")
    say(f"\nsummary of the run in {out_dir.resolve()}:")
    for line in result.summary.lines():
        say(line)
    say(f"outputs in {out_dir.resolve()}:")
    say(f"  metrics:          {out_dir / 'metrics.jsonl'}")
    if renderer:
        say(f"  loss curve:       {out_dir / 'loss_curve.png'} ({renderer})")
    say(f"  dispatch report:  {out_dir / 'dispatch_report.json'}")
    if per_rank[0].get("ops"):
        say(f"  delta-rule cores: {served_by(per_rank[0])} (rank 0)")
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


def main(argv: list[str] | None = None, default_model: str = DEFAULT_MODEL, prog: str | None = None) -> int:
    args = build_parser(default_model, prog).parse_args(argv)
    try:
        train(args)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
