"""The ReWY Triton kernels for KDA / GDN2 (kernels/triton_backend/vector_gate/), and the Function
that runs them, under TRITON_INTERPRET=1 on CPU.

Each kernel is fed the torch backend's own intermediates (A, the chunk states
and their gradients, Vn and dVn, and for the intra kernel the partial
gradients and dL), moved to FLA's token layout with the gates as FLA keeps
them (chunk-local cumulative sums in log2 units), and must reproduce the torch
backend's stage outputs to float32 accuracy:

- the WY kernel: dL (Residual WY, against ``residual_wy_backward``), dv, the
  write-gate gradient, and the inter-chunk partials of dq, dk, the gate and
  the erase gate (against the same expressions in ``local_backward``);
- the intra kernel (Matrix Intra): fed the torch partials, dL and dAqk, the
  final dq, dk, dg, db must equal ``local_backward``'s; and chained after the
  WY kernel, the same.

Every output buffer starts as NaN, so an output the kernels fail to write
cannot pass. bfloat16 is not used: the interpreter's tl.dot is wrong for it.
"""

from __future__ import annotations

import functools
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
import triton

from rewy_hf.cpu_triton import only_config
from rewy_hf.kernels.constants import CHUNK as C
from rewy_hf.kernels.torch_backend.chunk_backward import local_backward, reverse_state_pass
from rewy_hf.kernels.torch_backend.chunk_forward import ChunkInputs
from rewy_hf.kernels.torch_backend.function import forward_pass
from rewy_hf.kernels.torch_backend.layout import ChunkLayout
from rewy_hf.kernels.torch_backend.residual_wy import residual_wy_backward
from rewy_hf.kernels.triton_backend import state_checkpoints
from rewy_hf.kernels.triton_backend.tiles import size_class
from rewy_hf.kernels.triton_backend.vector_gate import backward, common, intra_backward, wy_backward
from rewy_hf.kernels.triton_backend.vector_gate import stages as vector_gate
from rewy_hf.kernels import triton_entry
from rewy_hf.rel_error import rel_err
from fake_shapes import watch_saved_like
from state_loops import loop_bwd_dhu, loop_fwd_h, replace_recurrences
LN2 = math.log(2.0)
# Against the float64 torch stages. Logsigmoid gates: float32 rounding only. "mixed", "bound" and
# "strong" gates reach cumulative log-gates of a few hundred nats, where the kernels' float32
# log2-unit gates (as FLA stores them) carry |G| * 2^-24 of rounding in the exponent: the gate
# gradient's error there is 1e-5 to 2.3e-5 (the same on the exact and the tensor-core diagonal
# paths), the other gradients' below 5e-6.
TOL = {"logsigmoid": 1e-5, "mixed": 5e-5, "bound": 5e-5, "strong": 5e-5}


@pytest.fixture(autouse=True)
def nan_outputs(monkeypatch):
    monkeypatch.setattr(common, "alloc", lambda shape, device, dtype=torch.float32:
                        torch.full(shape, float("nan"), device=device, dtype=dtype))


class Case:
    """Random inputs, the torch backend's forward/backward stages, and the FLA-layout views."""

    def __init__(self, kind, lens, H, HV, K, V, gates="logsigmoid", varlen=False, seed=0):
        gen = torch.Generator().manual_seed(seed)
        N = len(lens)
        NT = max(math.ceil(L / C) for L in lens)
        self.kind, self.lens, self.H, self.HV, self.K, self.V = kind, lens, H, HV, K, V
        pos = (torch.arange(NT).view(NT, 1, 1, 1, 1) * C + torch.arange(C).view(1, 1, 1, C, 1))
        self.valid = (pos < torch.tensor(lens).view(1, N, 1, 1, 1)).float()      # [NT, N, 1, C, 1]
        valid = self.valid
        shape = (NT, N, HV, C)
        qk = lambda: F.normalize(torch.randn(NT, N, H, C, K, generator=gen), dim=-1).repeat_interleave(HV // H, dim=2)
        q, k = qk() * valid, qk() * valid
        v = torch.randn(*shape, V, generator=gen) * valid
        raw = torch.randn(*shape, K, generator=gen)
        if gates == "logsigmoid":
            g = F.logsigmoid(raw)
        elif gates == "mixed":
            # every other 16-row block decays hard (its diagonal block takes the
            # exact path), the others softly (tensor-core path); cumulative
            # gates reach a few hundred nats, where e^{-G} would overflow.
            hard = ((torch.arange(C) // 16) % 2 == 0).view(1, 1, 1, C, 1)
            g = torch.where(hard, -8.0 - 4.0 * torch.rand(*shape, K, generator=gen), F.logsigmoid(raw))
        elif gates == "bound":
            # at FLA's safe lower bound (-5 nats a step): the diagonal blocks'
            # gate spread is about 103 in log2 units, near SPAN_LIMIT, and still
            # takes the tensor-core path with factors up to 2^52.
            g = -5.0 + 0.5 * torch.rand(*shape, K, generator=gen)
        elif gates == "strong":
            # strong decay, about -10 nats a step: a gate gradient formed as the difference of large
            # terms (Aqk's diagonal entering and leaving, the keys' decay to the chunk end added and
            # taken away) keeps only rounding here (7.7e-3 off at -10, 1e2 at -20 for KDA)
            g = -10.0 + 0.1 * torch.randn(*shape, K, generator=gen).clamp(-1, 1)
        else:
            raise ValueError(gates)
        g = g * valid
        if kind == "kda":
            b = torch.rand(*shape, 1, generator=gen) * valid
            w = None
        else:
            b = 2 * torch.rand(*shape, K, generator=gen) * valid
            w = torch.rand(*shape, V, generator=gen) * valid
        # The torch backend's stages run in float64 (the ground truth); the kernels get float32 copies.
        q, k, v, g, b = (t.double() for t in (q, k, v, g, b))
        w = None if w is None else w.double()
        self.x = x = ChunkInputs(q, k, v, g, b, w, scale=K ** -0.5)
        h0 = torch.randn(N, HV, K, V, generator=gen).double() * 0.3
        self.gt, self.s, _ = forward_pass(x, h0)
        self.do = torch.randn(*shape, V, generator=gen).double() * valid
        dht = torch.randn(N, HV, K, V, generator=gen).double() * 0.3
        self.dVn, self.dHnext, _ = reverse_state_pass(x, self.gt, self.s, self.do, dht)
        self.ref = local_backward(x, self.gt, self.s, self.do, self.dVn, self.dHnext)

        # FLA layout: [N, T, heads, D], or [1, sum(lens), heads, D] packed with cu_seqlens.
        self.varlen = varlen
        if varlen:
            self.cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()))
            self.layout = ChunkLayout(1, int(self.cu[-1]), C, self.cu, torch.device("cpu"))
        else:
            assert len(set(lens)) == 1
            self.cu = None
            self.layout = ChunkLayout(N, lens[0], C, None, torch.device("cpu"))
        self.nchunks = [math.ceil(L / C) for L in lens]

    def fla(self, t: torch.Tensor) -> torch.Tensor:
        return self.layout.from_chunks(t).contiguous()

    def kfla(self, t: torch.Tensor) -> torch.Tensor:
        """FLA's layout in the kernels' float32: a kernel input."""
        return self.fla(t).float()

    def to_chunks(self, t: torch.Tensor) -> torch.Tensor:
        return self.layout.to_chunks(t)

    def states(self, S: torch.Tensor, v_first: bool) -> torch.Tensor:
        """[NT, N, HV, K, V] -> FLA's [N, NT, HV, K, V] (varlen: [1, sum NT_n, ...])."""
        if v_first:
            S = S.transpose(-1, -2)
        if not self.varlen:
            return S.permute(1, 0, 2, 3, 4).contiguous()
        return torch.cat([S[:n, i] for i, n in enumerate(self.nchunks)]).unsqueeze(0).contiguous()

    def kernel_inputs(self, v_first=False):
        x, gt, s, fla = self.x, self.gt, self.s, self.kfla
        step = self.HV // self.H
        return dict(
            q=fla(x.q)[:, :, ::step].contiguous(), k=fla(x.k)[:, :, ::step].contiguous(), v=fla(x.v),
            v_new=fla(s.Vn), g=fla(gt.G) / LN2, beta=fla(x.b)[..., 0].contiguous() if self.kind == "kda" else fla(x.b),
            A=fla(s.A), h=self.states(s.Hs, v_first).float(), dh=self.states(self.dHnext, v_first).float(),
            do=fla(self.do), dv2=fla(self.dVn), scale=x.scale, w_gate=None if x.w is None else fla(x.w),
            state_v_first=v_first, cu_seqlens=self.cu)

    def torch_partials(self):
        """The WY stage's outputs as the torch backend computes them (chunk layout)."""
        x, gt, s = self.x, self.gt, self.s
        K = self.K
        HsT = s.Hs.transpose(-1, -2)
        dW = -(self.dVn @ HsT)
        dXY, dL = residual_wy_backward(s.A, s.WU, torch.cat([dW, self.dVn], dim=-1))
        dX, dY = dXY[..., :K], dXY[..., K:]
        dq = x.scale * (self.do @ HsT) * gt.eG
        dKc = s.Vn @ self.dHnext.transpose(-1, -2)
        dxe = dX * gt.eG
        Kc = x.k * gt.eKc
        dk = dKc * gt.eKc + x.b * dxe
        # These terms' whole share of the gate gradient: q e^G and X = a e^G summed from the chunk's
        # end, the keys' decay to the chunk end from its start (the row itself left out), the carried
        # state's decay on every row.
        kdkc = Kc * dKc
        before = torch.cat([torch.zeros_like(kdkc[..., :1, :]), kdkc[..., :-1, :].cumsum(-2)], dim=-2)
        dG = (x.b * x.k * dxe + x.q * dq).flip(-2).cumsum(-2).flip(-2) + before
        dG = (dG + (s.Hs * self.dHnext).sum(-1).unsqueeze(-2) * gt.decay) * self.valid
        wg = x.write_gate
        out = dict(dq=dq, dk=dk, dG=dG, dv=dY * wg, dL=dL.tril(-1),
                   dAqk=x.scale * (self.do @ s.Vn.transpose(-1, -2)).tril())
        if self.kind == "kda":
            out["db_k"] = (x.k * dxe).sum(-1, keepdim=True)
            out["db_v"] = (dY * x.v).sum(-1, keepdim=True)
        else:
            out["db_k"] = x.k * dxe
            out["dw"] = dY * x.v
        return out

    def check_final(self, dq, dk, dg, db, dv=None, dw=None):
        rq, rk, rv, rg, rb, rw = self.ref
        fla = self.fla
        errors = {"dq": rel_err(dq, fla(rq)), "dk": rel_err(dk, fla(rk)), "dg": rel_err(dg, fla(rg)),
                  "db": rel_err(db, fla(rb)[..., 0] if self.kind == "kda" else fla(rb))}
        if dv is not None:
            errors["dv"] = rel_err(dv, fla(rv))
        if dw is not None:
            errors["dw"] = rel_err(dw, fla(rw))
        return errors


CASES = {
    # name: (kind, lens, H, HV, K, V, gates, varlen, state_v_first, block_k)
    "kda_ragged_K32": ("kda", [70, 70], 2, 2, 32, 32, "logsigmoid", False, False, None),
    "kda_gva_K64_split": ("kda", [70], 1, 2, 64, 64, "logsigmoid", False, True, 32),
    "kda_mixed_decay": ("kda", [100], 2, 2, 32, 32, "mixed", False, False, None),
    "kda_bound_gates": ("kda", [64], 1, 1, 32, 32, "bound", False, False, None),
    "kda_varlen": ("kda", [70, 23, 128], 1, 2, 32, 32, "logsigmoid", True, False, None),
    "kda_strong_decay": ("kda", [100], 1, 1, 32, 32, "strong", False, False, None),
    "gdn2_ragged_K64": ("gdn2", [70], 2, 2, 64, 64, "logsigmoid", False, True, 32),
    "gdn2_full_chunks": ("gdn2", [128], 1, 2, 64, 64, "logsigmoid", False, False, None),
    "gdn2_mixed_varlen": ("gdn2", [40, 100], 1, 1, 32, 32, "mixed", True, False, None),
    "gdn2_strong_decay": ("gdn2", [128], 1, 1, 32, 32, "strong", False, False, None),
}


def _case(name):
    kind, lens, H, HV, K, V, gates, varlen, v_first, block_k = CASES[name]
    return Case(kind, lens, H, HV, K, V, gates, varlen, seed=sum(lens) + K), v_first, block_k


@pytest.mark.parametrize("name", list(CASES))
def test_wy_kernel_matches_torch_stage(name):
    case, v_first, block_k = _case(name)
    inp = case.kernel_inputs(v_first)
    dq, dk, dG, dv, dw, db, dL = wy_backward.rewy_kda_bwd_wy(**inp, block_k=block_k)
    ref = case.torch_partials()
    fla = case.fla
    errors = {"dq": rel_err(dq, fla(ref["dq"])), "dk": rel_err(dk, fla(ref["dk"])), "dv": rel_err(dv, fla(ref["dv"])),
              "dL": rel_err(dL, fla(ref["dL"]))}
    errors["dG"] = rel_err(dG, fla(ref["dG"]))
    if case.kind == "kda":
        NK = db.shape[-1] - 1
        errors["db_k"] = rel_err(db[..., :NK].sum(-1), fla(ref["db_k"])[..., 0])
        errors["db_v"] = rel_err(db[..., NK], fla(ref["db_v"])[..., 0])
        assert dw is None
    else:
        errors["db_k"] = rel_err(db, fla(ref["db_k"]))
        errors["dw"] = rel_err(dw, fla(ref["dw"]))
    assert max(errors.values()) < TOL[CASES[name][6]], errors


@pytest.mark.parametrize("name", ["kda_ragged_K32", "gdn2_ragged_K64"])
def test_wy_kernel_with_fp32_partials(name, monkeypatch):
    """WY_PRECISION other than bf16 keeps A^T dW and dY Vn^T in fp32 operands: same results."""
    monkeypatch.setattr(common, "WY_PRECISION", "tf32")
    test_wy_kernel_matches_torch_stage(name)


def _intra_errors(name, **options):
    """Stage 2 alone on the torch stage's partials (KDA: its two db slots) against the torch
    backward; ``options`` go to rewy_kda_bwd_intra (block_k, span_limit)."""
    case, v_first, _ = _case(name)
    inp = case.kernel_inputs(v_first)
    ref = case.torch_partials()
    fla = case.kfla
    db_part = torch.cat([fla(ref["db_k"]), fla(ref["db_v"])], -1) if case.kind == "kda" else fla(ref["db_k"])
    out = intra_backward.rewy_kda_bwd_intra(
        inp["q"], inp["k"], inp["g"], inp["beta"], fla(ref["dAqk"]), fla(ref["dL"]),
        fla(ref["dq"]), fla(ref["dk"]), fla(ref["dG"]), db_part, cu_seqlens=case.cu, inplace=False, **options)
    return case.check_final(*out)


@pytest.mark.parametrize("name", list(CASES))
def test_intra_kernel_matches_torch_stage(name):
    errors = _intra_errors(name, block_k=CASES[name][9])
    assert max(errors.values()) < TOL[CASES[name][6]], errors


@pytest.mark.parametrize("name", ["kda_mixed_decay", "gdn2_ragged_K64"])
def test_intra_kernel_with_narrowed_off_diagonal_operands(name, monkeypatch):
    """INTRA_PRECISION "bf16" rounds the off-diagonal operands to the inputs' dtype (here float32, so
    nothing is lost): the same results through the narrowing branch."""
    monkeypatch.setattr(common, "INTRA_PRECISION", "bf16")
    errors = _intra_errors(name, block_k=CASES[name][9])
    assert max(errors.values()) < TOL[CASES[name][6]], errors


@pytest.mark.parametrize("name", ["kda_gva_K64_split", "kda_mixed_decay", "gdn2_mixed_varlen"])
def test_intra_exact_path_alone(name):
    """span_limit < 0 sends every diagonal block down the exact elementwise path."""
    errors = _intra_errors(name, span_limit=-1.0)
    assert max(errors.values()) < TOL[CASES[name][6]], errors


@pytest.mark.parametrize("name", ["kda_gva_K64_split", "gdn2_ragged_K64"])
def test_intra_kernel_with_more_key_blocks_than_db_slots(name):
    """Stage 2 narrower than stage 1: four 16-channel blocks against KDA's two
    db slots, each block writing its own share."""
    errors = _intra_errors(name, block_k=16)
    assert max(errors.values()) < TOL[CASES[name][6]], errors


@pytest.mark.parametrize("name", ["kda_ragged_K32", "kda_gva_K64_split", "gdn2_ragged_K64", "kda_varlen",
                                  "kda_strong_decay"])
def test_chained_kernels_match_torch_backward(name):
    """WY kernel then intra kernel (in place), as the autograd Function runs them."""
    case, v_first, block_k = _case(name)
    inp = case.kernel_inputs(v_first)
    dAqk = case.kfla(case.torch_partials()["dAqk"])
    dq, dk, dv, dg, db, dw = backward.rewy_kda_bwd(dAqk=dAqk, block_k=block_k, **inp)
    errors = case.check_final(dq, dk, dg, db, dv=dv, dw=dw)
    assert max(errors.values()) < TOL[CASES[name][6]], errors


@pytest.mark.parametrize("name", ["kda_ragged_K32", "gdn2_ragged_K64"])
def test_final_dtypes_are_written_by_the_kernel(name):
    """final_dtypes: with half-precision q, k (and GDN2's b), dq, dk (and db) come
    out of the kernel in that dtype, bit-equal to the float32 results rounded
    once, which the other tests hold to the torch stage."""
    case, v_first, block_k = _case(name)
    inp = case.kernel_inputs(v_first)
    half = ("q", "k", "beta") if case.kind == "gdn2" else ("q", "k")
    inp.update({n: inp[n].half() for n in half})
    dAqk = case.kfla(case.torch_partials()["dAqk"])
    wide = backward.rewy_kda_bwd(dAqk=dAqk, block_k=block_k, **inp)
    low = backward.rewy_kda_bwd(dAqk=dAqk, block_k=block_k, final_dtypes=True, **inp)
    dq, dk, dv, dg, db, dw = low
    assert dq.dtype == dk.dtype == torch.float16 and dg.dtype == torch.float32
    assert db.dtype == (torch.float16 if case.kind == "gdn2" else torch.float32)
    assert wide[0].dtype == torch.float32
    for ours, ref in zip(low, wide):
        if ours is not None:
            assert torch.isfinite(ours).all()
            assert torch.equal(ours, ref.to(ours.dtype))


@pytest.mark.parametrize("intra_block_k", [64, 16])
def test_chained_kernels_with_either_stage_width(intra_block_k):
    """Stage 2 as wide as stage 1 (one block, the db slots folded at once) or narrower."""
    case, v_first, _ = _case("kda_gva_K64_split")
    inp = case.kernel_inputs(v_first)
    dAqk = case.kfla(case.torch_partials()["dAqk"])
    dq, dk, dv, dg, db, dw = backward.rewy_kda_bwd(dAqk=dAqk, block_k=64, intra_block_k=intra_block_k, **inp)
    errors = case.check_final(dq, dk, dg, db, dv=dv, dw=dw)
    assert max(errors.values()) < TOL[CASES["kda_gva_K64_split"][6]], errors


def test_final_dtypes_refused_under_gva():
    case, v_first, block_k = _case("kda_gva_K64_split")
    inp = case.kernel_inputs(v_first)
    with pytest.raises(ValueError, match="GVA"):
        backward.rewy_kda_bwd(dAqk=case.kfla(case.torch_partials()["dAqk"]), final_dtypes=True, **inp)


# The WY kernel's shipped launch configs, (BV, warps, stages), as listed in its autotune decorator
# (the conftest cuts every autotuner's list to its first config).
WY_LISTED = ((128, 4, 1), (64, 4, 1), (64, 8, 3))


def _wy_config(bv, warps, stages):
    """The WY kernel with one launch config (as the sweep of dev/kernel_configs.py runs it)."""
    return only_config(wy_backward.rewy_kda_bwd_wy_kernel,
                       triton.Config({"BV": bv}, num_warps=warps, num_stages=stages))


@functools.cache
def _wy_128(kind):
    """Kernel inputs at K = V = 128 and the WY kernel's outputs on them with 64-channel key blocks
    (the sweep's reference), made once per kind for the configs compared with it."""
    inp = Case(kind, [64], 1, 1, 128, 128, seed=11).kernel_inputs()
    with _wy_config(128, 4, 1):
        return inp, tuple(wy_backward.rewy_kda_bwd_wy(**inp, block_k=64))


@pytest.mark.parametrize("kind", ["kda", "gdn2"])
@pytest.mark.parametrize("bv, warps, stages", [(64, 4, 1), (64, 8, 3), (128, 4, 1)])
def test_wy_32_channel_key_blocks_under_each_value_tile(kind, bv, warps, stages):
    """The 32-channel sweep of dev/kernel_configs.py at K = V = 128 (four key blocks, two value
    tiles of 64). With 4 warps and BV = 64, triton 3.6 miscompiled the key side on the H200 (wrong dk
    / dG / db, or an illegal memory access that also failed the next config): the wrapper must refuse
    that config by name instead of launching it. The others must match 64-channel key blocks."""
    inp, ref = _wy_128(kind)
    ref = list(ref)
    with _wy_config(bv, warps, stages):
        if (bv, warps) == (64, 4):
            with pytest.raises(ValueError, match="4 warps with BV = 64 need block_k >= 64"):
                wy_backward.rewy_kda_bwd_wy(**inp, block_k=32)
            return
        out = list(wy_backward.rewy_kda_bwd_wy(**inp, block_k=32))
    if kind == "kda":       # one erase-gate slot per key block (+ the value side's): compare their sum
        assert out[5].shape[-1] == 5 and ref[5].shape[-1] == 3
        out[5], ref[5] = out[5].sum(-1), ref[5].sum(-1)
    names = ("dq", "dk", "dG", "dv", "dw", "db", "dL")
    errors = {n: rel_err(o, r) for n, o, r in zip(names, out, ref) if r is not None}
    assert max(errors.values()) < 1e-5, errors


def test_wy_autotuner_prunes_the_miscompiled_config():
    """With the shipped list, narrow key blocks lose only (BV 64, 4 warps); 64-channel ones keep all."""
    shipped = wy_backward.rewy_kda_bwd_wy_kernel.listed_configs      # the decorator's whole list
    assert [(c.kwargs["BV"], c.num_warps, c.num_stages) for c in shipped] == list(WY_LISTED)
    listed = [triton.Config({"BV": bv}, num_warps=nw, num_stages=ns) for bv, nw, ns in WY_LISTED]
    prune = wy_backward.rewy_kda_bwd_wy_kernel.early_config_prune
    assert prune is not None

    def kept(bk):
        return [(c.kwargs["BV"], c.num_warps, c.num_stages) for c in prune(listed, {}, BK=bk)]

    assert kept(64) == list(WY_LISTED)
    assert kept(32) == kept(16) == [(128, 4, 1), (64, 8, 3)]


_KERNEL_MODULES = {"rewy_kda_bwd_wy_kernel": wy_backward, "rewy_kda_bwd_intra_kernel": intra_backward}


def _autotune_keys(monkeypatch, kernel_name, call, lens):
    """The autotune key (Triton's: the values of the kernel's key arguments) of each launch of one
    kernel while ``call`` runs on a case per total length: the launches are recorded, not run."""
    module = _KERNEL_MODULES[kernel_name]
    tuner = getattr(module, kernel_name)
    names = tuner.fn.arg_names
    keys = []

    class Recorder:
        configs = tuner.configs

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                bound = {**dict(zip(names, args)), **kwargs}
                keys.append(tuple(bound[k] for k in tuner.keys))
            return launch

    monkeypatch.setattr(module, kernel_name, Recorder())
    for L in lens:
        call(Case("kda", [L], 2, 2, 32, 32, seed=1).kernel_inputs())
    return keys


@pytest.mark.parametrize("kernel_name", ["rewy_kda_bwd_wy_kernel", "rewy_kda_bwd_intra_kernel"])
def test_autotune_key_has_a_size_class_not_the_length(kernel_name, monkeypatch):
    """Keyed on T, the two kernels re-tuned at every new total length: with packed sequences
    (cu_seqlens) or dynamic padding, every training step. They are keyed on a power-of-two size
    class of the launch instead: lengths of 2 and 2 (ragged) chunks share a key, 8 chunks do not."""
    tuner = getattr(_KERNEL_MODULES[kernel_name], kernel_name)
    assert "T" not in tuner.keys and "SIZE" in tuner.keys

    def call(inp):
        if kernel_name == "rewy_kda_bwd_wy_kernel":
            wy_backward.rewy_kda_bwd_wy(**inp)
        else:
            B, T, HV = inp["v"].shape[:3]
            z = torch.zeros(B, T, HV, 64)
            intra_backward.rewy_kda_bwd_intra(inp["q"], inp["k"], inp["g"], inp["beta"], z, z,
                                              *(torch.zeros_like(inp["g"]),) * 3, torch.zeros(B, T, HV, 3))

    k_128, k_100, k_512 = _autotune_keys(monkeypatch, kernel_name, call, [128, 100, 512])
    assert k_128 == k_100 != k_512
    assert size_class(2 * 2 * 2) == 8 and size_class(2 * 3 * 2) == 16 and size_class(0) == 1


# ---------------------------------------------------------------------------
# The autograd Function end to end. FLA's state recurrences (forward h and
# the reverse dh pass) do not run under the interpreter, so they are replaced
# by the float32 torch loops of tests/support/state_loops.py, with FLA's
# contract; everything else -- FLA's gate cumsum, intra forward (A, Aqk, w, u,
# qg, kg), output, w/u recompute and dAv stages, and our two kernels -- runs
# as it does on the GPU.
# ---------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def fake_shapes_checked(monkeypatch):
    """Every Triton forward here also checks the custom op's fake shapes against its saved tensors."""
    watch_saved_like(monkeypatch)


def _function_errors(monkeypatch, fwd_h, bwd_dhu, *, B, T, H, HV, K, V, state_v_first, policy, seed,
                     qk_l2norm=False, cu=None, strong=False):
    """The KDA Function (FLA's real forward stages in the interpreter, the two state
    recurrences replaced by ``fwd_h`` / ``bwd_dhu``) against the torch backend.
    ``qk_l2norm``: raw q, k, normalised inside (FLA's use_qk_l2norm_in_kernel).
    ``cu``: packed sequences (B = 1). ``strong``: log-gates near -10 per token with two of them
    -inf (hard resets, at a chunk's first token and inside a chunk)."""
    import rewy_hf

    replace_recurrences(monkeypatch, fwd_h, bwd_dhu)
    gen = torch.Generator().manual_seed(seed)
    N = B if cu is None else len(cu) - 1
    state = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    unit = (lambda x: 2 * x) if qk_l2norm else (lambda x: F.normalize(x, dim=-1))
    q = unit(torch.randn(B, T, H, K, generator=gen))
    k = unit(torch.randn(B, T, H, K, generator=gen))
    v = torch.randn(B, T, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, HV, K, generator=gen))
    if strong:
        g = -10.0 + 0.1 * torch.randn(B, T, HV, K, generator=gen).clamp(-1, 1)
        g[:, [64, 100]] = float("-inf")
    beta = torch.rand(B, T, HV, generator=gen)
    h0 = torch.randn(*state, generator=gen) * 0.3
    do, dht = torch.randn(B, T, HV, V, generator=gen), torch.randn(*state, generator=gen) * 0.3
    ours = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
    o, ht = triton_entry.triton_kda_core(*ours[:5], K ** -0.5, ours[5], True, state_v_first, policy,
                                        cu_seqlens=cu, qk_l2norm=qk_l2norm)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), ours)
    ref_in = [t.double().requires_grad_() for t in (q, k, v, g, beta, h0)]     # float64 ground truth
    o_ref, ht_ref = rewy_hf.chunk_kda(*ref_in[:5], scale=K ** -0.5, initial_state=ref_in[5], output_final_state=True,
                                      state_v_first=state_v_first, backend="torch", policy="full",
                                      use_qk_l2norm_in_kernel=qk_l2norm, cu_seqlens=cu)
    ref = torch.autograd.grad((o_ref * do.double()).sum() + (ht_ref * dht.double()).sum(), ref_in)
    errors = {"o": rel_err(o, o_ref), "ht": rel_err(ht, ht_ref)}
    errors.update({f"d{n}": rel_err(a, b) for n, a, b in zip(("q", "k", "v", "g", "beta", "h0"), grads, ref)})
    return errors


@pytest.mark.parametrize("policy", ["recompute", "full"])
def test_gdn2_function_matches_torch_backend(policy, monkeypatch):
    """GDN2 through the Triton backend's Function (its erase gate b [B, T, H, K] and write gate
    w [B, T, H, V]; FLA's GDN2 forward stages in the interpreter), a ragged chunk, V-first state,
    initial state and dht, against the torch backend in float64."""
    import rewy_hf

    replace_recurrences(monkeypatch, loop_fwd_h, loop_bwd_dhu)
    gen = torch.Generator().manual_seed(13)
    B, T, H, K, V = 1, 70, 2, 32, 16
    state = (B, H, V, K)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen))
    b = 2 * torch.rand(B, T, H, K, generator=gen)
    w = torch.rand(B, T, H, V, generator=gen)
    h0 = torch.randn(*state, generator=gen) * 0.3
    do, dht = torch.randn(B, T, H, V, generator=gen), torch.randn(*state, generator=gen) * 0.3
    ours = [t.clone().requires_grad_() for t in (q, k, v, g, b, w, h0)]
    o, ht = triton_entry.triton_gdn2_core(*ours[:6], K ** -0.5, ours[6], True, True, policy)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), ours)
    ref_in = [t.double().requires_grad_() for t in (q, k, v, g, b, w, h0)]
    o_ref, ht_ref = rewy_hf.chunk_gdn2(*ref_in[:6], scale=K ** -0.5, initial_state=ref_in[6], output_final_state=True,
                                       state_v_first=True, backend="torch", policy="full")
    ref = torch.autograd.grad((o_ref * do.double()).sum() + (ht_ref * dht.double()).sum(), ref_in)
    errors = {"o": rel_err(o, o_ref), "ht": rel_err(ht, ht_ref)}
    errors.update({f"d{n}": rel_err(x, r) for n, x, r in zip(("q", "k", "v", "g", "b", "w", "h0"), grads, ref)})
    assert max(errors.values()) < 1e-5, errors


# The l2norm inside the function (function.py's normalize, its backward and the four tensors it
# saves) is the same code under either policy; test_scalar_gate_function.py runs it under both.
@pytest.mark.parametrize("policy, qk_l2norm", [("recompute", False), ("full", False), ("recompute", True)])
def test_function_matches_torch_backend(policy, qk_l2norm, monkeypatch):
    # GVA, ragged, state_v_first, initial state and dht; q/k l2norm inside the function or not
    errors = _function_errors(monkeypatch, loop_fwd_h, loop_bwd_dhu, B=1, T=70, H=1, HV=2, K=32, V=32,
                              state_v_first=True, policy=policy, seed=7, qk_l2norm=qk_l2norm)
    assert max(errors.values()) < 1e-5, errors


def test_function_under_strong_decay_and_a_hard_reset(monkeypatch):
    """The log-gates are floored as the torch backend floors them (a -inf reset gives no NaN), and
    the gate gradient, here the sum of terms e^-10 apart, keeps to the float32 cumulative gates'
    rounding, which both sides carry."""
    errors = _function_errors(monkeypatch, loop_fwd_h, loop_bwd_dhu, B=1, T=130, H=1, HV=2, K=32, V=32,
                              state_v_first=False, policy="recompute", seed=14, strong=True)
    assert max(errors.values()) < 1e-4, errors


@pytest.mark.parametrize("policy", ["recompute", "full"])
def test_function_packed_sequences(policy, monkeypatch):
    """Three packed sequences (one of them empty, the others ragged), each with its own initial state."""
    errors = _function_errors(monkeypatch, loop_fwd_h, loop_bwd_dhu, B=1, T=100, H=2, HV=2, K=32, V=16,
                              state_v_first=False, policy=policy, seed=10, cu=torch.tensor([0, 70, 70, 100]))
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.parametrize("state_v_first", [False, True])
def test_function_rebuilds_states_from_checkpoints(state_v_first, monkeypatch):
    """Policy recompute with three chunks cut into segments of two: the backward's fwd_h is the
    segmented rebuild from the forward's checkpoints (two segments, checked: one from the initial
    state, a shorter one from a stored h), with the key-wise gate and either state layout, and every
    gradient matches the torch backend."""
    calls = []

    def fwd_h(**kw):
        calls.append(None if kw.get("cu_seqlens") is None else len(kw["cu_seqlens"]) - 1)
        return loop_fwd_h(**kw)

    monkeypatch.setattr(state_checkpoints, "chunks_per_segment", lambda *_: 2)
    monkeypatch.setattr(state_checkpoints, "MIN_CHUNKS", 2)        # the shortest segment, which bounds their count
    errors = _function_errors(monkeypatch, fwd_h, loop_bwd_dhu, B=1, T=130, H=2, HV=2, K=32, V=32,
                              state_v_first=state_v_first, policy="recompute", seed=8)
    assert calls == [None, 2], calls
    assert max(errors.values()) < 1e-5, errors


def test_recompute_backward_drops_u_and_the_local_dv_once_read(monkeypatch):
    """Peak memory: under recompute the backward holds u only until h is rebuilt, and the local
    dv only until the reverse recurrence has folded it into dv2 (the GDN backward does the same)."""
    refs = {}
    recompute, local = vector_gate.fla_stages.kda_recompute, vector_gate.rewy_kda_bwd

    def recompute_and_watch(*a, **kw):
        w, u, qg, kg = recompute(*a, **kw)
        refs["u"] = weakref.ref(u)
        return w, u, qg, kg

    def bwd_dhu(**kw):
        assert refs["u"]() is None, "u is still held when the reverse recurrence runs"
        refs["dv_local"] = weakref.ref(kw["dv"])
        return loop_bwd_dhu(**kw)

    def local_and_check(*a, **kw):
        assert refs["dv_local"]() is None, "the local dv is still held when the local kernels run"
        refs["local ran"] = True
        return local(*a, **kw)

    monkeypatch.setattr(vector_gate.fla_stages, "kda_recompute", recompute_and_watch)
    monkeypatch.setattr(vector_gate, "rewy_kda_bwd", local_and_check)
    errors = _function_errors(monkeypatch, loop_fwd_h, bwd_dhu, B=1, T=70, H=1, HV=1, K=32, V=32,
                              state_v_first=False, policy="recompute", seed=9)
    assert max(errors.values()) < 1e-5, errors
    assert refs.get("local ran")
