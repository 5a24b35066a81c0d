"""dev/kernel_registers.py: rewy's kernels compile for sm_90 on a machine without a GPU, and
the resource figures it reads back from the cubin behave as compiled code must. It runs in a
subprocess without TRITON_INTERPRET, which the other tests set and under which kernels cannot be
compiled.

Every run the tests below look at is one call of the command's main() in one of two subprocesses
that run at once (Python's start and FLA's import, seconds each, are paid once per subprocess); each
call's exit status, output and rows are its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

# The developer scripts live in dev/ at the repository root, not in the installed package.
DEV = Path(__file__).resolve().parents[2] / "dev"

# main() once per (arguments, extra environment), each call's environment restored after it; a
# record separator line with the exit status ends each call's stdout and stderr.
_MAIN_PER_RUN = """
import json, os, sys, traceback
sys.path.insert(0, sys.argv[2])
import kernel_registers
for argv, env in json.loads(sys.argv[1]):
    saved = dict(os.environ)
    os.environ.update(env)
    sys.argv = ["kernel_registers", *argv]
    try:
        code = kernel_registers.main()
    except SystemExit as e:
        code = e.code
    except Exception:
        traceback.print_exc()
        code = "crashed"
    os.environ.clear()
    os.environ.update(saved)
    for stream in (sys.stdout, sys.stderr):
        print(f"\\x1e{code}", file=stream, flush=True)
"""


def _runs(d):
    """name -> (arguments, extra environment) of every run checked here; rows go to d/<name>.json."""
    rows = lambda name: ["--json", str(d / f"{name}.json")]  # noqa: E731
    pair = lambda bv: ["--kernel", "gdn-walk", "fla-dhu", "--warps", "4", "--stages", "2", "--block-k", str(bv)]  # noqa: E731
    intra_23 = ["--kernel", "kda-intra", "--warps", "2", "--stages", "3"]
    local = lambda bv: ["--kernel", "gdn-local", "--warps", "4", "--stages", "2", "--bv", str(bv)]  # noqa: E731
    runs = {
        "stages": ["--kernel", "kda-intra", "gdn2-wy", "--opcodes", "40", *rows("stages")],
        "prestage": ["--kernel", "gdn-prestage", "--opcodes", "60", *rows("prestage")],
        "packed": ["--kernel", "gdn-prestage", "--warps", "4", "--stages", "2", "--packed", *rows("packed")],
        "walk": ["--kernel", "gdn-walk", "--opcodes", "60", *rows("walk")],
        "pair32": [*pair(32), *rows("pair32")],
        "pair64": [*pair(64), *rows("pair64")],
        "unknown kernel": ["--kernel", "kda"],
        "uncapped": [*intra_23, *rows("uncapped")],
        "capped": [*intra_23, "--maxnreg", "168", *rows("capped")],
        "cap without a config": ["--kernel", "kda-intra", "--maxnreg", "168"],
        "bv32": [*local(32), *rows("bv32")],
        "bv128": [*local(128), *rows("bv128")],
    }
    runs.update(_picks_runs(d, rows))
    out = {name: (argv, {}) for name, argv in runs.items()}
    out["interpreted"] = (["--kernel", "kda-intra"], {"TRITON_INTERPRET": "1"})
    return out


def _pick(names, key, kwargs, warps, stages):
    return {"key_names": names, "key": key, "kwargs": kwargs, "num_warps": warps, "num_stages": stages}


def _picks_runs(d, rows) -> dict:
    """A bench file whose rows record the picks of a dense KDA row, a packed GDN row (as dev/bench_lab
    writes them on a GPU; the picks match configs the other runs compile directly), a GDN2 row, and a
    file without picks."""
    intra = "rewy_hf.kernels.triton_backend.vector_gate.intra_backward.rewy_kda_bwd_intra_kernel"
    prestage = "rewy_hf.kernels.triton_backend.scalar_gate.prestage.rewy_gdn_prestage_kernel"
    wy = "rewy_hf.kernels.triton_backend.vector_gate.wy_backward.rewy_kda_bwd_wy_kernel"
    bench = {"kind": "ops", "rows": [
        {"op": "kda", "policy": "full", "B": 8, "T": 2048, "H": 16, "N": 0, "autotune_picks": {
            intra: [_pick(["SIZE", "H", "HV", "K", "BK", "VEC", "NDB", "NKI"],
                          [3, 16, 16, 128, 64, False, 3, 2, "torch.bfloat16", "torch.float32"], {}, 2, 3)],
            "fla.ops.kda.chunk_intra.chunk_kda_fwd_kernel_intra_sub_chunk": [
                _pick(["H", "K"], [16, 128, "torch.bfloat16"], {}, 4, 2)]}},
        {"op": "gdn", "policy": "recompute", "B": 1, "T": 4096, "H": 16, "N": 2, "autotune_picks": {
            prestage: [_pick(["H", "HV", "K", "V", "BT", "BK", "BV", "USE_G", "IS_VARLEN"],
                             [16, 16, 128, 128, 64, 64, 64, True, True, "torch.bfloat16"], {}, 4, 2)]}},
        {"op": "gdn2", "policy": "full", "B": 8, "T": 2048, "H": 16, "N": 0, "autotune_picks": {
            wy: [_pick(["SIZE", "H", "HV", "K", "V", "BK", "VEC", "STATE_V_FIRST"],
                       [3, 16, 16, 128, 128, 64, True, False, "torch.bfloat16"], {"BV": 64}, 4, 1)]}},
        # FLA's walk keys on BV, which its configs set: the recorded key has no value for it
        {"op": "gdn", "policy": "full", "B": 8, "T": 2048, "H": 16, "N": 0, "autotune_picks": {
            "fla.ops.common.chunk_delta_h.chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64": [
                _pick(["H", "HV", "K", "V", "BT", "BV", "USE_G", "STATE_V_FIRST"],
                      [16, 16, 128, 128, 64, True, False, "torch.bfloat16", "torch.bfloat16"], {"BV": 64}, 4, 2)]}}]}
    (d / "bench.json").write_text(json.dumps(bench))
    (d / "no-picks.json").write_text(json.dumps({"kind": "ops", "rows": [{"op": "kda", "policy": "full"}]}))
    return {
        "picks": ["--picks", str(d / "bench.json"), *rows("picks")],
        "picks with a config": ["--picks", str(d / "bench.json"), "--warps", "2", "--stages", "2"],
        "picks missing": ["--picks", str(d / "no-picks.json")],
    }


# The runs go to two subprocesses at once (ptxas and Triton's compiler use one core each), split so
# that the heaviest two, "walk" and "stages", are apart.
_SECOND_PROCESS = {"stages", "prestage", "uncapped", "capped", "bv128"}


def _start(planned: dict, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-P", "-c", _MAIN_PER_RUN, json.dumps(list(planned.values())), str(DEV)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _collect(proc: subprocess.Popen, planned: dict, d) -> dict:
    stdout, stderr = proc.communicate(timeout=1200)
    assert proc.returncode == 0, stderr[-3000:]
    outs, errs = stdout.split("\x1e"), stderr.split("\x1e")
    assert len(outs) == len(errs) == len(planned) + 1, stderr[-3000:]
    # parts[i + 1] starts with call i's status line; parts[i] (i > 0) with call i - 1's
    own = lambda parts, i: parts[i].split("\n", 1)[1] if i else parts[0]  # noqa: E731
    results = {}
    for i, name in enumerate(planned):
        code = outs[i + 1].split("\n", 1)[0]
        path = d / f"{name}.json"
        results[name] = SimpleNamespace(returncode=int(code) if code.lstrip("-").isdigit() else code,
                                        stdout=own(outs, i), stderr=own(errs, i),
                                        rows=json.loads(path.read_text()) if path.exists() else None)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("kernel_registers")
    planned = _runs(d)
    assert _SECOND_PROCESS <= set(planned)
    halves = [{k: v for k, v in planned.items() if (k in _SECOND_PROCESS) == second} for second in (False, True)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = [_start(half, env) for half in halves]
    results = {}
    for proc, half in zip(procs, halves):
        results.update(_collect(proc, half, d))
    return results


def _ok(run):
    assert run.returncode == 0, run.stderr[-2000:]
    return run.rows


def test_stages_take_shared_memory_and_registers_stay_in_range(runs):
    """Software pipelining keeps one operand buffer per stage in shared memory, so the Matrix Intra
    kernel with 3 stages needs more of it than with 2 (same warps); the WY kernel's [64, BV] tiles
    need more at BV 128 than at BV 64. Registers per thread are 1..255 on sm_90, and the intra
    kernel's code has tensor-core (HMMA) instructions."""
    r = runs["stages"]
    rows = _ok(r)
    intra = {(x["warps"], x["stages"]): x for x in rows if x["kernel"] == "kda-intra"}
    assert intra[(2, 3)]["shared_bytes"] > intra[(2, 2)]["shared_bytes"] > 0
    wy = {x["BV"]: x for x in rows if x["kernel"] == "gdn2-wy" and (x["warps"], x["stages"]) == (4, 1)}
    assert wy[128]["shared_bytes"] > wy[64]["shared_bytes"]
    assert all(0 < x["registers"] <= 255 and x["spill_bytes"] >= 0 and x["instructions"] > 0 for x in rows)
    # Matrix Intra's contractions run on the tensor cores: sm_90's HMMA instructions are in its code
    lines = r.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("kda-intra"))
    assert "HMMA" in lines[first + 1].split()           # the opcode line printed under that config


def test_fused_prestage_compiles_to_tensor_cores_without_spills(runs):
    """The fused w/u recompute + local dv kernel is bound by memory: it must not spill at any listed
    config, and its products run on the tensor cores."""
    r = runs["prestage"]
    rows = _ok(r)
    assert len(rows) == 4 and all(x["spill_bytes"] == 0 and 0 < x["registers"] <= 255 for x in rows)
    ops = r.stdout.splitlines()[2].split()           # after the compiler line and the first config
    assert "HGMMA" in ops or "HMMA" in ops


def test_every_row_names_the_compiler(runs):
    """Each triton version compiles differently, so the first printed line and every JSON row name the
    triton that compiled (the one this process imports), and the header names the target."""
    import triton

    r = runs["prestage"]
    assert r.stdout.splitlines()[0].startswith(f"triton {triton.__version__}, sm_90, K = 128, V = 128")
    assert {x["triton"] for x in _ok(r)} == {triton.__version__}
    assert runs["packed"].stdout.splitlines()[0].endswith(", packed")


def test_packed_build_carries_the_sequence_ends(runs):
    """--packed compiles a kernel as a call with packed sequences (cu_seqlens) does: a chunk's rows end
    where its sequence ends, read from the packing tables, so the build has the row masks and table
    loads that the build for full chunks folds away: more instructions at the same config, still no
    spills for the prestage."""
    (packed,) = _ok(runs["packed"])
    dense = [x for x in _ok(runs["prestage"]) if (x["warps"], x["stages"]) == (4, 2)]
    assert len(dense) == 1 and packed["packed"] is True and dense[0]["packed"] is False
    assert packed["instructions"] > dense[0]["instructions"], (packed, dense[0])
    assert packed["spill_bytes"] == 0


def test_walk_compiles_as_lean_as_flas_walk(runs):
    """rewy's reverse walk has FLA's six products per chunk, with the gated queries' product on 16-bit
    operands where FLA's takes fp32 ones. At every listed config it runs on the tensor cores within
    255 registers, and at the configs FLA's autotuner also lists (BV 32 / 64 at 4 warps) it compiles
    to no more instructions, registers and spill bytes than FLA's kernel (a walk holding one 128-row
    key tile instead of two halves ran 1.7x slower than FLA's on the H200)."""
    r = runs["walk"]
    rows = _ok(r)
    assert len(rows) == 18 and all(0 < x["registers"] <= 255 for x in rows)
    ops = r.stdout.splitlines()[2].split()
    assert "HGMMA" in ops or "HMMA" in ops
    for bv in (32, 64):
        pair = {x["kernel"]: x for x in _ok(runs[f"pair{bv}"])}
        assert len(pair) == 2
        walk, fla = pair["gdn-walk"], pair["fla-dhu"]
        assert walk["instructions"] <= fla["instructions"], (bv, walk, fla)
        assert walk["registers"] <= fla["registers"] and walk["spill_bytes"] <= fla["spill_bytes"], (bv, walk, fla)


def test_refusals_name_the_problem(runs):
    r = runs["unknown kernel"]
    names = "kda-intra, gdn2-intra, kda-wy, gdn2-wy, gdn-local, gdn-prestage, gdn-walk or fla-dhu"
    assert r.returncode == 2 and names in r.stderr
    r = runs["interpreted"]
    assert r.returncode == 2 and "unset it" in r.stderr


def test_a_register_cap_is_honoured_by_spilling(runs):
    """--maxnreg caps registers per thread as a triton.Config's maxnreg does: the uncapped Matrix Intra
    kernel needs more than 168 registers, so under the cap ptxas keeps to it and moves the rest to
    local memory (more spill bytes than without the cap)."""
    (uncapped,), (capped,) = _ok(runs["uncapped"]), _ok(runs["capped"])
    assert uncapped["registers"] > 168 >= capped["registers"]
    assert capped["maxnreg"] == 168 and "maxnreg" not in uncapped
    assert capped["spill_bytes"] > uncapped["spill_bytes"]
    r = runs["cap without a config"]
    assert r.returncode == 2 and "--maxnreg needs --warps and --stages" in r.stderr


def test_a_chosen_value_tile_is_compiled(runs):
    """--bv sets the value tile of a kernel that tunes it (with --warps / --stages, the autotune
    list is replaced and would otherwise leave BV unset): wider tiles of the GDN local kernel's
    software-pipelined loop take more shared memory."""
    (narrow,), (wide,) = _ok(runs["bv32"]), _ok(runs["bv128"])
    assert narrow["BV"] == 32 and wide["BV"] == 128
    assert wide["shared_bytes"] > narrow["shared_bytes"] > 0


def test_picks_of_a_bench_run_compile_as_those_configs(runs):
    """--picks compiles each of rewy's kernels at the config a bench row recorded, with the autotune
    key's constants and the row's packing: the same builds as naming the kernel and config directly
    (same registers, spill, shared memory and instructions); FLA's picks are counted and left out."""
    r = runs["picks"]
    intra, prestage, wy, dhu = _ok(r)
    (direct_intra,), (direct_packed,) = _ok(runs["uncapped"]), _ok(runs["packed"])
    (direct_dhu,) = [x for x in _ok(runs["pair64"]) if x["kernel"] == "fla-dhu"]
    (direct_wy,) = [x for x in _ok(runs["stages"]) if x["kernel"] == "gdn2-wy" and x["BV"] == 64 and x["warps"] == 4]
    fields = ("registers", "spill_bytes", "shared_bytes", "instructions")
    assert intra["kernel"] == "kda-intra" and (intra["warps"], intra["stages"], intra["packed"]) == (2, 3, False)
    assert all(intra[f] == direct_intra[f] for f in fields), (intra, direct_intra)
    assert prestage["kernel"] == "gdn-prestage" and prestage["packed"] is True
    assert all(prestage[f] == direct_packed[f] for f in fields), (prestage, direct_packed)
    assert wy["kernel"] == "gdn2-wy" and (wy["BV"], wy["warps"], wy["stages"]) == (64, 4, 1)   # VEC: GDN2's build
    assert all(wy[f] == direct_wy[f] for f in fields), (wy, direct_wy)
    assert dhu["kernel"] == "fla-dhu" and (dhu["BV"], dhu["H"], dhu["warps"], dhu["stages"]) == (64, 16, 4, 2)
    assert all(dhu[f] == direct_dhu[f] for f in fields), (dhu, direct_dhu)
    assert intra["bench_rows"] == ["kda full 8,2048,16"]
    assert prestage["bench_rows"] == ["gdn recompute 1,4096,16,packed=2"]
    assert "(1 picks of kernels this tool does not build, FLA's, left out)" in r.stdout
    refused = runs["picks with a config"]
    assert refused.returncode == 2 and "leave out --kernel, --warps" in refused.stderr
    assert runs["picks missing"].returncode == 2 and "no row records a pick" in runs["picks missing"].stderr
