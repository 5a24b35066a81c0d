"""``--context-parallel``: one packed row of the step's windows, split across the processes.

Every process reads the same ``--batch-size`` windows; their inputs are joined into one row of
batch-size x seq-len tokens (``cu_seqlens`` at the window bounds), and process r trains tokens
``[r P, (r + 1) P)``, P = row / processes, through ``rewy_hf.context_parallel`` (the delta-rule
layers and their short convolutions exchange state summaries with FLA's protocol; a transformers
hybrid's full-attention layers attend over an all-gather of the row's keys and values). Each process's
loss is its tokens' summed cross-entropy x processes / row tokens, so the mean over processes that
DDP and FSDP take of the gradients is the gradient of the row's mean loss, and the mean of the
logged losses is that loss.
"""

from __future__ import annotations

import torch

from ..patching.context_parallel_attention import RowAttention
from .options import RecipeError


def check(args, world: int, on_cpu: bool = False) -> None:
    """Refuse a --context-parallel run that cannot work, before anything heavy loads."""
    if not args.context_parallel:
        return
    if args.core != "rewy":
        raise RecipeError("--context-parallel runs rewy's delta-rule layers; drop --core original")
    if world < 2 and on_cpu:
        # `accelerate launch --cpu --num_processes N` starts one process: it launches several on the
        # CPU only through mpirun.
        raise RecipeError("--context-parallel splits each row across processes: launch 2 or more. On the CPU, "
                          "`accelerate launch --cpu` starts a single process whatever --num_processes says; run "
                          "`torchrun --nproc_per_node 2 recipes/finetune_gdn2.py --context-parallel ...`")
    if world < 2:
        raise RecipeError("--context-parallel splits each row across processes: launch 2 or more, e.g. "
                          "`accelerate launch --num_processes 2 recipes/finetune_gdn2.py --context-parallel ...`")
    if (args.batch_size * args.seq_len) % world:
        raise RecipeError(f"--context-parallel: batch-size x seq-len = {args.batch_size * args.seq_len} tokens do not "
                          f"split evenly over {world} processes; pick sizes whose product {world} divides")


class RowSplit:
    def __init__(self, batch_size: int, seq_len: int, world: int, rank: int, device: torch.device):
        from fla.ops.cp import build_cp_context
        import torch.distributed as dist

        self.world, self.total = world, batch_size * seq_len
        self.bounds = torch.arange(0, self.total + 1, seq_len)
        self.context = build_cp_context(self.bounds.to(device), group=dist.group.WORLD, cu_seqlens_cpu=self.bounds)
        part = self.total // world
        self.tokens = slice(rank * part, (rank + 1) * part)
        # Each local token's place in its window, for a transformers hybrid's rotary embeddings.
        self.positions = RowAttention(self.bounds, dist.group.WORLD).positions(device)

    def describe(self) -> str:
        return f"context parallel: rows of {self.total} tokens in {self.world} slices"

    def active(self, model):
        """The block inside which ``loss`` and its backward run (``rewy_hf.context_parallel``)."""
        import rewy_hf

        return rewy_hf.context_parallel(model, self.context, cu_seqlens=self.bounds)

    def loss(self, model, batch: torch.Tensor, masks: dict | None) -> torch.Tensor:
        """This process's share of the row's loss; call it, and its backward, inside ``active``.

        ``masks``: ``causal_only_masks`` of the model. What tells the model its slice is part of a
        packed row: FLA's models (None) take the local ``cu_seqlens``; transformers' hybrids take the
        positions and that mapping (their attention layers read the row's bounds inside ``active``)."""
        row, targets = batch[:, :-1].reshape(1, -1), batch[:, 1:].reshape(-1)
        packed = ({"cu_seqlens": self.context.cu_seqlens} if masks is None
                  else {"position_ids": self.positions, "attention_mask": masks})
        logits = model(input_ids=row[:, self.tokens], use_cache=False, **packed).logits
        summed = torch.nn.functional.cross_entropy(logits[0].float(), targets[self.tokens], reduction="sum")
        return summed * (self.world / self.total)


def row_split(args, world: int, rank: int, device: torch.device) -> RowSplit | None:
    """The run's split, or None without --context-parallel (``check`` has passed at the run's start)."""
    if not args.context_parallel:
        return None
    return RowSplit(args.batch_size, args.seq_len, world, rank, device)
