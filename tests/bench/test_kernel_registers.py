"""rewy_hf.bench.kernel_registers: rewy's kernels compile for sm_90 on a machine without a GPU, and
the resource figures it reads back from the cubin behave as compiled code must. It runs in a
subprocess without TRITON_INTERPRET, which the other tests set and under which kernels cannot be
compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _run(*args, interpret: bool = False, **extra_env):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(extra_env)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-P", "-m", "rewy_hf.bench.kernel_registers", *args], capture_output=True, text=True, env=env,
                          timeout=600)


# The command's main() once per argument list, in one process: FLA's kernels take seconds to import.
_MAIN_PER_ARGV = """
import json, sys
from rewy_hf.bench import kernel_registers
for argv in json.loads(sys.argv[1]):
    sys.argv = ["kernel_registers", *argv]
    code = kernel_registers.main()
    if code:
        raise SystemExit(code)
"""


def _run_each(*argvs):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-P", "-c", _MAIN_PER_ARGV, json.dumps(argvs)], capture_output=True,
                          text=True, env=env, timeout=600)


def test_stages_take_shared_memory_and_registers_stay_in_range(tmp_path):
    """Software pipelining keeps one operand buffer per stage in shared memory, so the Matrix Intra
    kernel with 3 stages needs more of it than with 2 (same warps); the WY kernel's [64, BV] tiles
    need more at BV 128 than at BV 64. Registers per thread are 1..255 on sm_90, and the intra
    kernel's code has tensor-core (HMMA) instructions."""
    out = tmp_path / "rows.json"
    r = _run("--kernel", "kda-intra", "gdn2-wy", "--opcodes", "40", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())
    intra = {(x["warps"], x["stages"]): x for x in rows if x["kernel"] == "kda-intra"}
    assert intra[(2, 3)]["shared_bytes"] > intra[(2, 2)]["shared_bytes"] > 0
    wy = {x["BV"]: x for x in rows if x["kernel"] == "gdn2-wy" and (x["warps"], x["stages"]) == (4, 1)}
    assert wy[128]["shared_bytes"] > wy[64]["shared_bytes"]
    assert all(0 < x["registers"] <= 255 and x["spill_bytes"] >= 0 and x["instructions"] > 0 for x in rows)
    # Matrix Intra's contractions run on the tensor cores: sm_90's HMMA instructions are in its code
    lines = r.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("kda-intra"))
    assert "HMMA" in lines[first + 1].split()           # the opcode line printed under that config


@pytest.mark.parametrize("form", ["local-dv", "scores"])
def test_fused_prestage_compiles_to_tensor_cores_without_spills(form, tmp_path):
    """The fused w/u recompute + local dv kernel is bound by memory: in both of its forms (the local
    dv for FLA's reverse recurrence, the score tile for rewy's walk) it must not spill at any listed
    config, and its products run on the tensor cores."""
    out = tmp_path / "rows.json"
    r = _run("--kernel", "gdn-prestage", "--prestage-form", form, "--opcodes", "60", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 4 and all(x["spill_bytes"] == 0 and 0 < x["registers"] <= 255 for x in rows)
    ops = r.stdout.splitlines()[1].split()
    assert "HGMMA" in ops or "HMMA" in ops


def test_walk_compiles_as_lean_as_flas_walk(tmp_path):
    """rewy's reverse walk adds one product per chunk (S^T dO, 7 against 6) to
    FLA's walk, off the sequential chain. At every listed config it runs on the tensor cores within
    255 registers, and at the configs FLA's autotuner also lists (BV 32 / 64 at 4 warps) it compiles
    to no more instructions per product and no more spill bytes than FLA's kernel (a walk holding
    one 128-row key tile instead of two halves ran 1.7x slower than FLA's on the H200)."""
    out = tmp_path / "rows.json"
    r = _run("--kernel", "gdn-walk", "--opcodes", "60", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 18 and all(0 < x["registers"] <= 255 for x in rows)
    ops = r.stdout.splitlines()[1].split()
    assert "HGMMA" in ops or "HMMA" in ops
    pairs = {bv: tmp_path / f"pair{bv}.json" for bv in (32, 64)}
    r = _run_each(*(["--kernel", "gdn-walk", "fla-dhu", "--warps", "4", "--stages", "2", "--block-k", str(bv),
                     "--json", str(out)] for bv, out in pairs.items()))
    assert r.returncode == 0, r.stderr[-2000:]
    for bv, out in pairs.items():
        pair = {x["kernel"]: x for x in json.loads(out.read_text())}
        assert len(pair) == 2
        walk, fla = pair["gdn-walk"], pair["fla-dhu"]
        assert walk["instructions"] / 7 <= fla["instructions"] / 6, (bv, walk, fla)
        assert walk["spill_bytes"] <= fla["spill_bytes"], (bv, walk, fla)


def test_refusals_name_the_problem():
    r = _run("--kernel", "kda")
    names = "kda-intra, gdn2-intra, kda-wy, gdn2-wy, gdn-local, gdn-prestage, gdn-walk or fla-dhu"
    assert r.returncode == 2 and names in r.stderr
    r = _run("--kernel", "kda-intra", interpret=True)
    assert r.returncode == 2 and "unset it" in r.stderr


def test_a_register_cap_is_honoured_by_spilling(tmp_path):
    """--maxnreg caps registers per thread as a triton.Config's maxnreg does: the uncapped Matrix Intra
    kernel needs more than 168 registers, so under the cap ptxas keeps to it and moves the rest to
    local memory (more spill bytes than without the cap)."""
    paths = {cap: tmp_path / f"cap{cap}.json" for cap in (None, 168)}
    r = _run_each(*(["--kernel", "kda-intra", "--warps", "2", "--stages", "3", "--json", str(path),
                     *(["--maxnreg", str(cap)] if cap else [])] for cap, path in paths.items()))
    assert r.returncode == 0, r.stderr[-2000:]
    out = {}
    for cap, path in paths.items():
        (out[cap],) = json.loads(path.read_text())
    assert out[None]["registers"] > 168 >= out[168]["registers"]
    assert out[168]["maxnreg"] == 168 and "maxnreg" not in out[None]
    assert out[168]["spill_bytes"] > out[None]["spill_bytes"]
    r = _run("--kernel", "kda-intra", "--maxnreg", "168")
    assert r.returncode == 2 and "--maxnreg needs --warps and --stages" in r.stderr


def test_a_chosen_value_tile_is_compiled(tmp_path):
    """--bv sets the value tile of a kernel that tunes it (with --warps / --stages, the autotune
    list is replaced and would otherwise leave BV unset): wider tiles of the GDN local kernel's
    software-pipelined loop take more shared memory."""
    paths = {bv: tmp_path / f"bv{bv}.json" for bv in (32, 128)}
    r = _run_each(*(["--kernel", "gdn-local", "--warps", "4", "--stages", "2", "--bv", str(bv), "--json", str(path)]
                    for bv, path in paths.items()))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {}
    for bv, path in paths.items():
        (rows[bv],) = json.loads(path.read_text())
    assert rows[32]["BV"] == 32 and rows[128]["BV"] == 128
    assert rows[128]["shared_bytes"] > rows[32]["shared_bytes"] > 0
