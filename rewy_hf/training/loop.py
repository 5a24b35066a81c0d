"""The recipe's training steps: one optimizer step over ``--grad-accum`` micro-batches, its metrics
record, the progress bar or log line, and the checkpoints on the way.

``TrainLoop`` gets everything after ``accelerator.prepare``; ``run(start, end, ...)`` trains steps
``start+1 .. end``, filling in the run's ``RunResult`` (``losses``, ``final_step``, ``checkpoints``)
as it goes, and its ``clock`` keeps their time and tokens for the end summary.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from pathlib import Path

import torch

from ..models.causal_masks import causal_only_masks
from .context_split import row_split
from .data import WindowSampler
from .metrics import MetricsWriter
from .saving import save_checkpoint
from .summary import StepClock


def no_cache_kwargs(model) -> dict:
    """``use_cache=False`` for a forward that takes it: transformers' models build a cache when their
    config says use_cache, state writes a training step never reads (a model of remote code may not
    take the argument at all)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {"use_cache": False} if "use_cache" in inspect.signature(base.forward).parameters else {}


class TrainLoop:
    """The prepared model, optimizer and schedule, the data, and where the run writes."""

    def __init__(self, args, accelerator, model, optimizer, scheduler, windows: torch.Tensor, tokenizer,
                 out_dir: Path, run_config: dict, patch_report, result):
        self.args, self.accelerator = args, accelerator
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.windows, self.tokenizer = windows, tokenizer
        self.out_dir, self.run_config, self.patch_report, self.result = out_dir, run_config, patch_report, result
        world = accelerator.num_processes
        self.split = row_split(args, world, accelerator.process_index, accelerator.device)
        # Context parallel: every process reads the same windows, of which it trains its slice.
        readers, reader = (1, 0) if self.split else (world, accelerator.process_index)
        self.sampler = WindowSampler(windows.shape[0], args.batch_size, readers, reader, args.seed)
        self.tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * readers
        # Windows are whole unpadded rows: a hybrid's attention then needs no mask, compiled or not.
        self.masks = causal_only_masks(accelerator.unwrap_model(model))
        self.no_cache = no_cache_kwargs(accelerator.unwrap_model(model))
        self.clock = StepClock()
        self.tokens_seen = 0

    def run(self, start_step: int, end_step: int, tokens_seen: int, resumed: bool) -> None:
        """Steps ``start_step+1 .. end_step``, each logged to metrics.jsonl (main process; a resumed run's
        file is first cut back to ``start_step``) and shown on the progress bar or in a log line; a
        checkpoint every --save-every steps and at --max-steps."""
        args, accelerator = self.args, self.accelerator
        self.tokens_seen = tokens_seen
        metrics = MetricsWriter(self.out_dir / "metrics.jsonl", resume_step=start_step if resumed else None) \
            if accelerator.is_main_process else None
        bar = None
        if not args.no_progress and accelerator.is_local_main_process and end_step > start_step:
            from tqdm.auto import tqdm

            bar = tqdm(total=args.max_steps, initial=start_step, desc="train", dynamic_ncols=True)
        self.model.train()
        for step in range(start_step, end_step):
            record = self.step(step)
            done = record["step"]
            self.result.losses.append(record["loss"])
            self.result.final_step = done
            if metrics is not None:
                metrics.write(record)
            if not math.isfinite(record["loss"]):
                raise RuntimeError(f"loss is {record['loss']} at step {done}; lower --lr or check the data")
            self._show(bar, record, end_step)
            if (args.save_every and done % args.save_every == 0) or done == args.max_steps:
                self.save(done)
        if bar is not None:
            bar.close()

    def step(self, step: int) -> dict:
        """Optimizer step ``step + 1``: its micro-batches' forward and backward, the clip, the update; returns
        its metrics record."""
        args, accelerator, model = self.args, self.accelerator, self.model
        t0 = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]
        loss_sum = torch.zeros((), device=accelerator.device)
        for micro in range(args.grad_accum):
            batch = self.windows[self.sampler.indices(step * args.grad_accum + micro)].to(accelerator.device)
            ctx = accelerator.no_sync(model) if micro < args.grad_accum - 1 else contextlib.nullcontext()
            # Context parallel: the backward too runs in the split, as checkpointed layers rerun forwards there.
            with ctx, (self.split.active(model) if self.split else contextlib.nullcontext()):
                loss = self._loss(batch)
                accelerator.backward(loss / args.grad_accum)
            loss_sum += loss.detach()
        clip = args.max_grad_norm if args.max_grad_norm > 0 else float("inf")
        grad_norm = accelerator.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        step_loss = accelerator.reduce(loss_sum / args.grad_accum, reduction="mean").item()
        grad_norm = float(grad_norm)
        if accelerator.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        self.tokens_seen += self.tokens_per_step
        done = step + 1
        self.clock.add(done, dt, self.tokens_per_step)
        record = {"step": done, "loss": step_loss, "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_s": self.tokens_per_step / dt, "step_time_s": dt, "tokens_seen": self.tokens_seen,
                  "epoch": round(self.sampler.epoch(done * args.grad_accum), 4)}
        if accelerator.device.type == "cuda":
            record["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        return record

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        if self.split:
            return self.split.loss(self.model, batch, self.masks)
        logits = self.model(input_ids=batch[:, :-1], attention_mask=self.masks, **self.no_cache).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())

    def _show(self, bar, record: dict, end_step: int) -> None:
        done, loss, dt = record["step"], record["loss"], record["step_time_s"]
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", step_s=f"{dt:.2f}")
            bar.update(1)
        elif done % self.args.log_every == 0 or done == end_step:
            self.accelerator.print(
                f"step {done}/{self.args.max_steps} loss {loss:.4f} lr {record['lr']:.3g} grad_norm "
                f"{record['grad_norm']:.3g} tok/s {record['tokens_per_s']:.0f} step_s {dt:.2f}")

    def save(self, step: int) -> None:
        trainer_state = {"step": step, "tokens_seen": self.tokens_seen, "config": self.run_config}
        self.result.checkpoints.append(save_checkpoint(
            self.accelerator, self.model, self.tokenizer, self.out_dir, step, trainer_state,
            self.args.keep_checkpoints, self.patch_report))
