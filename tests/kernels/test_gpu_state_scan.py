"""The sequence-parallel state recurrences with per-key gates (KDA's form) against
FLA's sequential kernels on the GPU (GPU only; the GDN form is in
test_gpu_triton_gdn.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rewy_hf.rel_error import rel_err

pytestmark = pytest.mark.gpu


def test_per_key_gate_recurrences_match_fla():
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from fla.ops.utils import chunk_local_cumsum

    from rewy_hf.kernels.triton_state_scan import state_backward, state_forward

    B, T, H, K, V = 1, 4096, 2, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(7)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    gk = chunk_local_cumsum(F.logsigmoid(r(B, T, H, K) + 4), chunk_size=64, scale=1.4426950408889634)
    kg = (F.normalize(r(B, T, H, K), dim=-1) * 0.5).bfloat16()
    qg = r(B, T, H, K).bfloat16()
    w = (0.1 * r(B, T, H, K)).bfloat16()
    u = r(B, T, H, V).bfloat16()
    h0 = 0.3 * r(B, H, K, V)
    h_ref, vn_ref, ht_ref = chunk_gated_delta_rule_fwd_h(k=kg, w=w, u=u, gk=gk, initial_state=h0,
                                                         output_final_state=True, chunk_size=64)
    h, vn, ht = state_forward(kg, w, u, None, h0, NS=8, gk=gk)
    do, dv, dht = r(B, T, H, V).bfloat16(), r(B, T, H, V).bfloat16(), r(B, H, K, V)
    dh_ref, dh0_ref, dv2_ref = chunk_gated_delta_rule_bwd_dhu(q=qg, k=kg, w=w, do=do, dv=dv, gk=gk, h0=h0, dht=dht,
                                                              scale=K ** -0.5, chunk_size=64)
    dh, dh0, dv2 = state_backward(qg, kg, w, do, dv, None, dht, K ** -0.5, NS=8, gk=gk)
    errs = {n: rel_err(a, b) for n, a, b in [("h", h, h_ref), ("v_new", vn, vn_ref), ("ht", ht, ht_ref),
                                          ("dh", dh, dh_ref), ("dh0", dh0, dh0_ref), ("dv2", dv2, dv2_ref)]}
    assert max(errs.values()) <= 1e-2, errs
