"""The float64 reference (rewy_hf.kernels.reference) against FLA 0.6.0's own
plain-torch naive functions, plus the internal identities between the ops.

FLA's naive recurrences compute in float32, so comparisons against them use a
relative tolerance of 1e-5; identities between our own float64 paths use 1e-12.
"""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from rewy_hf.kernels import reference as ref
from rewy_hf.rel_error import rel_err

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # FLA warns that Triton is unavailable on CPU
    from fla.ops.delta_rule.naive import delta_rule_recurrence
    from fla.ops.gated_delta_rule.gate import naive_gdn_gate
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    from fla.ops.gdn2.naive import naive_recurrent_gdn2
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_recurrent_kda

FLA_TOL = 1e-5   # FLA naive functions run in float32
EXACT_TOL = 1e-12  # two float64 paths of ours


def make(seed, B=2, T=29, H=2, HV=None, K=12, V=10, vector_gate=True):
    """Random float32 inputs with realistic decays and l2-normalised keys."""
    HV = HV or H
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    return dict(
        q=r(B, T, H, K),
        k=F.normalize(r(B, T, H, K), dim=-1),
        v=r(B, T, HV, V),
        g=F.logsigmoid(r(B, T, HV, K) if vector_gate else r(B, T, HV)),
        beta=torch.sigmoid(r(B, T, HV)),
        b=torch.sigmoid(r(B, T, HV, K)),
        w=torch.sigmoid(r(B, T, HV, V)),
        h0=0.5 * r(B, HV, K, V),
        raw=r(B, T, HV, K) if vector_gate else r(B, T, HV),
    )


# ---------------------------------------------------------------------------
# Against FLA's naive recurrences
# ---------------------------------------------------------------------------

def test_gdn2_matches_fla_naive():
    d = make(0)
    o_ref, S_ref = naive_recurrent_gdn2(d["q"], d["k"], d["v"], d["g"], d["b"], d["w"],
                                        initial_state=d["h0"], output_final_state=True)
    o, S = ref.naive_gdn2(d["q"], d["k"], d["v"], d["g"], d["b"], d["w"],
                          initial_state=d["h0"], output_final_state=True)
    assert o.dtype == S.dtype == torch.float64
    assert rel_err(o, o_ref) < FLA_TOL and rel_err(S, S_ref) < FLA_TOL


@pytest.mark.parametrize("HV", [2, 4])  # 4: GVA, two value heads per key head
def test_kda_matches_fla_naive(HV):
    d = make(1, H=2, HV=HV)
    scale = 0.3
    o_ref, S_ref = naive_recurrent_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], scale=scale,
                                       initial_state=d["h0"], output_final_state=True)
    o, S = ref.naive_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], scale=scale,
                         initial_state=d["h0"], output_final_state=True)
    assert o.shape == (2, 29, HV, 10) and S.shape == (2, HV, 12, 10)
    assert rel_err(o, o_ref) < FLA_TOL and rel_err(S, S_ref) < FLA_TOL


def test_gdn_matches_fla_naive():
    d = make(2, vector_gate=False)
    # FLA's naive GDN takes (q, k, v, beta, g): beta BEFORE g, unlike chunk_gated_delta_rule.
    o_ref, S_ref = naive_recurrent_gated_delta_rule(d["q"], d["k"], d["v"], d["beta"], d["g"],
                                                    initial_state=d["h0"], output_final_state=True)
    o, S = ref.naive_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"],
                                      initial_state=d["h0"], output_final_state=True)
    assert rel_err(o, o_ref) < FLA_TOL and rel_err(S, S_ref) < FLA_TOL


def test_delta_rule_matches_fla_naive():
    d = make(3)
    # FLA's naive DeltaNet is head-first [B, H, T, D] with a fixed K**-0.5 scale.
    hf = [x.transpose(1, 2) for x in (d["q"], d["k"], d["v"], d["beta"])]
    o_ref, S_ref = delta_rule_recurrence(*hf, initial_state=d["h0"], output_final_state=True)
    o, S = ref.naive_delta_rule(d["q"], d["k"], d["v"], d["beta"],
                                initial_state=d["h0"], output_final_state=True)
    assert rel_err(o, o_ref.transpose(1, 2)) < FLA_TOL and rel_err(S, S_ref) < FLA_TOL


def test_final_state_is_none_unless_requested():
    d = make(4, T=5)
    for out in (ref.naive_kda(d["q"], d["k"], d["v"], d["g"], d["beta"]),
                ref.naive_gdn2(d["q"], d["k"], d["v"], d["g"], d["b"], d["w"], initial_state=d["h0"])):
        assert out[1] is None and out[0].dtype == torch.float64


# ---------------------------------------------------------------------------
# Gate / beta / l2norm helpers
# ---------------------------------------------------------------------------

def test_gate_helpers_match_fla():
    gen = torch.Generator().manual_seed(5)
    H, K = 3, 8
    g = 2 * torch.randn(4, 6, H, K, generator=gen)
    A_log = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen)
    out = ref.kda_gate(g, A_log, dt_bias)
    assert out.dtype == torch.float32  # helpers keep the input dtype
    assert rel_err(out, naive_kda_gate(g, A_log, dt_bias)) < 1e-6
    assert rel_err(ref.kda_gate(g, A_log), naive_kda_gate(g, A_log)) < 1e-6
    for A in (A_log, None):
        for lb in (-5.0, -2.0):
            expect = naive_kda_lowerbound_gate(g, A, dt_bias, lower_bound=lb)
            assert rel_err(ref.kda_gate(g, A, dt_bias, lower_bound=lb), expect) < 1e-6
    gs = 2 * torch.randn(4, 6, H, generator=gen)
    dt_s = torch.randn(H, generator=gen)
    assert ref.gdn_gate(gs, A_log, dt_s).dtype == torch.float32
    assert rel_err(ref.gdn_gate(gs, A_log, dt_s), naive_gdn_gate(gs, A_log, dt_s)) < 1e-6
    assert rel_err(ref.gdn_gate(gs, A_log), naive_gdn_gate(gs, A_log)) < 1e-6
    # float64 in, float64 out (no forced dtype)
    assert ref.kda_gate(g.double(), A_log.double(), dt_bias.double()).dtype == torch.float64


def test_beta_and_l2norm_helpers():
    x = torch.randn(5, 7, dtype=torch.float32)
    assert torch.allclose(ref.beta_activation(x), torch.sigmoid(x))
    assert torch.allclose(ref.beta_activation(x, allow_neg_eigval=True), 2 * torch.sigmoid(x))
    y = ref.l2norm(x)
    assert y.dtype == torch.float32
    assert torch.allclose(y, x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6))
    tiny = torch.zeros(1, 4)  # eps keeps the zero vector finite
    assert torch.equal(ref.l2norm(tiny), tiny)


def test_kda_in_kernel_options_match_fla_preprocessing():
    d = make(6, H=2, HV=4)
    HV, K = 4, 12
    gen = torch.Generator().manual_seed(60)
    A_log, dt_bias = torch.randn(HV, generator=gen), torch.randn(HV * K, generator=gen)
    q_raw, k_raw = 3 * d["q"], 3 * d["k"]
    norm = lambda x: x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    for lb in (None, -3.0):
        g_fla = (naive_kda_gate(d["raw"], A_log, dt_bias) if lb is None
                 else naive_kda_lowerbound_gate(d["raw"], A_log, dt_bias, lower_bound=lb))
        o_ref, S_ref = naive_recurrent_kda(norm(q_raw), norm(k_raw), d["v"], g_fla, 2 * torch.sigmoid(d["beta"]),
                                           initial_state=d["h0"], output_final_state=True)
        o, S = ref.naive_kda(q_raw, k_raw, d["v"], d["raw"], d["beta"], initial_state=d["h0"],
                             output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                             use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, lower_bound=lb,
                             A_log=A_log, dt_bias=dt_bias)
        assert rel_err(o, o_ref) < FLA_TOL and rel_err(S, S_ref) < FLA_TOL
    # lower_bound takes effect with safe_gate=False too, and is ignored without the in-kernel gate
    args = (d["q"], d["k"], d["v"], d["g"], d["beta"])
    base = ref.naive_kda(*args)[0]
    assert torch.equal(ref.naive_kda(*args, lower_bound=-1.0)[0], base)
    with pytest.raises(ValueError):
        ref.naive_kda(*args, allow_neg_eigval=True)
    with pytest.raises(ValueError):
        ref.naive_kda(*args, use_gate_in_kernel=True, safe_gate=True, A_log=A_log)


def test_gdn2_in_kernel_gate_matches_fla_preprocessing():
    d = make(7)
    H, K = 2, 12
    gen = torch.Generator().manual_seed(70)
    A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H * K, generator=gen)
    for lb, A in ((None, A_log), (-4.0, A_log), (-4.0, None)):
        g_fla = (naive_kda_gate(d["raw"], A, dt_bias) if lb is None
                 else naive_kda_lowerbound_gate(d["raw"], A, dt_bias, lower_bound=lb))
        o_ref, _ = naive_recurrent_gdn2(d["q"], d["k"], d["v"], g_fla, d["b"], d["w"])
        o, _ = ref.naive_gdn2(d["q"], d["k"], d["v"], d["raw"], d["b"], d["w"], use_gate_in_kernel=True,
                              lower_bound=lb, safe_gate=lb is not None, A_log=A, dt_bias=dt_bias)
        assert rel_err(o, o_ref) < FLA_TOL


def test_gdn_in_kernel_gate_matches_fla_preprocessing():
    d = make(8, vector_gate=False)
    H = 2
    gen = torch.Generator().manual_seed(80)
    A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H, generator=gen)
    g_fla = naive_gdn_gate(d["raw"], A_log, dt_bias)
    o_ref, S_ref = naive_recurrent_gated_delta_rule(d["q"], d["k"], d["v"], torch.sigmoid(d["beta"]), g_fla,
                                                    initial_state=d["h0"], output_final_state=True)
    o, S = ref.naive_gated_delta_rule(d["q"], d["k"], d["v"], d["raw"], d["beta"], initial_state=d["h0"],
                                      output_final_state=True, use_beta_sigmoid_in_kernel=True,
                                      use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    assert rel_err(o, o_ref) < FLA_TOL and rel_err(S, S_ref) < FLA_TOL


# ---------------------------------------------------------------------------
# Layout: cu_seqlens and state_v_first
# ---------------------------------------------------------------------------

def _call(op, d, **kw):
    if op == "delta":
        return ref.naive_delta_rule(d["q"], d["k"], d["v"], d["beta"], **kw)
    if op == "gdn":
        return ref.naive_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], **kw)
    if op == "kda":
        return ref.naive_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], **kw)
    return ref.naive_gdn2(d["q"], d["k"], d["v"], d["g"], d["b"], d["w"], **kw)


@pytest.mark.parametrize("op", ["delta", "gdn", "kda", "gdn2"])
def test_cu_seqlens_equals_separate_runs(op):
    lens = [7, 19, 13]
    d = make(9, B=1, T=sum(lens), vector_gate=op != "gdn")
    h0 = 0.5 * torch.randn(3, *d["h0"].shape[1:], generator=torch.Generator().manual_seed(90))
    cu = torch.tensor([0, 7, 26, 39], dtype=torch.long)
    o, S = _call(op, d, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert S.shape[0] == 3
    for n in range(3):
        s, e = int(cu[n]), int(cu[n + 1])
        piece = {key: (x[:, s:e] if key not in ("h0",) else x) for key, x in d.items()}
        o_n, S_n = _call(op, piece, initial_state=h0[n:n + 1], output_final_state=True)
        assert rel_err(o[:, s:e], o_n) < EXACT_TOL and rel_err(S[n:n + 1], S_n) < EXACT_TOL


@pytest.mark.parametrize("op", ["gdn", "kda", "gdn2"])
def test_state_v_first_transposes_states(op):
    d = make(10, vector_gate=op != "gdn")
    o, S = _call(op, d, initial_state=d["h0"], output_final_state=True)
    o_t, S_t = _call(op, d, initial_state=d["h0"].transpose(-1, -2).contiguous(),
                     output_final_state=True, state_v_first=True)
    assert S_t.shape == (2, 2, 10, 12)
    assert torch.equal(o_t, o) and torch.equal(S_t, S.transpose(-1, -2))


# ---------------------------------------------------------------------------
# The ops are special cases of each other
# ---------------------------------------------------------------------------

def test_kda_is_gdn2_with_broadcast_beta():
    d = make(11)
    o, S = _call("kda", d, initial_state=d["h0"], output_final_state=True)
    beta = d["beta"].unsqueeze(-1)
    o2, S2 = ref.naive_gdn2(d["q"], d["k"], d["v"], d["g"], beta.expand(-1, -1, -1, 12),
                            beta.expand(-1, -1, -1, 10), initial_state=d["h0"], output_final_state=True)
    assert rel_err(o, o2) < EXACT_TOL and rel_err(S, S2) < EXACT_TOL


def test_gdn_is_kda_with_broadcast_gate():
    d = make(12, H=2, HV=4, vector_gate=False)
    o, S = _call("gdn", d, initial_state=d["h0"], output_final_state=True)
    g_vec = d["g"].unsqueeze(-1).expand(-1, -1, -1, 12)
    o2, S2 = ref.naive_kda(d["q"], d["k"], d["v"], g_vec, d["beta"], initial_state=d["h0"], output_final_state=True)
    assert rel_err(o, o2) < EXACT_TOL and rel_err(S, S2) < EXACT_TOL


def test_delta_rule_is_gdn_with_zero_gate():
    d = make(13, vector_gate=False)
    o, S = _call("delta", d, initial_state=d["h0"], output_final_state=True)
    o2, S2 = ref.naive_gated_delta_rule(d["q"], d["k"], d["v"], torch.zeros_like(d["g"]), d["beta"],
                                        initial_state=d["h0"], output_final_state=True)
    assert rel_err(o, o2) < EXACT_TOL and rel_err(S, S2) < EXACT_TOL


def test_reference_is_differentiable():
    d = make(14, T=9)
    leaves = {key: d[key].clone().requires_grad_() for key in ("q", "k", "v", "g", "b", "w", "h0")}
    o, S = ref.naive_gdn2(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["b"], leaves["w"],
                          initial_state=leaves["h0"], output_final_state=True)
    (o.sum() + S.square().sum()).backward()
    for key, x in leaves.items():
        assert x.grad is not None and x.grad.dtype == torch.float32 and x.grad.abs().sum() > 0, key


def test_rel_err_of_a_nan_or_inf_is_infinite():
    """A NaN-filled (unwritten) output must fail any tolerance, also inside max() over several
    errors, where a NaN after the first element would be skipped."""
    ref = torch.ones(4)
    for bad in (float("nan"), float("inf")):
        x = ref.clone()
        x[2] = bad
        assert rel_err(x, ref) == math.inf and rel_err(ref, x) == math.inf
        assert max([rel_err(ref, ref), rel_err(x, ref)]) == math.inf
    assert rel_err(ref * (1 + 1e-7), ref) < 1e-6 and rel_err(torch.zeros(3), torch.zeros(3)) == 0.0
