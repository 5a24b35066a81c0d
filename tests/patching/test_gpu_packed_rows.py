"""Packed rows through patched models on the GPU (Triton backend, bf16).

The same properties as tests/patching/test_packed_rows.py on the CPU: a packed
row gives each document its outputs and gradients run alone (here within bf16
rounding, and far closer than the unpatched model, which leaks), and a
compiled model (inductor) fed a new packing each step stops compiling after
the first packings, with no graph break inside a delta-rule layer.
"""

from __future__ import annotations

import pytest
import torch

from rewy_hf import dispatch_report, patch_model, unpatch_model
from rewy_hf.kernels.short_conv import fla_gluon_conv
from rewy_hf.patching.dispatch import report_difference, total_calls
from rewy_hf.rel_error import rel_err

import hf_tiny_models as hf
from test_packed_rows import _packed, _packings, _row

pytestmark = pytest.mark.gpu

LENGTHS = (64, 37, 1, 26, 300, 212)
# K = V = 128 heads, as the published models have
WIDE = {"qwen3_5": dict(linear_key_head_dim=128, linear_value_head_dim=128),
        "kimi_linear": dict(linear_head_dim=128)}


def _model(family: str, layers: list[str] | None = None):
    fam = hf.family_of(family)
    cfg = hf.make_config(fam, route_all_experts=True)
    for k, v in WIDE[family].items():
        setattr(cfg, k, v)
    if layers is not None:
        cfg.num_hidden_layers, cfg.layer_types = len(layers), layers
    cfg.use_cache = False
    torch.manual_seed(0)
    model = getattr(fam.modeling, fam.model_class)(cfg)
    hf._init_gates(model, fam, 0)
    return model.to("cuda", torch.bfloat16).train()


def _docs():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, hf.VOCAB, (n,), generator=gen) for n in LENGTHS]


def _logits_and_grads(model, batches, with_grads=True):
    model.zero_grad(set_to_none=True)
    logits = []
    for b in batches:
        out = model(**{k: v.cuda() if torch.is_tensor(v) else v for k, v in b.items()}).logits[0]
        if with_grads:
            (out.float().square().sum() / 1e3).backward()
        logits.append(out.detach().float())
    grads = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None]) \
        if with_grads else None
    return torch.cat(logits), grads


@pytest.mark.parametrize("family", sorted(WIDE))
def test_packed_row_equals_its_documents_on_the_gpu(family):
    model = _model(family)
    docs = _docs()
    packed = _packed(docs, flash_kwargs=False)
    alone = [{"input_ids": d[None], "use_cache": False} for d in docs]
    # unpatched: forward only (FLA's GDN backward refuses Hopper with Triton < 3.7.1)
    leak = rel_err(_logits_and_grads(model, [packed], False)[0], _logits_and_grads(model, alone, False)[0])
    patch_model(model, backend="triton")
    before = dispatch_report()
    logits, grads = _logits_and_grads(model, [packed])
    ref_logits, ref_grads = _logits_and_grads(model, alone)
    assert total_calls(report_difference(before, dispatch_report()), "optimized_backward_calls") > 0
    err = rel_err(logits, ref_logits)
    assert err < 1e-2 and rel_err(grads, ref_grads) < 2e-2
    assert leak > 5 * err, (leak, err)
    unpatch_model(model)


def test_compiled_packings_do_not_recompile_on_the_gpu():
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    model = _model("qwen3_5", ["linear_attention"])
    patch_model(model, backend="triton")
    compiled = torch.compile(model)
    graphs = []
    packings = list(_packings(6, 1024))
    packings[3:3] = [[1024], [1, 1023]]          # one document; a first document of one token
    for step, lens in enumerate(packings):
        batch = {k: v.cuda() for k, v in _row(lens, hf.VOCAB, False, seed=step).items()}
        compiled(**batch).logits.float().square().mean().backward()
        graphs.append(int(dynamo_utils.counters["stats"]["unique_graphs"]))
    breaks = " ".join(dynamo_utils.counters["graph_break"])
    assert graphs[2] == graphs[-1] and graphs[-1] <= 2, graphs
    assert not breaks or ("bounds_from_positions" in breaks and "rewy." not in breaks), breaks
    torch._dynamo.reset()


@pytest.mark.parametrize("activation", ["silu", None])
def test_the_eager_packed_convolution_on_cuda_restarts_at_every_document(activation):
    """On CUDA, eagerly (cuDNN's depthwise convolution, then the outputs after each bound
    recomputed): the values and gradients of the same call in float64 on the CPU, for bounds inside
    chunks and on their edges, from the transposed view transformers hands it."""
    from rewy_hf.kernels.short_conv import packed_causal_short_conv

    gen = torch.Generator().manual_seed(3)
    C, T, W = 96, sum(LENGTHS), 4
    x = torch.randn(1, T, C, generator=gen).transpose(1, 2)           # [1, C, T], as transformers passes it
    weight, bias = torch.randn(C, W, generator=gen), torch.randn(C, generator=gen)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    grad = torch.randn(1, C, T, generator=gen)

    def run(device, dtype):
        leaves = [t.to(device, dtype).requires_grad_() for t in (x, weight, bias)]
        out = packed_causal_short_conv(*leaves, activation, cu.to(device))
        out.backward(grad.to(device, dtype))
        return [out.detach().cpu().double()] + [t.grad.cpu().double() for t in leaves]

    ref = run("cpu", torch.float64)
    got = run("cuda", torch.float32)
    assert got[0].shape == ref[0].shape
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 1e-5, rel_err(a, b)


def test_eager_convolution_on_cuda_runs_the_triton_kernel_in_patched_layers_only():
    """A patched layer's convolution eagerly on CUDA (transformers would run F.conv1d) takes FLA's
    kernels (Gluon where this machine has them), counted in the dispatch report; the logits stay within bf16 rounding of the
    unpatched model's, and an unpatched model runs its own convolution again."""
    model = _model("qwen3_5")
    layers = sum(t == "linear_attention" for t in model.config.layer_types)
    ids = torch.randint(3, hf.VOCAB, (2, 300), generator=torch.Generator().manual_seed(4)).cuda()
    ref = model(input_ids=ids, use_cache=False).logits.float()
    patch_model(model, backend="triton")
    before = dispatch_report()
    out = model(input_ids=ids, use_cache=False).logits.float()
    routes = report_difference(before, dispatch_report())["ops"]["short_conv"]["routes"]
    kernels = "fla-gluon" if fla_gluon_conv() is not None else "fla-triton"
    assert routes == {f"{kernels}: in place of F.conv1d": layers}
    assert rel_err(out, ref) < 2e-2
    unpatch_model(model)
    before = dispatch_report()
    model(input_ids=ids, use_cache=False)
    assert "short_conv" not in report_difference(before, dispatch_report())["ops"]
