"""One process of a two-process FSDP run of a patched, compiled model on CPU
(tests/training/test_fsdp_compile.py), and the one-process run it is held to."""

from __future__ import annotations

import functools
import os

import torch

# SGD, not AdamW: its step scales with the gradient, so a wrongly reduced gradient shows in the losses.
LR, STEPS, ROWS, T = 1.0, 3, 4, 80


def batch() -> torch.Tensor:
    return torch.randint(0, 256, (ROWS, T), generator=torch.Generator().manual_seed(0))


def _model():
    import rewy_hf
    from rewy_hf.models.presets import build_preset

    model = build_preset("tiny-qwen3.5")
    rewy_hf.patch_model(model, backend="torch")
    return model


def _train(forward, params, ids, reduce=lambda t: t) -> list[float]:
    opt = torch.optim.SGD(params, lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = forward(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(reduce(loss.detach().clone()).item())
    return losses


def one_process_losses() -> list[float]:
    """The whole batch in one process, eagerly: the reference."""
    model = _model()
    return _train(model, model.parameters(), batch())


def rank_main(rank: int, world: int, port: int, out: str) -> None:
    """FSDP as the recipe's config sets it up (version 1, full shard, use_orig_params, one unit per
    decoder layer), compiled; each rank trains on its half of the batch. Rank 0 saves the mean loss
    per step, its dispatch report and how many graphs dynamo made."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    import rewy_hf

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        model = _model()
        policy = functools.partial(transformer_auto_wrap_policy,
                                   transformer_layer_cls={type(layer) for layer in model.model.layers})
        sharded = FSDP(model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy.FULL_SHARD,
                       use_orig_params=True, device_id=torch.device("cpu"))
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        rows = ROWS // world

        def mean_over_ranks(t):
            dist.all_reduce(t)
            return t / world

        losses = _train(torch.compile(sharded, backend="aot_eager"), sharded.parameters(),
                        batch()[rank * rows:(rank + 1) * rows], mean_over_ranks)
        if rank == 0:
            torch.save({"losses": losses, "report": rewy_hf.dispatch_report(),
                        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs}, out)
    finally:
        dist.destroy_process_group()


# Context parallel: one packed row of CP_ROWS windows of CP_T tokens (+1 for the targets); a window
# crosses the two processes' boundary (3 x 64 tokens split at 96).
CP_ROWS, CP_T = 3, 64


def _windows() -> torch.Tensor:
    return torch.randint(3, 256, (CP_ROWS, CP_T + 1), generator=torch.Generator().manual_seed(1))


def one_process_window_losses() -> list[float]:
    """The windows as a batch in one process, eagerly, the recipe's loss: the reference."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    w, losses = _windows(), []
    for _ in range(STEPS):
        logits = model(input_ids=w[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def cp_rank_main(rank: int, world: int, port: int, out: str) -> None:
    """FSDP as in ``rank_main``, compiled, and the recipe's --context-parallel split of the windows
    (training/context_split.py): each rank trains its slice of the one packed row. Rank 0 saves the
    row's loss per step (the mean of the ranks' shares) and its dispatch report."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    import rewy_hf
    from rewy_hf.models.causal_masks import causal_only_masks
    from rewy_hf.training.context_split import RowSplit

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        model = _model()
        masks = causal_only_masks(model)
        policy = functools.partial(transformer_auto_wrap_policy,
                                   transformer_layer_cls={type(layer) for layer in model.model.layers})
        sharded = FSDP(model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy.FULL_SHARD,
                       use_orig_params=True, device_id=torch.device("cpu"))
        compiled = torch.compile(sharded, backend="aot_eager")
        split = RowSplit(CP_ROWS, CP_T, world, rank, torch.device("cpu"))
        opt = torch.optim.SGD(sharded.parameters(), lr=LR)
        losses = []
        for _ in range(STEPS):
            with split.active(compiled):
                loss = split.loss(compiled, _windows(), masks)
                loss.backward()
            opt.step()
            opt.zero_grad()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append((t / world).item())
        if rank == 0:
            torch.save({"losses": losses, "report": rewy_hf.dispatch_report()}, out)
    finally:
        dist.destroy_process_group()
