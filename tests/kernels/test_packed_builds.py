"""Packed calls' kernel builds (kernels/triton_backend/packed_builds.py): which builds a packing needs,
checked against the launch code's own decisions; that the representative packings need every build
any packing of the same tokens needs; and that the first packed call of a configuration runs each
missing one once, later calls none."""

from __future__ import annotations

import random

import pytest
import torch

from rewy_hf.kernels.constants import CHUNK
from rewy_hf.kernels.core_args import CoreArgs
from rewy_hf.kernels.triton_backend import packed_builds as P
from rewy_hf.kernels.triton_backend import state_checkpoints
from rewy_hf.kernels.triton_backend.chunks import chunk_launches
from rewy_hf.kernels.triton_backend.state_launch import narrow_block_v

SMS = 132           # what the launch code assumes off the GPU (occupancy.DEFAULT_SM_COUNT)
SHAPES = [(8192, 16, 128), (8192, 32, 128), (4096, 4, 64), (2048, 1, 32), (700, 2, 128), (8190, 8, 128)]


def _random_bounds(rng: random.Random, T: int) -> tuple[int, ...]:
    """A packing of T tokens as padding-free collators make them: long-tailed lengths, now and then
    whole chunks, a single document, or many tiny ones."""
    style = rng.choice(["one", "tail", "whole", "tiny", "few"])
    if style == "one":
        return (0, T)
    lengths, left = [], T
    while left:
        if style == "tail":
            n = int(rng.paretovariate(1.2) * 40)
        elif style == "whole":
            n = CHUNK * rng.randint(1, 40)
        elif style == "tiny":
            n = rng.randint(1, CHUNK - 1)
        else:
            n = rng.randint(T // 3, T)
        n = max(1, min(n, left))
        lengths.append(n)
        left -= n
    rng.shuffle(lengths)
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return tuple(out)


@pytest.mark.parametrize("T,HV,V", SHAPES)
def test_builds_are_the_launch_codes_decisions(T, HV, V):
    rng = random.Random(T + HV)
    for _ in range(60):
        bounds = _random_bounds(rng, T)
        cu = torch.tensor(bounds, dtype=torch.int32)
        got = P.builds(bounds, HV, V, SMS)
        N = len(bounds) - 1
        assert ("walk", narrow_block_v(N, HV, V) is not None) in got
        plan = state_checkpoints.plan(torch.empty(1, T, HV, V), cu)
        if plan is None or not plan.cuts:
            assert ("rebuild", "sequential", narrow_block_v(N, HV, V) is not None) in got, bounds
        else:
            assert ("rebuild", "segments", narrow_block_v(plan.count, HV, V) is not None) in got, bounds
        kinds = {("chunks", "full" if full else "short") for _, _, full in chunk_launches(T, cu, CHUNK)}
        assert {b for b in got if b[0] == "chunks"} == kinds, bounds
        assert len(got) == 2 + len(kinds)


@pytest.mark.parametrize("T,HV,V", SHAPES)
def test_the_representatives_need_every_build_a_packing_needs(T, HV, V):
    reps = P.representatives(T, HV, V, SMS)
    needed = set().union(*(P.builds(b, HV, V, SMS) for b in reps))
    rng = random.Random(7 * T + V)
    for _ in range(400):
        bounds = _random_bounds(rng, T)
        assert P.builds(bounds, HV, V, SMS) <= needed, bounds
    for b in reps:
        assert b[0] == 0 and b[-1] == T and all(x < y for x, y in zip(b[:-1], b[1:])), b
    # each adds a build the ones before it lack
    seen: set = set()
    for b in reps:
        assert P.builds(b, HV, V, SMS) - seen, b
        seen |= P.builds(b, HV, V, SMS)


def _args(T=2048, HV=16, V=128, cu=(0, 300, 1000, 2048), dtype=torch.float32, h0=False):
    q = torch.zeros(1, T, 4, 64, dtype=dtype)
    v = torch.zeros(1, T, HV, V, dtype=dtype)
    N = len(cu) - 1
    return CoreArgs(q=q, k=q, v=v, g=torch.zeros(1, T, HV), beta=torch.zeros(1, T, HV), w=None,
                    h0=torch.ones(N, HV, 64, V) if h0 else None, cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                    scale=0.125, family="gdn", policy="recompute", state_v_first=False, qk_l2norm=True,
                    safe_gate=False)


def _recorder(monkeypatch):
    monkeypatch.setattr(P, "_prepared", set())
    runs = []

    def forward(stages, a):
        runs.append(("forward", tuple(a.cu_seqlens.tolist()), None if a.h0 is None else tuple(a.h0.shape)))
        return a.v, None, ["saved"]

    def backward(stages, a, saved, do, dht):
        assert saved == ["saved"] and do is a.v and dht is None
        runs.append(("backward", tuple(a.cu_seqlens.tolist())))

    return runs, forward, backward


def test_the_first_packed_call_runs_each_missing_build_once(monkeypatch):
    runs, forward, backward = _recorder(monkeypatch)
    a = _args(h0=True)
    own = P.builds(tuple(a.cu_seqlens.tolist()), 16, 128, SMS)
    P.prepare("stages", a, forward, backward)
    first = [r[:2] for r in runs]
    packings = [r[1] for r in runs if r[0] == "forward"]
    assert [r[1] for r in runs if r[0] == "backward"] == packings and packings
    assert all(r[2] == (len(r[1]) - 1, 16, 64, 128) for r in runs if r[0] == "forward")   # one state each
    reps = P.representatives(2048, 16, 128, SMS)
    every = set().union(*(P.builds(b, 16, 128, SMS) for b in reps))
    assert own | set().union(*(P.builds(b, 16, 128, SMS) for b in packings)) == every
    assert own < every                      # this call's packing alone would leave builds for later steps
    covered = set(own)
    for b in packings:                      # each run adds a build
        assert P.builds(b, 16, 128, SMS) - covered
        covered |= P.builds(b, 16, 128, SMS)

    runs.clear()
    P.prepare("stages", _args(cu=(0, 2048), h0=True), forward, backward)   # same configuration, other packing
    P.prepare("stages", _args(cu=(0, 5, 1500, 2000, 2048), h0=True), forward, backward)
    assert runs == []
    unpacked = _args(h0=True)
    unpacked.cu_seqlens = None
    P.prepare("stages", unpacked, forward, backward)
    assert runs == []
    P.prepare("stages", _args(T=1900, cu=(0, 300, 1900), h0=True), forward, backward)  # 16 no longer divides T
    assert runs and all(r[1][-1] == 1900 for r in runs)
    runs.clear()
    P.prepare("stages", _args(dtype=torch.float16), forward, backward)  # another configuration
    P.prepare("other stages", _args(), forward, backward)
    assert [r[:2] for r in runs] == 2 * first
