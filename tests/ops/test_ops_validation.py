"""Bad-input handling of the four public ops.

Every bad call must raise ``rewy_hf.UnsupportedConfigError`` (a valid request
that rewy-hf cannot compute) or ``rewy_hf.InputValidationError`` (malformed
inputs), both ``ValueError`` subclasses, and the message must name the problem:
each ``pytest.raises`` matches a distinctive fragment of it. A few positive
tests check that FLA's plumbing keywords are accepted and change nothing.

Shapes are tiny (B <= 2, T <= 20, H <= 4, K = 4, V = 6) and float32; K != V so
that the two state layouts have different shapes.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import rewy_hf
from rewy_hf import (
    InputValidationError,
    UnsupportedConfigError,
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_gdn2,
    chunk_kda,
)

OPS = {
    "delta_rule": chunk_delta_rule,
    "gdn": chunk_gated_delta_rule,
    "kda": chunk_kda,
    "gdn2": chunk_gdn2,
}
ALL = list(OPS)
GVA_OPS = ["gdn", "kda"]             # HV may be a multiple of H
NO_GVA_OPS = ["delta_rule", "gdn2"]  # HV must equal H
V_FIRST_OPS = ["gdn", "kda", "gdn2"]  # have a `state_v_first` argument
VECTOR_GATE_OPS = ["kda", "gdn2"]    # lower_bound / safe_gate gates
NEG_EIGVAL_OPS = ["gdn", "kda"]      # have `allow_neg_eigval`

K_DIM, V_DIM = 4, 6


def make_inputs(op, B=1, T=10, H=2, HV=None, K=K_DIM, V=V_DIM, dtype=torch.float32, seed=0):
    """Valid keyword inputs for ``OPS[op]``: q, k, v plus the op's gates."""
    HV = H if HV is None else HV
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    q = F.normalize(rnd(B, T, H, K), dim=-1)
    k = F.normalize(rnd(B, T, H, K), dim=-1)
    inputs = {"q": q, "k": k, "v": rnd(B, T, HV, V)}
    if op == "delta_rule":
        inputs["beta"] = rnd(B, T, HV).sigmoid()
    elif op == "gdn":
        inputs["g"] = F.logsigmoid(rnd(B, T, HV))
        inputs["beta"] = rnd(B, T, HV).sigmoid()
    elif op == "kda":
        inputs["g"] = F.logsigmoid(rnd(B, T, HV, K))
        inputs["beta"] = rnd(B, T, HV).sigmoid()
    elif op == "gdn2":
        inputs["g"] = F.logsigmoid(rnd(B, T, HV, K))
        inputs["b"] = rnd(B, T, HV, K).sigmoid()
        inputs["w"] = rnd(B, T, HV, V).sigmoid()
    else:
        raise KeyError(op)
    return {name: x.to(dtype) for name, x in inputs.items()}


def state(N, HV, K=K_DIM, V=V_DIM, v_first=False, dtype=torch.float32):
    shape = (N, HV, V, K) if v_first else (N, HV, K, V)
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(dtype)


def call(op, inputs, **kwargs):
    return OPS[op](**inputs, **kwargs)


def lit(text):
    """A literal fragment for ``match=``."""
    return re.escape(text)


# --------------------------------------------------------------------- basics


@pytest.mark.parametrize("op", ALL)
def test_valid_inputs_run(op):
    """The factory builds valid inputs (so each failure below is the one bad input)."""
    o, ht = call(op, make_inputs(op), output_final_state=True)
    assert o.shape == (1, 10, 2, V_DIM)
    assert ht.shape == (1, 2, K_DIM, V_DIM)
    assert torch.isfinite(o).all()


def test_errors_are_value_errors():
    assert issubclass(UnsupportedConfigError, ValueError)
    assert issubclass(InputValidationError, ValueError)
    assert rewy_hf.UnsupportedConfigError is UnsupportedConfigError
    assert rewy_hf.InputValidationError is InputValidationError


# ---------------------------------------------------------------- q, k, v


@pytest.mark.parametrize("op", ALL)
def test_mismatched_q_k_shapes(op):
    inputs = make_inputs(op)
    inputs["k"] = torch.randn(1, 10, 2, K_DIM + 1)
    with pytest.raises(InputValidationError, match=lit("`q` and `k` must have the same shape [B, T, H, K]")):
        call(op, inputs)


@pytest.mark.parametrize("op", ALL)
def test_mismatched_q_k_heads(op):
    inputs = make_inputs(op)
    inputs["k"] = torch.randn(1, 10, 1, K_DIM)
    with pytest.raises(InputValidationError, match=lit("got [1, 10, 2, 4] and [1, 10, 1, 4]")):
        call(op, inputs)


@pytest.mark.parametrize("op", ALL)
@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("bad", ["rank3", "rank5"])
def test_wrong_rank_of_qkv(op, name, bad):
    inputs = make_inputs(op)
    x = inputs[name]
    inputs[name] = x[..., 0] if bad == "rank3" else x.unsqueeze(0)
    with pytest.raises(InputValidationError, match=lit(f"`{name}` must have rank 4, got shape")):
        call(op, inputs)


@pytest.mark.parametrize("op", ALL)
def test_q_not_a_tensor(op):
    inputs = make_inputs(op)
    inputs["q"] = inputs["q"].tolist()
    with pytest.raises(InputValidationError, match=lit("`q` must be a torch.Tensor, got list")):
        call(op, inputs)


@pytest.mark.parametrize("op", ALL)
def test_integer_v(op):
    inputs = make_inputs(op)
    inputs["v"] = torch.ones(inputs["v"].shape, dtype=torch.long)
    with pytest.raises(InputValidationError, match=lit("`v` must be a floating-point tensor, got torch.int64")):
        call(op, inputs)


@pytest.mark.parametrize("op", ALL)
@pytest.mark.parametrize("axis", ["batch", "time"])
def test_v_batch_or_time_mismatch(op, axis):
    inputs = make_inputs(op, B=1, T=10)
    inputs["v"] = torch.randn(2, 10, 2, V_DIM) if axis == "batch" else torch.randn(1, 9, 2, V_DIM)
    with pytest.raises(InputValidationError, match=lit("`v` must have shape [B, T, HV, V] with B, T of q (1, 10)")):
        call(op, inputs)


@pytest.mark.parametrize("op", ALL)
@pytest.mark.parametrize("bad", ["k", "v"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_mixed_qkv_dtypes(op, bad, dtype):
    inputs = make_inputs(op)
    inputs[bad] = inputs[bad].to(dtype)
    with pytest.raises(InputValidationError, match=lit("`q`, `k`, `v` must share one dtype")):
        call(op, inputs)


@pytest.mark.parametrize("op", ALL)
def test_empty_sequence(op):
    inputs = make_inputs(op, T=0)
    with pytest.raises(InputValidationError, match=lit("sequence length T must be at least 1, got 0")):
        call(op, inputs)


# ----------------------------------------------------------- beta, g, b, w

# (op, tensor name, rank it must have)
GATE_TENSORS = [
    ("delta_rule", "beta", 3),
    ("gdn", "g", 3),
    ("gdn", "beta", 3),
    ("kda", "g", 4),
    ("kda", "beta", 3),
    ("gdn2", "g", 4),
    ("gdn2", "b", 4),
    ("gdn2", "w", 4),
]


@pytest.mark.parametrize("op,name,rank", GATE_TENSORS, ids=[f"{o}-{n}" for o, n, _ in GATE_TENSORS])
@pytest.mark.parametrize("bad", ["one_less", "one_more"])
def test_wrong_rank_of_gates(op, name, rank, bad):
    inputs = make_inputs(op)
    x = inputs[name]
    inputs[name] = x[..., 0] if bad == "one_less" else x.unsqueeze(-1)
    with pytest.raises(InputValidationError, match=lit(f"`{name}` must have rank {rank}, got shape")):
        call(op, inputs)


# (op, tensor name, meaning in the message)
GATE_MEANINGS = {
    ("delta_rule", "beta"): "[B, T, H]",
    ("gdn", "g"): "[B, T, HV]",
    ("gdn", "beta"): "[B, T, HV]",
    ("kda", "g"): "[B, T, HV, K]",
    ("kda", "beta"): "[B, T, HV]",
    ("gdn2", "g"): "[B, T, H, K]",
    ("gdn2", "b"): "[B, T, H, K]",
    ("gdn2", "w"): "[B, T, H, V]",
}


@pytest.mark.parametrize("op,name", list(GATE_MEANINGS), ids=[f"{o}-{n}" for o, n in GATE_MEANINGS])
def test_wrong_shape_of_gates(op, name):
    """Right rank, wrong time length."""
    inputs = make_inputs(op)
    inputs[name] = inputs[name][:, :-1]
    with pytest.raises(InputValidationError, match=lit(f"`{name}` must have shape {GATE_MEANINGS[op, name]} = [1, 10,")):
        call(op, inputs)


@pytest.mark.parametrize("op", GVA_OPS)
def test_gva_gate_shaped_by_key_heads(op):
    """With GVA, g and beta have one entry per value head, not per key head."""
    inputs = make_inputs(op, H=1, HV=2)
    inputs["beta"] = inputs["beta"][:, :, :1]
    with pytest.raises(InputValidationError, match=lit("`beta` must have shape [B, T, HV] = [1, 10, 2], got [1, 10, 1]")):
        call(op, inputs)


# -------------------------------------------------------------- GVA, heads


@pytest.mark.parametrize("op", GVA_OPS)
def test_gva_runs(op):
    o, ht = call(op, make_inputs(op, H=1, HV=2), output_final_state=True)
    assert o.shape == (1, 10, 2, V_DIM) and ht.shape == (1, 2, K_DIM, V_DIM)


@pytest.mark.parametrize("op", GVA_OPS)
def test_value_heads_not_multiple_of_key_heads(op):
    inputs = make_inputs(op, H=2, HV=3)
    with pytest.raises(InputValidationError, match=lit("HV=3 must be a multiple of the number of key heads H=2")):
        call(op, inputs)


@pytest.mark.parametrize("op", NO_GVA_OPS)
@pytest.mark.parametrize("H,HV", [(1, 2), (2, 4), (2, 3)])
def test_gva_unsupported(op, H, HV):
    inputs = make_inputs(op, H=H, HV=HV)
    with pytest.raises(UnsupportedConfigError, match=lit(f"no GVA), got H={H} key heads and HV={HV} value heads")):
        call(op, inputs)


# ----------------------------------------------------------- initial_state


@pytest.mark.parametrize("op", ALL)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_initial_state_not_float32(op, dtype):
    inputs = make_inputs(op)
    h0 = state(1, 2, dtype=dtype)
    with pytest.raises(InputValidationError, match=lit(f"`initial_state` must be float32 (as in FLA), got {dtype}")):
        call(op, inputs, initial_state=h0)


@pytest.mark.parametrize("op", ALL)
def test_initial_state_float64_with_float64_inputs(op):
    """The float64 ground-truth path keeps a float64 state: output and final state in float64."""
    o, ht = call(op, make_inputs(op, dtype=torch.float64), initial_state=state(1, 2, dtype=torch.float64),
                 output_final_state=True)
    assert o.dtype == ht.dtype == torch.float64


@pytest.mark.parametrize("op", ALL)
@pytest.mark.parametrize(
    "shape", [(2, 2, K_DIM, V_DIM), (1, 1, K_DIM, V_DIM), (1, 2, V_DIM, K_DIM), (1, 2, K_DIM, K_DIM)],
    ids=["batch", "heads", "transposed", "value_dim"],
)
def test_initial_state_wrong_shape(op, shape):
    inputs = make_inputs(op)
    h0 = torch.zeros(shape)
    with pytest.raises(
        InputValidationError,
        match=lit(f"`initial_state` must have shape [N, HV, K, V] = [1, 2, {K_DIM}, {V_DIM}], got {list(shape)}"),
    ):
        call(op, inputs, initial_state=h0)


@pytest.mark.parametrize("op", ALL)
def test_initial_state_wrong_rank(op):
    inputs = make_inputs(op)
    with pytest.raises(InputValidationError, match=lit("`initial_state` must have rank 4")):
        call(op, inputs, initial_state=torch.zeros(2, K_DIM, V_DIM))


@pytest.mark.parametrize("op", V_FIRST_OPS)
def test_initial_state_wrong_shape_state_v_first(op):
    """With state_v_first=True the state is [N, HV, V, K]; the K-first layout is refused."""
    inputs = make_inputs(op)
    h0 = state(1, 2, v_first=False)
    with pytest.raises(
        InputValidationError,
        match=lit(f"`initial_state` must have shape [N, HV, V, K] = [1, 2, {V_DIM}, {K_DIM}], got [1, 2, {K_DIM}, {V_DIM}]"),
    ):
        call(op, inputs, initial_state=h0, state_v_first=True)


@pytest.mark.parametrize("op", V_FIRST_OPS)
def test_state_v_first_accepts_v_first_state(op):
    inputs = make_inputs(op)
    h0 = state(1, 2, v_first=True)
    o1, ht1 = call(op, inputs, initial_state=h0, state_v_first=True, output_final_state=True)
    o0, ht0 = call(op, inputs, initial_state=h0.transpose(-1, -2).contiguous(), output_final_state=True)
    assert ht1.shape == (1, 2, V_DIM, K_DIM)
    torch.testing.assert_close(o1, o0)
    torch.testing.assert_close(ht1, ht0.transpose(-1, -2))


@pytest.mark.parametrize("op", ALL)
def test_initial_state_count_with_cu_seqlens(op):
    """With cu_seqlens there is one initial state per packed sequence."""
    inputs = make_inputs(op, T=10)
    cu = torch.tensor([0, 4, 10])
    with pytest.raises(InputValidationError, match=lit("`initial_state` must have shape [N, HV, K, V] = [2, 2,")):
        call(op, inputs, initial_state=state(1, 2), cu_seqlens=cu)


# -------------------------------------------------------------- cu_seqlens


@pytest.mark.parametrize("op", ALL)
def test_cu_seqlens_with_batch_above_one(op):
    inputs = make_inputs(op, B=2, T=10)
    with pytest.raises(InputValidationError, match=lit("the batch size must be 1 (sequences packed along T), got B=2")):
        call(op, inputs, cu_seqlens=torch.tensor([0, 4, 10]))


@pytest.mark.parametrize("op", ALL)
@pytest.mark.parametrize(
    "cu", [[1, 10], [0, 4, 9], [0, 4, 12], [0, 6, 4, 10]],
    ids=["not_from_0", "short_of_T", "past_T", "decreasing"],
)
def test_cu_seqlens_bad_offsets(op, cu):
    inputs = make_inputs(op, T=10)
    with pytest.raises(
        InputValidationError, match=lit(f"`cu_seqlens` must start at 0, end at T=10 and never decrease, got {cu}")
    ):
        call(op, inputs, cu_seqlens=torch.tensor(cu))


@pytest.mark.parametrize("op", ALL)
def test_cu_seqlens_single_offset(op):
    inputs = make_inputs(op, T=10)
    with pytest.raises(InputValidationError, match=lit("`cu_seqlens` must hold at least [0, T], got 1 value(s).")):
        call(op, inputs, cu_seqlens=torch.tensor([10]))


@pytest.mark.parametrize("op", ALL)
@pytest.mark.parametrize(
    "cu", [torch.tensor([0.0, 4.0, 10.0]), torch.tensor([[0, 4, 10]]), [0, 4, 10]], ids=["float", "2d", "list"]
)
def test_cu_seqlens_wrong_type(op, cu):
    inputs = make_inputs(op, T=10)
    with pytest.raises(InputValidationError, match=lit("`cu_seqlens` must be a 1-D integer tensor")):
        call(op, inputs, cu_seqlens=cu)


@pytest.mark.parametrize("op", ALL)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_cu_seqlens_int_dtypes_accepted(op, dtype):
    """Packed sequences equal separate calls, whichever integer dtype."""
    inputs = make_inputs(op, T=10)
    o, ht = call(op, inputs, cu_seqlens=torch.tensor([0, 4, 10], dtype=dtype), output_final_state=True)
    assert ht.shape[0] == 2
    for i, (a, b) in enumerate(((0, 4), (4, 10))):
        alone = {n: x[:, a:b] for n, x in inputs.items()}
        o_alone, ht_alone = call(op, alone, output_final_state=True)
        torch.testing.assert_close(o[:, a:b], o_alone)
        torch.testing.assert_close(ht[i:i + 1], ht_alone)


# -------------------------------------------------------------- chunk_size


@pytest.mark.parametrize("op", ALL)
@pytest.mark.parametrize("chunk_size", [16, 32, 128])
def test_unsupported_chunk_size(op, chunk_size):
    inputs = make_inputs(op)
    with pytest.raises(UnsupportedConfigError, match=lit(f"`chunk_size`={chunk_size} is not supported; rewy-hf uses chunk_size=64")):
        call(op, inputs, chunk_size=chunk_size)


# ------------------------------------------------------------ finite check


def _with_nan(op, name):
    inputs = make_inputs(op)
    x = inputs[name].clone()
    x.view(-1)[3] = float("nan")
    inputs[name] = x
    return inputs


FINITE_CASES = [(op, name) for op in ALL for name in make_inputs(op)]


@pytest.mark.parametrize("op,name", FINITE_CASES, ids=[f"{o}-{n}" for o, n in FINITE_CASES])
def test_nan_rejected_with_check_finite(op, name, monkeypatch):
    monkeypatch.setenv("REWY_HF_CHECK_FINITE", "1")
    with pytest.raises(InputValidationError, match=lit(f"`{name}` has 1 non-finite values (NaN or Inf)")):
        call(op, _with_nan(op, name))


@pytest.mark.parametrize("op", ALL)
def test_inf_in_initial_state_rejected_with_check_finite(op, monkeypatch):
    monkeypatch.setenv("REWY_HF_CHECK_FINITE", "1")
    h0 = state(1, 2)
    h0[0, 0, 0, 0] = float("inf")
    with pytest.raises(InputValidationError, match=lit("`initial_state` has 1 non-finite values")):
        call(op, make_inputs(op), initial_state=h0)


@pytest.mark.parametrize("op", ALL)
@pytest.mark.parametrize("value", [None, "0", ""], ids=["unset", "zero", "empty"])
def test_nan_passes_without_check_finite(op, value, monkeypatch):
    """The finite check is opt-in: without it the op runs and the NaN reaches the output."""
    if value is None:
        monkeypatch.delenv("REWY_HF_CHECK_FINITE", raising=False)
    else:
        monkeypatch.setenv("REWY_HF_CHECK_FINITE", value)
    o, _ = call(op, _with_nan(op, "q"))
    assert torch.isnan(o).any()


# ------------------------------------------------------- keyword arguments


@pytest.mark.parametrize("op", ALL)
@pytest.mark.parametrize("kw", ["foo", "initial_states", "chunk_idx"])
def test_unknown_keyword(op, kw):
    inputs = make_inputs(op)
    with pytest.raises(UnsupportedConfigError, match=lit(f"unsupported keyword argument(s) ['{kw}']")):
        call(op, inputs, **{kw: 1})


@pytest.mark.parametrize("op", ALL)
def test_unknown_keyword_names_the_op(op):
    inputs = make_inputs(op)
    fn_name = OPS[op].__name__
    with pytest.raises(UnsupportedConfigError, match=lit(f"{fn_name}: unsupported keyword argument(s)")):
        call(op, inputs, foo=1)


@pytest.mark.parametrize("op", ALL)
@pytest.mark.parametrize("value", [True, False])
def test_head_first(op, value):
    inputs = make_inputs(op)
    with pytest.raises(UnsupportedConfigError, match=lit("`head_first` was removed in FLA; pass inputs as [B, T, H, D]")):
        call(op, inputs, head_first=value)


def test_cp_context_delta_rule():
    """FLA's DeltaNet has no context parallelism, so neither does rewy's."""
    with pytest.raises(UnsupportedConfigError, match=lit("cp_context")):
        call("delta_rule", make_inputs("delta_rule"), cp_context=object())


def _context(**changes):
    # A stand-in group: these calls are refused before any exchange.
    fields = dict(group=SimpleNamespace(group_name="stand-in"), cu_seqlens=torch.tensor([0, 10]), cu_seqlens_cpu=None,
                  is_first_rank=True, is_last_rank=True, pre_num_ranks=0, post_num_ranks=0, layout="contiguous")
    return SimpleNamespace(**{**fields, **changes})


@pytest.mark.parametrize("op", V_FIRST_OPS)
@pytest.mark.parametrize("context,kwargs,fragment", [
    (object(), {}, "cp_context must be FLA's context, got object"),
    (_context(layout="zigzag"), {}, "layout='zigzag' is not supported"),
    (_context(cu_seqlens=None), {}, "cp_context has no cu_seqlens"),
    (_context(), dict(output_final_state=True), "no initial_state and no final state"),
])
def test_cp_context_refused(op, context, kwargs, fragment):
    with pytest.raises(UnsupportedConfigError, match=lit(fragment)):
        call(op, make_inputs(op), cp_context=context, **kwargs)


@pytest.mark.parametrize("op", V_FIRST_OPS)
def test_cp_context_needs_one_row(op):
    with pytest.raises(UnsupportedConfigError, match=lit("takes packed input, B = 1 (got B = 2)")):
        call(op, make_inputs(op, B=2), cp_context=_context())


@pytest.mark.parametrize("op", V_FIRST_OPS)
def test_cp_context_without_group_is_refused(op):
    """FLA runs a context without a process group as a plain packed call: each rank's slice alone,
    from a zero state, which is not the row's result."""
    with pytest.raises(UnsupportedConfigError, match=lit(
            "cp_context has no process group (group=None), so no rank could receive the state of the sequences it "
            "continues. Build it with fla.ops.cp.build_cp_context(cu_seqlens, group=<the context-parallel process "
            "group>)")):
        call(op, make_inputs(op), cp_context=_context(group=None, cu_seqlens=torch.tensor([0, 4, 10])))


@pytest.mark.parametrize("op", V_FIRST_OPS)
@pytest.mark.parametrize("changes,fragment", [
    (dict(cu_seqlens=torch.tensor([0, 6, 4, 10])), "its local bounds [0, 6, 4, 10] do not run from 0 up"),
    (dict(is_first_rank=False), "its chain position contradicts itself (is_first_rank=False, pre_num_ranks=0"),
    (dict(is_last_rank=True, post_num_ranks=1), "its chain position contradicts itself"),
])
def test_cp_context_that_no_row_makes_is_refused(op, changes, fragment):
    """FLA builds such contexts from bounds that decrease somewhere."""
    with pytest.raises(UnsupportedConfigError, match=lit(f"cp_context cannot come from one packed row: {fragment}")):
        call(op, make_inputs(op), cp_context=_context(**changes))


@pytest.mark.parametrize("op", V_FIRST_OPS)
@pytest.mark.parametrize("bounds", [[0, 2, 5], [0, 20]])
def test_cp_context_names_the_ranks_slice(op, bounds):
    """Not the core's complaint about cu_seqlens, an argument the caller never passed."""
    part, whole = bounds[-1], " (the whole row?)" if bounds[-1] == 5 else ""
    with pytest.raises(InputValidationError, match=lit(
            f"context parallelism: this rank's inputs hold 10 tokens{whole}, but cp_context gives it a slice of "
            f"{part} tokens of the packed row. Pass each rank only its own slice")):
        call(op, make_inputs(op), cp_context=_context(cu_seqlens=torch.tensor(bounds)))


@pytest.mark.parametrize("op", ALL)
def test_return_intermediate_states(op):
    inputs = make_inputs(op)
    with pytest.raises(UnsupportedConfigError, match=lit("return_intermediate_states")):
        call(op, inputs, return_intermediate_states=True)


@pytest.mark.parametrize("op", VECTOR_GATE_OPS)
def test_refused_options_at_default_are_fine(op):
    call(op, make_inputs(op), cp_context=None, return_intermediate_states=False)


def test_kda_use_graph():
    inputs = make_inputs("kda")
    with pytest.raises(UnsupportedConfigError, match=lit("chunk_kda: `use_graph`=True is not supported")):
        chunk_kda(**inputs, use_graph=True)


# ---------------------------------------------------------- backend, policy


@pytest.mark.parametrize("op", ALL)
def test_triton_backend_needs_cuda(op):
    inputs = make_inputs(op)
    with pytest.raises(UnsupportedConfigError, match=lit("`backend`='triton' needs CUDA tensors, got tensors on cpu")):
        call(op, inputs, backend="triton")


@pytest.mark.parametrize("op", ALL)
@pytest.mark.parametrize("backend", ["cuda", "Torch", ""])
def test_unknown_backend(op, backend):
    inputs = make_inputs(op)
    with pytest.raises(UnsupportedConfigError, match=lit(f"`backend`={backend!r} is unknown; choose one of")):
        call(op, inputs, backend=backend)


@pytest.mark.parametrize("op", ALL)
@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("policy", [None, "recompute", "full"])
def test_known_backend_and_policy_run(op, backend, policy):
    o, _ = call(op, make_inputs(op), backend=backend, policy=policy)
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("op", ALL)
@pytest.mark.parametrize("policy", ["fast", "Full", "none"])
def test_unknown_policy(op, policy):
    inputs = make_inputs(op)
    with pytest.raises(UnsupportedConfigError, match=lit(f"`policy`={policy!r} is unknown; choose one of")):
        call(op, inputs, policy=policy)


@pytest.mark.parametrize("op", ALL)
def test_disable_recompute_with_recompute_policy(op):
    inputs = make_inputs(op)
    with pytest.raises(UnsupportedConfigError, match=lit("`disable_recompute=True` means policy='full' but policy='recompute'")):
        call(op, inputs, disable_recompute=True, policy="recompute")


@pytest.mark.parametrize("op", ALL)
def test_disable_recompute_alone_and_with_full(op):
    inputs = make_inputs(op)
    o_ref, _ = call(op, inputs)
    for kwargs in ({"disable_recompute": True}, {"disable_recompute": True, "policy": "full"}):
        o, _ = call(op, inputs, **kwargs)
        torch.testing.assert_close(o, o_ref)


# ------------------------------------------------------ activations, gates


@pytest.mark.parametrize("op", NEG_EIGVAL_OPS)
def test_allow_neg_eigval_without_beta_sigmoid(op):
    inputs = make_inputs(op)
    with pytest.raises(UnsupportedConfigError, match=lit("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`")):
        call(op, inputs, allow_neg_eigval=True)


@pytest.mark.parametrize("op", NEG_EIGVAL_OPS)
def test_allow_neg_eigval_with_beta_sigmoid_runs(op):
    o, _ = call(op, make_inputs(op), allow_neg_eigval=True, use_beta_sigmoid_in_kernel=True)
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("op", ["gdn", "kda", "gdn2"])
def test_gate_in_kernel_without_A_log(op):
    """GDN always needs A_log; KDA and GDN2 need it unless lower_bound is set."""
    inputs = make_inputs(op)
    with pytest.raises(UnsupportedConfigError, match=lit("`use_gate_in_kernel=True` needs `A_log`")):
        call(op, inputs, use_gate_in_kernel=True)


def test_gdn_gate_in_kernel_without_A_log_even_with_dt_bias():
    inputs = make_inputs("gdn")
    with pytest.raises(UnsupportedConfigError, match=lit("needs `A_log`")):
        chunk_gated_delta_rule(**inputs, use_gate_in_kernel=True, dt_bias=torch.zeros(2))


@pytest.mark.parametrize("op", VECTOR_GATE_OPS)
def test_gate_in_kernel_lower_bound_without_A_log_runs(op):
    o, _ = call(op, make_inputs(op), use_gate_in_kernel=True, lower_bound=-5.0)
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("op", VECTOR_GATE_OPS)
@pytest.mark.parametrize("lower_bound", [None, -5.5, -10.0, 0.0, 0.5])
def test_safe_gate_lower_bound(op, lower_bound):
    inputs = make_inputs(op)
    with pytest.raises(
        UnsupportedConfigError,
        match=lit(f"`safe_gate=True` with `use_gate_in_kernel=True` needs `lower_bound` in [-5, 0), got {lower_bound}"),
    ):
        call(op, inputs, safe_gate=True, use_gate_in_kernel=True, lower_bound=lower_bound,
             A_log=torch.zeros(2))


@pytest.mark.parametrize("op", VECTOR_GATE_OPS)
@pytest.mark.parametrize("lower_bound", [-5.0, -1.0, -1e-3])
def test_safe_gate_lower_bound_in_range_runs(op, lower_bound):
    o, _ = call(op, make_inputs(op), safe_gate=True, use_gate_in_kernel=True, lower_bound=lower_bound,
                A_log=torch.zeros(2))
    assert torch.isfinite(o).all()


# (op, A_log numel, dt_bias numel) with H = HV = 2, K = 4
GATE_PARAM_SIZES = {"gdn": (2, 2), "kda": (2, 2 * K_DIM), "gdn2": (2, 2 * K_DIM)}


@pytest.mark.parametrize("op", list(GATE_PARAM_SIZES))
@pytest.mark.parametrize("bad_numel", [1, 3, 2 * K_DIM + 1])
def test_wrong_A_log_size(op, bad_numel):
    a_numel, bias_numel = GATE_PARAM_SIZES[op]
    inputs = make_inputs(op)
    with pytest.raises(InputValidationError, match=lit(f"`A_log` must have {a_numel} elements (one per head), got shape [{bad_numel}]")):
        call(op, inputs, use_gate_in_kernel=True, A_log=torch.zeros(bad_numel), dt_bias=torch.zeros(bias_numel))


@pytest.mark.parametrize("op", list(GATE_PARAM_SIZES))
@pytest.mark.parametrize("bad_numel", [1, 3, 2 * K_DIM + 1])
def test_wrong_dt_bias_size(op, bad_numel):
    a_numel, bias_numel = GATE_PARAM_SIZES[op]
    inputs = make_inputs(op)
    with pytest.raises(InputValidationError, match=lit(f"`dt_bias` must have {bias_numel} elements, got shape [{bad_numel}]")):
        call(op, inputs, use_gate_in_kernel=True, A_log=torch.zeros(a_numel), dt_bias=torch.zeros(bad_numel))


@pytest.mark.parametrize("op", list(GATE_PARAM_SIZES))
def test_gate_params_right_size_run(op):
    a_numel, bias_numel = GATE_PARAM_SIZES[op]
    o, _ = call(op, make_inputs(op), use_gate_in_kernel=True, A_log=torch.zeros(a_numel),
                dt_bias=torch.zeros(bias_numel))
    assert torch.isfinite(o).all()


def test_kda_gva_dt_bias_sized_by_value_heads():
    """With GVA the gate parameters follow the value heads: A_log [HV], dt_bias [HV * K]."""
    inputs = make_inputs("kda", H=1, HV=2)
    with pytest.raises(InputValidationError, match=lit(f"`dt_bias` must have {2 * K_DIM} elements, got shape [{K_DIM}]")):
        chunk_kda(**inputs, use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(K_DIM))


# ------------------------------------------------- accepted FLA plumbing


def _chunk_indices(cu, chunk=64):
    """FLA's chunk_indices: [num_chunks, 2] rows of (sequence, chunk within it)."""
    rows = [[n, i] for n, (a, b) in enumerate(zip(cu, cu[1:])) for i in range(math.ceil((b - a) / chunk))]
    return torch.tensor(rows, dtype=torch.long)


@pytest.mark.parametrize("op", ALL)
def test_plumbing_keywords_accepted(op):
    """cu_seqlens_cpu, chunk_indices and chunk_size=64 are accepted and change nothing."""
    inputs = make_inputs(op, T=20)
    cu_list = [0, 7, 20]
    cu = torch.tensor(cu_list)
    h0 = state(2, 2)
    o_ref, ht_ref = call(op, inputs, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    o, ht = call(op, inputs, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                 cu_seqlens_cpu=cu.cpu(), chunk_indices=_chunk_indices(cu_list), chunk_size=64)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(ht, ht_ref)


@pytest.mark.parametrize("op", ALL)
def test_chunk_size_64_without_cu_seqlens(op):
    inputs = make_inputs(op)
    torch.testing.assert_close(call(op, inputs, chunk_size=64)[0], call(op, inputs)[0])


@pytest.mark.parametrize("op", V_FIRST_OPS)
def test_transpose_state_layout_deprecated(op):
    """The deprecated name warns and behaves exactly like state_v_first=True."""
    inputs = make_inputs(op)
    h0 = state(1, 2, v_first=True)
    o_ref, ht_ref = call(op, inputs, initial_state=h0, state_v_first=True, output_final_state=True)
    with pytest.warns(DeprecationWarning, match=lit("`transpose_state_layout` is deprecated; use `state_v_first`")):
        o, ht = call(op, inputs, initial_state=h0, transpose_state_layout=True, output_final_state=True)
    assert ht.shape == (1, 2, V_DIM, K_DIM)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(ht, ht_ref)


@pytest.mark.parametrize("op", V_FIRST_OPS)
def test_transpose_state_layout_checks_v_first_shape(op):
    inputs = make_inputs(op)
    with pytest.warns(DeprecationWarning):
        with pytest.raises(InputValidationError, match=lit("`initial_state` must have shape [N, HV, V, K]")):
            call(op, inputs, initial_state=state(1, 2, v_first=False), transpose_state_layout=True)


@pytest.mark.parametrize("op", V_FIRST_OPS)
@pytest.mark.parametrize("value", [True, False])
def test_transpose_state_layout_with_state_v_first(op, value):
    inputs = make_inputs(op)
    with pytest.raises(UnsupportedConfigError, match=lit("pass either `state_v_first` or the deprecated `transpose_state_layout`")):
        call(op, inputs, state_v_first=True, transpose_state_layout=value)


@pytest.mark.parametrize("value", [True, False])
def test_delta_rule_transpose_state_layout_refused(value):
    """chunk_delta_rule has no state_v_first (FLA 0.6.0): its state is always [N, H, K, V].

    A caller asking for the transposed layout must be told it does not exist
    here rather than silently get the K-first layout back.
    """
    inputs = make_inputs("delta_rule")
    with pytest.raises(UnsupportedConfigError, match=lit("transpose_state_layout")):
        chunk_delta_rule(**inputs, transpose_state_layout=value)


def test_delta_rule_state_v_first_refused():
    inputs = make_inputs("delta_rule")
    with pytest.raises(UnsupportedConfigError, match=lit("unsupported keyword argument(s) ['state_v_first']")):
        chunk_delta_rule(**inputs, state_v_first=True)


# ------------------------------------------- gate parameters: type, shape, NaN


@pytest.mark.parametrize("op", list(GATE_PARAM_SIZES))
@pytest.mark.parametrize("name", ["A_log", "dt_bias"])
def test_gate_param_not_a_tensor(op, name):
    """A list instead of a tensor is named, not an AttributeError from deep inside."""
    a_numel, bias_numel = GATE_PARAM_SIZES[op]
    params = {"A_log": torch.zeros(a_numel), "dt_bias": torch.zeros(bias_numel)}
    params[name] = params[name].tolist()
    with pytest.raises(InputValidationError, match=lit(f"`{name}` must be a floating-point torch.Tensor, got list")):
        call(op, make_inputs(op), use_gate_in_kernel=True, **params)


@pytest.mark.parametrize("op", list(GATE_PARAM_SIZES))
def test_gate_params_checked_by_element_count(op):
    """The gate parameters are validated by element count ("must have N elements"),
    so any shape with the right count (e.g. A_log [HV, 1], dt_bias [HV, 1] or
    [HV, K]) must work and give the flat-parameter result, for every op alike;
    never a broadcasting RuntimeError."""
    a_numel, bias_numel = GATE_PARAM_SIZES[op]
    A_log = torch.linspace(-1.0, 1.0, a_numel)
    dt_bias = torch.linspace(-1.0, 1.0, bias_numel)
    inputs = make_inputs(op)
    o_flat, _ = call(op, inputs, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    o, _ = call(op, inputs, use_gate_in_kernel=True, A_log=A_log.reshape(a_numel, 1),
                dt_bias=dt_bias.reshape(a_numel, -1))
    torch.testing.assert_close(o, o_flat)


@pytest.mark.parametrize("op", list(GATE_PARAM_SIZES))
@pytest.mark.parametrize("name", ["A_log", "dt_bias"])
def test_nan_in_gate_params_rejected_with_check_finite(op, name, monkeypatch):
    """A_log / dt_bias are learnable inputs of the op; REWY_HF_CHECK_FINITE=1 must cover them too."""
    monkeypatch.setenv("REWY_HF_CHECK_FINITE", "1")
    a_numel, bias_numel = GATE_PARAM_SIZES[op]
    params = {"A_log": torch.zeros(a_numel), "dt_bias": torch.zeros(bias_numel)}
    params[name][0] = float("nan")
    with pytest.raises(InputValidationError, match=lit(f"`{name}` has 1 non-finite values")):
        call(op, make_inputs(op), use_gate_in_kernel=True, **params)


def test_auto_takes_triton_on_cuda_for_every_supported_call():
    """On CUDA, auto picks the Triton backward for every op, packed sequences
    included. Only what Triton cannot do (float64, key head dims over 256)
    goes to torch."""
    from rewy_hf.ops import triton_unsupported_reason
    from rewy_hf.validation import resolve_backend

    cuda = torch.device("cuda")
    q = torch.empty(1, 64, 2, 128, dtype=torch.bfloat16, device="meta")
    assert triton_unsupported_reason(q) is None
    assert resolve_backend("auto", cuda, triton_unsupported_reason(q)) == "triton"
    for bad, why in ((q.double(), "float64"), (torch.empty(1, 64, 2, 512, device="meta"), "512 > 256")):
        reason = triton_unsupported_reason(bad)
        assert why in reason
        assert resolve_backend("auto", cuda, reason) == "torch"
    assert resolve_backend("auto", torch.device("cpu"), None) == "torch"


# --- zero-sized heads, a bad scale, meta cu_seqlens, double backward --------------------------

@pytest.mark.parametrize("op", ALL)
@pytest.mark.parametrize("dim", ["H", "K", "V"])
def test_zero_sized_heads_are_named(op, dim):
    sizes = dict(H=2, K=K_DIM, V=V_DIM)
    sizes[dim] = 0
    inputs = make_inputs(op, **sizes)
    with pytest.raises(InputValidationError, match="must be at least 1, got 0"):
        call(op, inputs)


@pytest.mark.parametrize("op", ALL)
@pytest.mark.parametrize("scale", ["abc", None.__class__, True, [0.5]], ids=["str", "type", "bool", "list"])
def test_scale_that_is_not_a_number_is_named(op, scale):
    with pytest.raises(InputValidationError, match=lit("`scale` must be a number")):
        call(op, make_inputs(op), scale=scale)


@pytest.mark.parametrize("op", ALL)
def test_scale_tensor_that_requires_grad_is_refused(op):
    with pytest.raises(UnsupportedConfigError, match=lit("`scale` is a tensor that requires grad")):
        call(op, make_inputs(op), scale=torch.tensor(0.25, requires_grad=True))


@pytest.mark.parametrize("op", ALL)
def test_constant_scale_tensor_equals_the_float(op):
    inputs = make_inputs(op)
    o_tensor, _ = call(op, inputs, scale=torch.tensor(0.25))
    o_float, _ = call(op, inputs, scale=0.25)
    assert torch.equal(o_tensor, o_float)


@pytest.mark.parametrize("op", ALL)
def test_non_finite_scale_is_refused(op):
    with pytest.raises(InputValidationError, match=lit("`scale` must be finite, got nan")):
        call(op, make_inputs(op), scale=float("nan"))


@pytest.mark.parametrize("op", ALL)
def test_cu_seqlens_on_meta_device_is_named(op):
    with pytest.raises(InputValidationError, match=lit("`cu_seqlens` is on the meta device")):
        call(op, make_inputs(op, T=10), cu_seqlens=torch.tensor([0, 4, 10], device="meta"))


@pytest.mark.parametrize("op", ALL)
def test_double_backward_is_refused_with_a_clear_error(op):
    inputs = {n: x.clone().requires_grad_() for n, x in make_inputs(op).items()}
    o, _ = call(op, inputs)
    with pytest.raises(UnsupportedConfigError, match=lit("double backward (a gradient with create_graph=True)")):
        torch.autograd.grad(o.square().sum(), [inputs["q"]], create_graph=True)
