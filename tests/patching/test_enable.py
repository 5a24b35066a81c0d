"""rewy_hf.enable / disable: every transformers / FLA model created while enabled is patched.

Tiny random models on CPU (hf_tiny_models, fla_tiny_models). Each test ends with
``rewy_hf.disable(unpatch=True)`` and checks ``PreTrainedModel.post_init`` and
``from_pretrained`` are the ones it found, so no switch or patched layer
outlives its test. The last tests train through transformers' ``Trainer`` and
TRL's ``SFTTrainer`` (packed, padding-free batches) with nothing but
``rewy_hf.enable()`` before the model.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

import rewy_hf
from rewy_hf import UnsupportedConfigError
from rewy_hf.patching.auto_patch import RUN, start, stop
from rewy_hf.patching.model_creation import ModelRecorder
from rewy_hf.patching.patch import patch_state

import fla_tiny_models
import hf_tiny_models as H
from recipe_runs import reset_accelerate

OPTIONS = {"backend": "auto", "policy": "recompute", "fallback": "error"}


@pytest.fixture(autouse=True)
def _switched_off_after():
    from transformers.utils import logging

    hooked = {name: PreTrainedModel.__dict__[name] for name in ("post_init", "from_pretrained")}
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    rewy_hf.reset_dispatch_report()
    yield
    rewy_hf.disable(unpatch=True)
    # Trainer sets up Accelerate's process-wide state; the recipe tests in this worker build their own
    reset_accelerate()
    logging.set_verbosity(level)
    assert all(PreTrainedModel.__dict__[name] is before for name, before in hooked.items())


def patched_names(model) -> list[str]:
    return [n for n, m in model.named_modules() if rewy_hf.is_patched(m)]


def op_counts(op: str) -> dict:
    return rewy_hf.dispatch_report()["ops"].get(op, {})


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "kimi_linear"])
def test_models_built_after_enable_are_patched_and_train_through_rewy(family):
    switch = rewy_hf.enable()
    model = H.build(family)
    layers = H.delta_rule_layer_names(model, family)
    assert len(layers) == 2 and patched_names(model) == layers

    H.loss_of(model, H.input_ids(seq_len=20), family).backward()
    op = H.FAMILIES[family].op
    assert op_counts(op)["forward_calls"] == 2 and op_counts(op)["optimized_backward_calls"] == 2

    # One report, for the outermost model: its inner text model is folded in, and the layers
    # it patched are not reported as already patched by the outer call.
    (report,) = switch.reports
    assert report.model == H.FAMILIES[family].model_class
    assert [(p.name, p.op, p.already) for p in report.report.patched] == [(n, op, False) for n in layers]
    assert switch.active and switch.options == OPTIONS


def test_from_config_and_from_pretrained_are_patched(tmp_path):
    H.build("qwen3_5").save_pretrained(tmp_path)       # before enable: saved unpatched
    switch = rewy_hf.enable(policy="full")
    built = AutoModelForCausalLM.from_config(H.make_config("qwen3_5"))
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)   # returns a tuple
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for model in (built, loaded):
        assert patched_names(model) == H.delta_rule_layer_names(model, "qwen3_5")
    assert [r.model for r in switch.reports] == ["Qwen3_5ForCausalLM"] * 2
    assert {p.policy for r in switch.reports for p in r.report.patched} == {"full"}

    ids = H.input_ids(seq_len=20)
    for model in (built, loaded):           # loaded: as from_pretrained returns it, in eval mode
        H.loss_of(model, ids).backward()
    assert op_counts("gated_delta_rule")["policies"] == {"full": 4}
    assert op_counts("gated_delta_rule")["optimized_backward_calls"] == 4


def test_a_loaded_model_still_trains_through_rewy_after_train(tmp_path):
    """from_pretrained kernelizes the model for inference with Hugging Face's `kernels` package (a
    transformers dependency) and ``model.train()`` -- which Trainer calls -- kernelizes it again for
    training; the patched layers must still reach rewy afterwards."""
    H.build("qwen3_5").save_pretrained(tmp_path)
    rewy_hf.enable()
    model = AutoModelForCausalLM.from_pretrained(tmp_path).train()
    assert patched_names(model) == H.delta_rule_layer_names(model, "qwen3_5")
    H.loss_of(model, H.input_ids(seq_len=20)).backward()
    assert op_counts("gated_delta_rule").get("optimized_backward_calls") == 2


def test_fla_models_are_patched():
    switch = rewy_hf.enable()
    model = fla_tiny_models.build("gated_deltanet")      # AutoModelForCausalLM.from_config
    assert len(patched_names(model)) == 2
    ids, labels = fla_tiny_models.batch(72)
    model(input_ids=ids, labels=labels).loss.backward()
    assert op_counts("gated_delta_rule")["optimized_backward_calls"] == 2
    assert [r.model for r in switch.reports] == ["GatedDeltaNetForCausalLM"]


def test_a_model_without_delta_rule_layers_is_left_alone():
    from transformers import LlamaConfig, LlamaForCausalLM

    switch = rewy_hf.enable()
    model = LlamaForCausalLM(LlamaConfig(vocab_size=H.VOCAB, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    assert patched_names(model) == [] and "forward" not in vars(model.model.layers[0].self_attn)
    assert switch.reports == [] and switch.recorder.models() == ["LlamaForCausalLM"]
    assert torch.isfinite(model(input_ids=H.input_ids(seq_len=8)).logits).all()


def test_disable_stops_patching_and_keeps_patched_models_patched():
    switch = rewy_hf.enable()
    before = H.build("qwen3_5")
    assert rewy_hf.disable() == 0
    after = H.build("qwen3_5")
    assert patched_names(after) == []
    assert len(patched_names(before)) == 2           # stays patched
    assert not switch.active and len(switch.reports) == 1
    assert not hasattr(PreTrainedModel.post_init, "_rewy_run_hook")
    assert rewy_hf.disable() == 0                    # nothing enabled: nothing to do


def test_disable_unpatch_restores_the_layers_it_patched():
    rewy_hf.enable()
    model = H.build("qwen3_5")
    mine = H.build("qwen3_5")
    rewy_hf.unpatch_model(mine)
    rewy_hf.patch_model(mine)                       # patched by the user, not by the switch
    assert rewy_hf.disable(unpatch=True) == 2
    assert patched_names(model) == []
    assert not any("forward" in vars(model.get_submodule(n)) for n in H.delta_rule_layer_names(model, "qwen3_5"))
    assert len(patched_names(mine)) == 2


def test_enable_again_same_options_is_a_no_op_other_options_name_the_fix():
    switch = rewy_hf.enable()
    hooked = PreTrainedModel.__dict__["post_init"]
    assert rewy_hf.enable(**OPTIONS) is switch
    assert PreTrainedModel.__dict__["post_init"] is hooked       # not wrapped twice
    with pytest.raises(UnsupportedConfigError, match=r"policy='recompute' \(asked: 'full'\).*rewy_hf.disable\(\)"):
        rewy_hf.enable(policy="full")
    assert rewy_hf.enable() is switch and switch.active

    rewy_hf.disable()
    other = rewy_hf.enable(policy="full", fallback="original")
    assert other is not switch and other.options == {**OPTIONS, "policy": "full", "fallback": "original"}
    layer = H.build("qwen3_5").model.layers[0].linear_attn
    state = patch_state(layer)
    assert (state.policy, state.fallback) == ("full", "original")


@pytest.mark.parametrize("bad, message", [({"backend": "cuda"}, r"`backend`='cuda' is unknown; choose one of"),
                                          ({"policy": "none"}, r"`policy`='none' is unknown"),
                                          ({"fallback": "skip"}, r"`fallback`='skip' is unknown")])
def test_bad_options_are_refused_before_any_model(bad, message):
    with pytest.raises(UnsupportedConfigError, match=message):
        rewy_hf.enable(**bad)
    assert not hasattr(PreTrainedModel.post_init, "_rewy_run_hook")


def test_enable_inside_rewy_hf_run_names_the_fix():
    """A script run by `rewy-hf run` that calls enable() itself: the run's options are the only ones,
    and `--core original` (models recorded, none patched) must not be defeated by the script."""
    run = start(ModelRecorder(OPTIONS), owner=RUN)
    try:
        assert rewy_hf.enable() is run
        with pytest.raises(UnsupportedConfigError, match=r"pass the options to `rewy-hf run` \(--backend, --policy"):
            rewy_hf.enable(policy="full")
    finally:
        stop(run)

    recording = start(ModelRecorder(None), owner=RUN)
    try:
        with pytest.raises(UnsupportedConfigError, match="--core rewy"):
            rewy_hf.enable()
        model = H.build("qwen3_5")
        assert patched_names(model) == [] and recording.recorder.models() == ["Qwen3_5ForCausalLM"]
    finally:
        stop(recording)


def test_models_built_in_several_threads_are_all_patched():
    switch = rewy_hf.enable()
    models, errors = [None] * 4, []

    def build(i):
        try:
            models[i] = H.build("qwen3_5", seed=i)
        except BaseException as exc:       # surfaced below: a thread's exception would be lost
            errors.append(exc)

    threads = [threading.Thread(target=build, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(len(patched_names(m)) == 2 for m in models)
    assert len(switch.reports) == 4
    assert rewy_hf.disable(unpatch=True) == 8


class TokenRows(torch.utils.data.Dataset):
    def __init__(self, rows: int = 6, seq_len: int = 24):
        self.ids = H.input_ids(rows, seq_len)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_trainer_trains_through_rewy_after_enable(tmp_path):
    from transformers import Trainer, TrainingArguments

    rewy_hf.enable()
    model = H.one_layer_qwen3_5()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, logging_steps=1, save_strategy="no", learning_rate=1e-3)
    trainer = Trainer(model=model, args=args, train_dataset=TokenRows())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    counts = op_counts("gated_delta_rule")
    assert counts["optimized_backward_calls"] == counts["forward_calls"] == 3       # 3 steps, 1 layer
    assert counts["fallback_calls"] == 0


def word_tokenizer(words: list[str]):
    """A word-level tokenizer over ``words`` (ids 4..), built in memory: no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(words)}}
    assert len(vocab) <= H.VOCAB
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def test_trl_sft_trainer_packed_padding_free_trains_through_rewy(tmp_path):
    """TRL's packing (its default "bfd" strategy) is padding-free: each batch is one row of whole
    documents, with position_ids restarting at 0 at each document and the documents' bounds in
    cu_seq_lens_q. SFTConfig turns gradient checkpointing on by default, so each patched layer's
    forward runs twice per step (once again during the backward)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    words = [f"w{i}" for i in range(100)]
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 14, (12,), generator=gen).tolist()
    texts = [" ".join(words[j] for j in torch.randint(0, 100, (n,), generator=gen).tolist()) for n in lengths]

    rewy_hf.enable()
    model = H.one_layer_qwen3_5()
    args = SFTConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, packing=True,
                     max_length=32, report_to=[], use_cpu=True, logging_steps=1, save_strategy="no",
                     learning_rate=1e-3)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=word_tokenizer(words))
    assert trainer.padding_free and args.gradient_checkpointing

    batch = next(iter(trainer.get_train_dataloader()))
    assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 1
    starts = (batch["position_ids"][0] == 0).nonzero().flatten()
    assert len(starts) > 1 and batch["cu_seq_lens_q"][:-1].tolist() == starts.tolist()

    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    counts = op_counts("gated_delta_rule")
    assert counts["optimized_backward_calls"] == 3 and counts["fallback_calls"] == 0      # 3 steps, 1 layer
    assert counts["forward_calls"] == 2 * counts["optimized_backward_calls"]      # rerun under checkpointing


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear"])
def test_trl_padding_free_rows_keep_documents_apart(family):
    """A packed row gives each document the logits it gets alone: nothing leaks across the
    boundaries TRL's padding-free collator marks (delta-rule state, convolution, attention)."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    rewy_hf.enable()
    model = H.build(family).eval()
    docs = [H.input_ids(1, n, seed=n)[0].tolist() for n in (20, 70, 13)]
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)([{"input_ids": d} for d in docs])
    with torch.no_grad():
        packed = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits[0]
        start = 0
        for doc in docs:
            alone = model(input_ids=torch.tensor([doc]), use_cache=False).logits[0]
            torch.testing.assert_close(packed[start:start + len(doc)], alone, rtol=1e-5, atol=1e-5)
            start += len(doc)
    assert op_counts(H.FAMILIES[family].op)["forward_calls"] == 2 * (1 + len(docs))
