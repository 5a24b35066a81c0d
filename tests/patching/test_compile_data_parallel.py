"""A patched, compiled model under DDP and FSDP2 (`fully_shard` per decoder layer, then the model) on CPU, gloo, two processes.

Each rank compiles the wrapped patched model (``torch.compile``) and takes one training
step on its own batch; the gradients the wrapper leaves on every rank (gathered, under FSDP2) must equal the
mean of the two batches' gradients of the eager patched model in one process,
and each rank's delta-rule layers must have run rewy's backward. (FSDP1, the
recipe's FSDP config, refuses to run without an accelerator.)
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rewy_hf import dispatch_report, patch_model, unpatch_model

import hf_tiny_models as hf
from test_compile import grad_dicts_rel

WORLD = 2


def _model():
    model = hf.one_layer_qwen3_5()
    patch_model(model, backend="torch")
    return model


def _batch(rank: int) -> torch.Tensor:
    return hf.input_ids(2, 40, seed=100 + rank)


def _wrap(model, how: str):
    if how == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def _full(grad):
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def _worker(rank: int, port: int, out: str, how: str) -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        model = _model()
        wrapped = _wrap(model, how)
        loss = hf.loss_of(torch.compile(wrapped, backend="aot_eager"), _batch(rank), "qwen3_5")
        loss.backward()
        counts = dispatch_report()["ops"]["gated_delta_rule"]
        torch.save({"grads": {n: _full(p.grad) for n, p in model.named_parameters()},
                    "backward_calls": counts["optimized_backward_calls"]}, os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
@pytest.mark.parametrize("how", ["ddp", "fsdp2"])
def test_compiled_data_parallel_gradients_equal_the_mean_of_eager_gradients(tmp_path, how):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path), how), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"{r}.pt", weights_only=True) for r in range(WORLD)]

    model = _model()
    for r in range(WORLD):
        (hf.loss_of(model, _batch(r), "qwen3_5") / WORLD).backward()
    for r, got in enumerate(ranks):
        assert got["backward_calls"] == 1, (r, got["backward_calls"])   # the delta-rule layer ran rewy's backward
        err = grad_dicts_rel(got["grads"], {n: p.grad for n, p in model.named_parameters()})
        assert err <= 1e-5, (r, err)
    unpatch_model(model)
