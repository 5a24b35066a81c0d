"""The parity verdict over many seeds: an untouched model passes on every one in bfloat16, where a
weight's one SGD step is a few units of its last place and the two sides now and then round it to
neighbouring values, and a broken core fails on every one.

Tiny shapes (one batch of 1 x 80 tokens) keep the 20 seeds of each case to a few seconds."""

from __future__ import annotations

import pytest
import torch

from rewy_hf.cpu_triton import enable_cpu_interpreter
from rewy_hf.models.loading import load_causal_lm
from rewy_hf.parity.comparison import DEFAULT_TOLERANCES, compare_update, rounding_step, run_parity
from rewy_hf.parity.inputs import token_batches

SEEDS = range(20)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tensors of a few thousand elements: more threads only add synchronisation, which on a busy
    machine made each comparison several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _parity(preset: str, dtype: torch.dtype, seed: int):
    enable_cpu_interpreter()
    model = load_causal_lm(preset, dtype=dtype, device="cpu", seed=seed).model
    batches = token_batches(model, None, batch_size=1, seq_len=80, steps=1, seed=seed, text_file=None, name=preset)
    return run_parity(model, batches, tolerance=DEFAULT_TOLERANCES[dtype])


# The presets of a comparison of a tenth of a second or less; FLA's DeltaNet, GDN and KDA layers run
# their short convolutions through the Triton interpreter here, 1.5 s a comparison.
FAST_PRESETS = ["tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-qwen3-next", "tiny-olmo-hybrid", "tiny-kimi-linear",
                "tiny-fla-gdn2"]


def test_an_untouched_model_holds_bf16_parity_on_every_seed(monkeypatch):
    monkeypatch.delenv("REWY_HF_TEST_FAULT", raising=False)
    tol = DEFAULT_TOLERANCES[torch.bfloat16]
    results = {(preset, seed): _parity(preset, torch.bfloat16, seed) for preset in FAST_PRESETS for seed in SEEDS}
    failing = {key: [(p.name, p.rel_err) for p in r.failing()] for key, r in results.items() if not r.ok}
    assert not failing, failing
    updates = [u for r in results.values() for u in r.update if not u.tiny]
    # The rounding is there: taken as it is, the updates of some seeds differ by more than the tolerance
    # (tiny-qwen3.5's among them) ...
    raw = {key for key, r in results.items() if any(u.raw_rel_err > tol.grad_rel for u in r.update if not u.tiny)}
    assert "tiny-qwen3.5" in {preset for preset, _ in raw}, sorted(raw)
    # ... and beyond it they agree about as closely as the gradients do, far inside the tolerance.
    assert max(u.rel_err for u in updates) < tol.grad_rel / 10
    assert max(p.rel_err for r in results.values() for p in r.params if not p.tiny) < tol.grad_rel / 5


@pytest.mark.filterwarnings("ignore:REWY_HF_TEST_FAULT")
@pytest.mark.parametrize("preset, dtype, fault, broken", [
    ("tiny-qwen3.5", torch.float32, "grad_scale=1.05", "model.layers.0.linear_attn."),   # the parity tests' fault
    ("tiny-qwen3.5", torch.bfloat16, "grad_scale=1.5", "model.layers.0.linear_attn."),
    ("tiny-kimi-linear", torch.bfloat16, "grad_scale=0.5@kda", "model.layers.0.self_attn."),
    ("tiny-fla-gdn2", torch.bfloat16, "grad_scale=1.5@gdn2", "model.layers."),
    ("tiny-qwen3.5", torch.bfloat16, "grad_scale=1.5@kda", None),     # aimed at an op the model lacks
])
def test_a_broken_core_fails_parity_on_every_seed(preset, dtype, fault, broken, monkeypatch):
    monkeypatch.setenv("REWY_HF_TEST_FAULT", fault)
    results = [_parity(preset, dtype, seed) for seed in SEEDS]
    if broken is None:
        assert all(r.ok for r in results), "a fault of another op leaves this model's verdict alone"
        return
    passing = [seed for seed, r in zip(SEEDS, results) if r.ok]
    assert not passing, f"{fault} in {dtype} held parity on seeds {passing}"
    for r in results:
        bad = {p.name for p in r.failing()}
        assert any(name.startswith(broken) for name in bad), bad
        assert "lm_head.weight" not in bad, "downstream of the core: unaffected"


def test_an_update_is_judged_beyond_one_rounding_step_of_its_updated_weight():
    """Two sides' bfloat16 weights after a step one value apart (rounding) pass; two values apart they
    fail, and so does either difference where the weights are float32, whose rounding step is far smaller."""
    tol = DEFAULT_TOLERANCES[torch.bfloat16]
    w = torch.tensor([1.0, 0.5, -2.0, 0.25], dtype=torch.bfloat16)
    assert rounding_step(w).tolist() == [2 ** -7, 2 ** -8, 2 ** -6, 2 ** -9]
    ref_after = w + torch.tensor([2 ** -7, 2 ** -8, -(2 ** -6), 2 ** -9], dtype=torch.bfloat16)   # one value each
    ref = ref_after.double() - w.double()
    for values, ok in ((1, True), (2, False)):
        after = ref_after.clone()
        after[0] += values * 2 ** -7
        r = compare_update("update:w", after.double() - w.double(), ref, after, ref_after, tol)
        assert r.ok is ok and r.raw_rel_err > tol.grad_rel, (values, r)
        r32 = compare_update("update:w", after.double() - w.double(), ref, after.float(), ref_after.float(), tol)
        assert not r32.ok and r32.rel_err == pytest.approx(r32.raw_rel_err, rel=1e-4)
