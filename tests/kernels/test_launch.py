"""kernels/triton_backend/launch.py and fla_stages.py, under TRITON_INTERPRET=1 on CPU.

A direct launch must run the config the kernel's autotuner picked for the call's key, with the
kernel's heuristics applied, and must fall back to the autotuner's own path whenever it has no
pick (a new key, picks forgotten by the bench) or cannot rebuild the autotuner's key. FLA's local
value gradient launched by rewy must equal FLA's own function; the state recurrences, which do not
run under the interpreter, must get the same arguments and grid as FLA gives them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rewy_hf.kernels.constants import RCP_LN2
from rewy_hf.kernels.triton_backend import fla_stages, launch, state_launch


@triton.heuristics({"HAS_B": lambda args: args["b"] is not None})
@triton.autotune(configs=[triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})], key=["n"])
@triton.jit
def _scaled_add(a, b, out, width, n, SCALE: tl.constexpr, BLOCK: tl.constexpr, HAS_B: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(a + offs, mask=m, other=0.0) * SCALE
    if HAS_B:
        x += tl.load(b + offs, mask=m, other=0.0)
    tl.store(out + offs, x, mask=m)
    tl.store(width + tl.program_id(0), BLOCK)       # which config ran


def _tuner():
    tuner = _scaled_add.fn
    # rewy's test setup cuts every autotuner to its first config; this kernel needs its two
    tuner.configs = list(getattr(tuner, "listed_configs", tuner.configs))
    tuner.cache.clear()
    return tuner


def _counting(monkeypatch, tuner):
    calls = []
    run = tuner.run

    def counted(*args, **kwargs):
        calls.append(kwargs.get("n"))
        return run(*args, **kwargs)

    monkeypatch.setattr(tuner, "run", counted)
    return calls


def _launch(a, b, n, widths=None):
    out = torch.full_like(a, float("nan"))
    width = torch.zeros(n, dtype=torch.int32)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]),)   # noqa: E731
    launch.launch(_scaled_add, grid, a=a, b=b, out=out, width=width, n=n, SCALE=2.0)
    if widths is not None:
        widths.append(int(width[0]))
    return out


def test_a_tuned_key_skips_the_autotuner_and_runs_its_pick(monkeypatch):
    """The interpreter cannot time configs, so the pick is stored under the key Triton's autotuner
    builds (key arguments, then each tensor's dtype): the first launch goes through the autotuner
    (and checks that rewy's key rule finds that pick), the later ones do not, and the heuristic
    (HAS_B from b) is applied on both paths."""
    tuner = _tuner()
    monkeypatch.setattr(_scaled_add, "_rewy_direct_plan", False, raising=False)   # a fresh plan, key rule unchecked
    a, b = torch.arange(40.0), torch.ones(40)
    n = 40
    key = (n, "torch.float32", "torch.float32", "torch.float32", "torch.int32")
    tuner.cache[key] = tuner.configs[1]
    calls, widths = _counting(monkeypatch, tuner), []
    first = _launch(a, b, n, widths)
    assert calls == [n]
    second = _launch(a, b, n, widths)
    assert calls == [n], "the second launch went through the autotuner"
    assert torch.equal(first, 2 * a + 1) and torch.equal(second, first)
    assert widths == [32, 32], "the pick (BLOCK 32) must run on both paths"
    # b None: one dtype fewer in the key, and the heuristic HAS_B False
    tuner.cache[(n, "torch.float32", "torch.float32", "torch.int32")] = tuner.configs[0]
    assert torch.equal(_launch(a, None, n, widths), 2 * a) and widths[-1] == 16
    tuner.cache[key] = tuner.configs[0]                            # another pick under the same key
    assert torch.equal(_launch(a, b, n, widths), first) and widths[-1] == 16
    assert calls == [n]
    tuner.cache.clear()                                            # what the bench's forget_picks does
    with pytest.raises(RuntimeError, match="active drivers"):      # no pick: the autotuner tries to time its
        _launch(a, b, n)                                           # two configs, which the interpreter cannot
    assert calls == [n, n], "without a pick the launch must go through the autotuner"


def test_direct_launches_leave_the_configs_as_tritons_disk_cache_rebuilds_them(monkeypatch):
    """With TRITON_CACHE_AUTOTUNING=1 Triton stores each config's attributes and rebuilds the
    config with Config(**attributes): after direct launches every config of the autotuner must
    still rebuild that way, to an equal config (an attribute added by rewy once broke the next
    autotune of an H200 run with that cache on)."""
    tuner = _tuner()
    monkeypatch.setattr(_scaled_add, "_rewy_direct_plan", False, raising=False)
    a, b, n = torch.arange(40.0), torch.ones(40), 40
    for pick in tuner.configs:
        tuner.cache[(n, "torch.float32", "torch.float32", "torch.float32", "torch.int32")] = pick
        for _ in range(2):                                         # the second launch is the direct one
            _launch(a, b, n)
    for config in tuner.configs:
        rebuilt = triton.Config(**config.__dict__)
        assert rebuilt.all_kwargs() == config.all_kwargs()
    tuner.cache.clear()


def test_a_key_rule_that_does_not_match_is_never_used(monkeypatch):
    """If rewy's key differs from the one the autotuner stored (another Triton version's rule),
    the direct path is switched off for that kernel, with a warning ("rewy's direct launch: ..."),
    not guessed at."""
    tuner = _tuner()
    a, b, n = torch.arange(24.0), torch.zeros(24), 24
    tuner.cache[(n, "torch.float32", "torch.float32", "torch.float32", "torch.int32")] = tuner.configs[0]
    monkeypatch.setattr(launch._Plan, "key", lambda self, args: ("not", "triton's", "key"))
    monkeypatch.setattr(_scaled_add, "_rewy_direct_plan", False, raising=False)   # planned afresh, then dropped
    calls = _counting(monkeypatch, tuner)
    with pytest.warns(RuntimeWarning, match="^rewy's direct launch: .*_scaled_add stores its picks under another key"):
        assert torch.equal(_launch(a, b, n), 2 * a)
    for _ in range(2):
        assert torch.equal(_launch(a, b, n), 2 * a)
    assert calls == [n, n, n]
    assert launch._plan(_scaled_add).usable is False


def _gdn_chunk_inputs(T=150, H=1, HV=2, K=32, V=16, seed=0):
    """Inputs of FLA's chunk stages as rewy's GDN forward makes them (log2 chunk cumsum, A)."""
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum

    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, HV, V, generator=gen)
    g = chunk_local_cumsum(F.logsigmoid(torch.randn(1, T, HV, generator=gen)), chunk_size=64, scale=RCP_LN2)
    beta = torch.rand(1, T, HV, generator=gen)
    do = torch.randn(1, T, HV, V, generator=gen)
    _, _, A = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, chunk_size=64)
    return q, k, v, g, beta, A, do


@pytest.mark.parametrize("packed", [False, True])
def test_flas_local_dv_launched_by_rewy_equals_flas_function(packed):
    """Bit for bit, with and without the gate (GDN, DeltaNet), rows or packed sequences."""
    from fla.ops.common.chunk_o import chunk_bwd_dv_local

    q, k, v, g, beta, A, do = _gdn_chunk_inputs()
    from nan_fill import nan_filled

    pk = dict(cu_seqlens=torch.tensor([0, 70, 150])) if packed else {}
    with pytest.MonkeyPatch.context() as mp:
        nan_filled(mp)                      # a tile neither side writes cannot match as zeros
        for gate in (g, None):
            ours = fla_stages.dv_local(q=q, k=k, do=do, g=gate, scale=0.3, **pk)
            theirs = chunk_bwd_dv_local(q=q, k=k, do=do, g=gate, scale=0.3, chunk_size=64, **pk)
            assert torch.isfinite(ours).all() and torch.equal(ours, theirs)


@pytest.mark.parametrize("packed", [False, True])
def test_flas_forward_stages_launched_by_rewy_equal_flas_functions(packed):
    """The gate cumsum (head-wise and key-wise), GDN's intra-chunk stage and output, and KDA / GDN2's
    output (both state layouts), bit for bit against FLA's stage functions; outputs of rewy's side
    start NaN-filled (the cumsum, w, u, o: torch.empty)."""
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
    from fla.ops.utils import chunk_local_cumsum

    from nan_fill import nan_filled

    gen = torch.Generator().manual_seed(4)
    T, H, HV, K, V = 150, 1, 2, 32, 16
    pk = dict(cu_seqlens=torch.tensor([0, 70, 150])) if packed else {}
    NT = 4 if packed else 3                 # sequences of 70 and 80 tokens: two chunks each
    with pytest.MonkeyPatch.context() as mp:
        nan_filled(mp)
        for shape in ((1, T, HV), (1, T, HV, K)):
            raw = F.logsigmoid(torch.randn(*shape, generator=gen))
            ours = fla_stages.gate_cumsum(raw, scale=RCP_LN2, **pk)
            theirs = chunk_local_cumsum(raw, chunk_size=64, scale=RCP_LN2, **pk)
            assert ours.dtype == torch.float32 and torch.equal(ours, theirs), shape

        q, k, v, g, beta, _, _ = _gdn_chunk_inputs(T, H, HV, K, V)
        for gate in (g, None):
            ours = fla_stages.gdn_intra(k, v, gate, beta, **pk)
            theirs = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=gate, beta=beta, chunk_size=64, **pk)
            assert all(torch.isfinite(x).all() and torch.equal(x, y) for x, y in zip(ours, theirs))

            h = torch.randn(1, NT, HV, K, V, generator=gen)
            ours = fla_stages.gdn_output(q, k, v, h, gate, 0.3, **pk)
            theirs = chunk_fwd_o(q=q, k=k, v=v, h=h, g=gate, scale=0.3, chunk_size=64, **pk)
            assert torch.isfinite(ours).all() and torch.equal(ours, theirs)

        gk = chunk_local_cumsum(F.logsigmoid(torch.randn(1, T, HV, K, generator=gen)), chunk_size=64, scale=RCP_LN2,
                                **pk)
        qv = torch.randn(1, T, HV, K, generator=gen)
        A = torch.randn(1, T, HV, 64, generator=gen)
        for v_first in (False, True):
            h = torch.randn(1, NT, HV, *((V, K) if v_first else (K, V)), generator=gen)
            ours = fla_stages.vector_output(qv, v, gk, A, h, 0.3, state_v_first=v_first, **pk)
            theirs = chunk_gla_fwd_o_gk(q=qv, v=v, g=gk, A=A, h=h, scale=0.3, state_v_first=v_first, chunk_size=64,
                                        **pk)
            assert torch.isfinite(ours).all() and torch.equal(ours, theirs), v_first


@pytest.mark.parametrize("packed", [False, True])
def test_flas_kda_backward_stages_launched_by_rewy_equal_flas_functions(packed):
    """KDA's rebuild of w, u, qg, kg (with and without q) and KDA / GDN2's local dv with dAqk, bit for bit
    against FLA's stage functions, outputs NaN-filled first."""
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv
    from fla.ops.kda.wy_fast import recompute_w_u_fwd
    from fla.ops.utils import chunk_local_cumsum

    from nan_fill import nan_filled

    gen = torch.Generator().manual_seed(6)
    T, H, K, V = 150, 2, 32, 16
    pk = dict(cu_seqlens=torch.tensor([0, 70, 150])) if packed else {}
    r = lambda *shape: torch.randn(*shape, generator=gen)   # noqa: E731
    q, k, v, do = r(1, T, H, K), F.normalize(r(1, T, H, K), dim=-1), r(1, T, H, V), r(1, T, H, V)
    gk = chunk_local_cumsum(F.logsigmoid(r(1, T, H, K)), chunk_size=64, scale=RCP_LN2, **pk)
    beta = torch.rand(1, T, H, generator=gen)
    A = r(1, T, H, 64) * 0.1
    with pytest.MonkeyPatch.context() as mp:
        nan_filled(mp)
        for query in (q, None):
            ours = fla_stages.kda_recompute(k, v, beta, A, gk, q=query, **pk)
            theirs = recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, gk=gk, q=query, **pk)
            assert (ours[2] is None) == (query is None)
            assert all(x is None and y is None or torch.isfinite(x).all() and torch.equal(x, y)
                       for x, y in zip(ours, theirs))
        ours = fla_stages.vector_dAv(q, k, v, do, A, 0.3, **pk)
        theirs = chunk_kda_bwd_dAv(q=q, k=k, v=v, do=do, A=A, scale=0.3, chunk_size=64, **pk)
        assert ours[0].dtype == torch.float32
        assert all(torch.isfinite(x).all() and torch.equal(x, y) for x, y in zip(ours, theirs))


@pytest.mark.parametrize("packed", [False, True])
def test_flas_kda_intra_stage_launched_by_rewy_equals_flas_function(packed):
    """KDA's intra-chunk stage with and without the full policy's qg, under GVA, bit for bit against FLA's
    ``chunk_kda_fwd_intra``. Its safe_gate kernel does not run under the interpreter; the GPU tests cover
    that path (test_gpu_triton_kda.py, gates at the safe lower bound). Aqk is
    compared on its causal part (key position <= query position in the chunk): FLA's kernels leave the
    rest unwritten (torch.empty) and every stage that reads Aqk masks it."""
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
    from fla.ops.utils import chunk_local_cumsum

    from nan_fill import nan_filled

    gen = torch.Generator().manual_seed(7)
    # One program per token: 100 tokens are two chunks, packed 70 + 30 (a boundary inside a chunk).
    T, H, HV, K, V = 100, 1, 2, 32, 16
    pk = dict(cu_seqlens=torch.tensor([0, 70, 100])) if packed else {}
    r = lambda *shape: torch.randn(*shape, generator=gen)   # noqa: E731
    q, k, v = r(1, T, H, K), F.normalize(r(1, T, H, K), dim=-1), r(1, T, HV, V)
    gk = chunk_local_cumsum(-5 * torch.sigmoid(r(1, T, HV, K)), chunk_size=64, scale=RCP_LN2, **pk)
    beta = torch.rand(1, T, HV, generator=gen)
    starts = torch.tensor([0, 70]) if packed else torch.tensor([0])
    position = torch.arange(T) - starts[torch.bucketize(torch.arange(T), starts, right=True) - 1]
    causal = (torch.arange(64)[None, :] <= position[:, None] % 64)[None, :, None, :].expand(1, T, HV, 64)
    with pytest.MonkeyPatch.context() as mp:
        nan_filled(mp)
        for full in (False, True):
            ours = fla_stages.kda_intra(q, k, v, gk, beta, 0.3, disable_recompute=full, **pk)
            theirs = chunk_kda_fwd_intra(q=q, k=k, v=v, gk=gk, beta=beta, scale=0.3, chunk_size=64,
                                         disable_recompute=full, **pk)
            assert (ours[2] is None) == (not full)
            ours, theirs = list(ours), list(theirs)
            ours[4], theirs[4] = ours[4][causal], theirs[4][causal]
            assert all(x is None and y is None or torch.isfinite(x).all() and torch.equal(x, y)
                       for x, y in zip(ours, theirs)), full


@pytest.mark.parametrize("packed", [False, True])
def test_flas_gdn2_stages_launched_by_rewy_equal_flas_functions(packed):
    """GDN2's intra-chunk stage (with and without the full policy's qg) and its rebuild of w, u, qg, kg,
    bit for bit against FLA's functions, Aqk on its causal part (as for KDA above); its safe_gate kernel
    does not run under the interpreter either."""
    from fla.ops.gdn2.chunk_intra import chunk_gdn2_fwd_intra
    from fla.ops.gdn2.wy_fast import recompute_w_u_fwd_gdn2
    from fla.ops.utils import chunk_local_cumsum

    from nan_fill import nan_filled

    gen = torch.Generator().manual_seed(8)
    T, H, K, V = 100, 2, 32, 16             # as for KDA above
    pk = dict(cu_seqlens=torch.tensor([0, 70, 100])) if packed else {}
    r = lambda *shape: torch.randn(*shape, generator=gen)   # noqa: E731
    q, k, v = r(1, T, H, K), F.normalize(r(1, T, H, K), dim=-1), r(1, T, H, V)
    gk = chunk_local_cumsum(F.logsigmoid(r(1, T, H, K)), chunk_size=64, scale=RCP_LN2, **pk)
    b, w_gate = torch.rand(1, T, H, K, generator=gen), torch.rand(1, T, H, V, generator=gen)
    starts = torch.tensor([0, 70]) if packed else torch.tensor([0])
    position = torch.arange(T) - starts[torch.bucketize(torch.arange(T), starts, right=True) - 1]
    causal = (torch.arange(64)[None, :] <= position[:, None] % 64)[None, :, None, :].expand(1, T, H, 64)
    same = lambda xs, ys: all(x is None and y is None or torch.isfinite(x).all() and torch.equal(x, y)  # noqa: E731
                              for x, y in zip(xs, ys))
    with pytest.MonkeyPatch.context() as mp:
        nan_filled(mp)
        for full in (False, True):
            ours = list(fla_stages.gdn2_intra(q, k, v, gk, b, w_gate, 0.3, disable_recompute=full, **pk))
            theirs = list(chunk_gdn2_fwd_intra(q=q, k=k, v=v, gk=gk, b=b, w_gate=w_gate, scale=0.3, chunk_size=64,
                                               disable_recompute=full, **pk))
            assert (ours[2] is None) == (not full)
            ours[4], theirs[4] = ours[4][causal], theirs[4][causal]
            assert same(ours, theirs), full
        A = r(1, T, H, 64) * 0.1
        for query in (q, None):
            assert same(fla_stages.gdn2_recompute(k, v, b, w_gate, A, gk, q=query, **pk),
                        recompute_w_u_fwd_gdn2(k=k, v=v, b=b, w_gate=w_gate, A=A, gk=gk, q=query, **pk))


class _Recorder:
    """Stands in for one of FLA's recurrence kernels: records the grid and arguments it is launched with."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda **kwargs: self.calls.append((grid, kwargs))


def _same_launch(a, b):
    (grid_a, kw_a), (grid_b, kw_b) = a, b
    assert kw_a.keys() == kw_b.keys()
    for name in kw_a:
        x, y = kw_a[name], kw_b[name]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.shape == y.shape and x.dtype == y.dtype, name
            if name not in ("h", "ht", "v_new", "dh", "dh0", "dv2"):          # inputs: the very same values
                assert torch.equal(x, y), name
        else:
            assert x == y, name
    for bv in (32, 64):
        assert grid_a({"BV": bv}) == grid_b({"BV": bv})


@pytest.mark.parametrize("gate", ["g", "gk", "gk-state-v-first"])
@pytest.mark.parametrize("packed", [False, True])
def test_state_recurrences_at_flas_widths_get_flas_arguments(packed, gate, monkeypatch):
    """At FLA's own width (no narrowing: V = 16 leaves BV 16 nothing to gain), rewy launches FLA's
    recurrence kernels itself: with exactly the arguments and grid FLA's stage functions give them, for GDN's
    head-wise gate g and KDA / GDN2's key-wise gate gk, also with the state stored [V, K] as
    FLA's KDA layer keeps it (state_v_first)."""
    from fla.ops.common import chunk_delta_h as fla

    assert state_launch.narrow_block_v(2, 2, 16) is None
    fwd_rec, bwd_rec = _Recorder(), _Recorder()
    monkeypatch.setattr(fla, "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", fwd_rec)
    monkeypatch.setattr(fla, "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64", bwd_rec)
    q, k, v, g, beta, A, do = _gdn_chunk_inputs()
    w, u = torch.randn(1, 150, 2, 32), torch.randn(1, 150, 2, 16)
    h0 = torch.randn(2 if packed else 1, 2, 32, 16)
    pk = dict(cu_seqlens=torch.tensor([0, 70, 150])) if packed else {}
    # (the recorders stand in for the kernels, so the key-wise gate only needs its shape)
    gates = {"g": g} if gate == "g" else {"gk": -torch.rand(1, 150, 2, 32).cumsum(1)}
    if gate == "gk-state-v-first":
        gates["state_v_first"] = True
        h0 = h0.transpose(-1, -2).contiguous()
    for launcher in (state_launch.fwd_h, fla.chunk_gated_delta_rule_fwd_h):
        launcher(k=k, w=w, u=u, **gates, initial_state=h0, output_final_state=True, chunk_size=64, **pk)
    _same_launch(*fwd_rec.calls)
    for launcher in (state_launch.bwd_dhu, fla.chunk_gated_delta_rule_bwd_dhu):
        launcher(q=q, k=k, w=w, do=do, dv=u, **gates, h0=h0, dht=h0, scale=0.3, chunk_size=64, **pk)
    _same_launch(*bwd_rec.calls)
