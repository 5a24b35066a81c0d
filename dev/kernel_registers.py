"""Registers, spill stack, shared memory and instruction counts of rewy's backward kernels, compiled without a GPU.

Triton compiles for an NVIDIA target on any machine: its wheel carries ptxas,
so ``triton.compile`` with a ``GPUTarget`` produces the cubin that a GPU of
that architecture would run, and cuobjdump reads its resource usage and its
machine code (SASS). That answers "does this change spill?" and "how many
instructions does it remove?" in seconds on a machine without a GPU.
The instruction count is static (each instruction once, loops not
unrolled); ``--opcodes N`` prints the N most frequent opcodes.
What it cannot say is how fast the kernel runs: fewer spills do not always
mean a faster kernel. Each triton version compiles differently (the same
kernel can spill 112 B under one and 312 B under another), so compile with the
version the GPU machine runs: install it apart and put it first on the path,

    pip install --no-deps --target /tmp/triton-3.6 triton==3.6.0
    PYTHONPATH=/tmp/triton-3.6 python -P $REPO/dev/kernel_registers.py

The first printed line and every JSON row name the triton that compiled.
A profiler on the GPU has the final word.

    python $REPO/dev/kernel_registers.py --kernel kda-intra gdn-local
    python $REPO/dev/kernel_registers.py --kernel kda-intra --warps 2 --stages 2 --block-k 32
    python $REPO/dev/kernel_registers.py --kernel gdn-local --warps 8 --stages 2 --bv 32
    python $REPO/dev/kernel_registers.py --kernel kda-wy --packed    # as a packed-sequence call compiles it
    python $REPO/dev/kernel_registers.py --picks run.json            # the configs a GPU bench run picked

``--picks`` reads the ``autotune_picks`` that the developer bench (dev/bench_lab)
records in each row on a GPU and compiles each of rewy's kernels at the config it ran with
there, with the constants of the autotune key (heads, head dims, key block,
gate kind); constants outside the key are taken as ``kernel_spec`` sets them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

# triton 3.9 warns unless this is set; 1 keeps its default (and triton 3.6's behaviour) of fusing mul + add
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

# Pointer arguments that hold 16-bit data at the bench's settings (BF16 inputs); every other pointer is fp32.
_BF16 = {
    "intra": {"q", "k", "beta"},
    "wy": {"q", "k", "v", "v_new", "beta", "wg", "A", "h", "dh", "do", "dv2", "dv", "dw"},
    "gdn-local": {"q", "k", "v", "v_new", "beta", "A", "h", "dh", "do", "dv2", "dv"},
    "gdn-prestage": {"q", "k", "v", "beta", "A", "do", "w", "u", "dv"},
    "gdn-walk": {"q", "k", "w", "dv", "do", "dh", "dv2"},
    "fla-dhu": {"q", "k", "w", "do", "dh", "dv", "dv2"},
}
_SCALARS = {"T": "i32", "SIZE": "i32", "scale": "fp32", "span_limit": "fp32", "NS": "i32", "HV": "i32", "NT": "i32", "L": "i32"}
KERNELS = ("kda-intra", "gdn2-intra", "kda-wy", "gdn2-wy", "gdn-local", "gdn-prestage", "gdn-walk", "fla-dhu")
_INDEX_POINTERS = {"cu_seqlens", "chunk_indices", "chunk_offsets", "chunk_order"}


def kernel_spec(name: str, K: int = 128, V: int = 128, H: int = 16, block_k: int | None = None,
                packed: bool = False):
    """(autotuned kernel, dtype group, constexpr values) of one rewy kernel at K, V and H heads; ``packed``:
    as a call with packed sequences (``cu_seqlens``) compiles it, else as one with full chunks only."""
    from rewy_hf.kernels.triton_backend.scalar_gate import local_backward, prestage, reverse_walk
    from rewy_hf.kernels.triton_backend.vector_gate import common, intra_backward, wy_backward

    heads = dict(H=H, HV=H, K=K, BT=64)
    if name in ("kda-intra", "gdn2-intra"):
        bk = block_k or common.INTRA_BLOCK_K
        const = dict(heads, BC=common.SUB_BLOCK, BK=bk, NC=64 // common.SUB_BLOCK, NDB=triton.cdiv(K, 64) + 1,
                     NKI=triton.cdiv(K, bk), VEC=name == "gdn2-intra", IS_VARLEN=packed, FULL_T=not packed,
                     PREC=common.INTRA_PRECISION, DPREC=common.DIAG_PRECISION)
        return intra_backward.rewy_kda_bwd_intra_kernel, "intra", const
    if name in ("kda-wy", "gdn2-wy"):
        bk = block_k or 64
        const = dict(heads, V=V, BK=bk, NK=triton.cdiv(K, bk), VEC=name == "gdn2-wy", STATE_V_FIRST=False,
                     IS_VARLEN=packed, WPREC=common.WY_PRECISION, FULL_T=not packed)
        return wy_backward.rewy_kda_bwd_wy_kernel, "wy", const
    if name == "gdn-local":
        return local_backward.rewy_gdn_bwd_local_kernel, "gdn-local", dict(heads, V=V, BK=block_k or 64, USE_G=True,
                                                                           IS_VARLEN=packed, FULL_T=not packed)
    if name == "gdn-prestage":
        bk = block_k or 64          # the tile over K and V
        BK, BV = min(bk, K), min(bk, V)
        return prestage.prestage_kernel(BK, BV), name, dict(heads, V=V, BK=BK, BV=BV, USE_G=True, IS_VARLEN=packed,
                                                            FULL_T=not packed)
    if name in ("gdn-walk", "fla-dhu"):
        # the reverse state walk, GDN gate, K-first state, h0 and dht given; block_k: its value block BV
        const = dict(heads, V=V, BV=block_k or 32, USE_G=True, IS_VARLEN=packed)
        if name == "gdn-walk":
            return reverse_walk.rewy_gdn_walk_kernel, name, dict(const, USE_DHT=True, USE_DH0=True, NARROW=False)
        from fla.ops.common import chunk_delta_h as fla

        return fla.chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64, name, dict(
            const, USE_GK=False, USE_INITIAL_STATE=True, USE_FINAL_STATE_GRADIENT=True, STATE_V_FIRST=False)
    raise ValueError(f"unknown kernel {name!r}: {', '.join(KERNELS[:-1])} or {KERNELS[-1]}")


def picked_configs(path: str) -> tuple[list[dict], int]:
    """The distinct picks of the kernels this tool builds in a `rewy-hf bench --json` file: dicts with the
    kernel's name here, its constants, the config, ``packed`` and the rows (labels) that ran it; and how
    many picks of other kernels (FLA's) were left out."""
    with open(path) as f:
        data = json.load(f)
    by_function: dict[str, list[str]] = {}
    for name in KERNELS:
        by_function.setdefault(_jit_function(kernel_spec(name)[0]).__name__, []).append(name)
    found: dict[tuple, dict] = {}
    others = 0
    for row in data.get("rows", []):
        if "autotune_picks" not in row:
            continue
        packed = bool(row.get("N"))
        label = f"{row['op']} {row['policy']} {row['B']},{row['T']},{row['H']}"
        label += f",packed={row['N']}" if packed else ""
        for qualified, entries in row["autotune_picks"].items():
            names = by_function.get(qualified.rsplit(".", 1)[-1])
            for e in entries:
                if names is None:
                    others += 1
                    continue
                # the autotuner's key holds only the named arguments the call passed: a name its config
                # sets (FLA's walk keys on BV, which its configs choose) has no value there
                key = dict(zip([k for k in e["key_names"] if k not in e["kwargs"]], e["key"]))
                # Matrix Intra and Residual WY serve KDA and GDN2: the key's VEC says which
                name = names[-1] if len(names) > 1 and key.get("VEC") else names[0]
                kernel, group, const = kernel_spec(name, key.get("K", 128), key.get("V", 128), key.get("H", 16),
                                                   packed=packed)
                const.update({k: v for k, v in key.items() if k in const})
                if name == "fla-dhu":
                    # FLA's key leaves out its key-wise gate, which KDA's and GDN2's walks use
                    const["USE_GK"] = row["op"] in ("kda", "gdn2")
                config = triton.Config(e["kwargs"], num_warps=e["num_warps"], num_stages=e["num_stages"],
                                       maxnreg=e.get("maxnreg"))
                ident = (name, tuple(sorted(const.items())), tuple(sorted(e["kwargs"].items())), e["num_warps"],
                         e["num_stages"], e.get("maxnreg"), packed)
                entry = found.setdefault(ident, dict(name=name, kernel=kernel, group=group, const=const,
                                                     config=config, packed=packed, rows=[]))
                if label not in entry["rows"]:
                    entry["rows"].append(label)
    return list(found.values()), others


def _jit_function(kernel):
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn                                   # autotuner / heuristics wrappers
    return kernel


def compile_for(kernel, group: str, const: dict, num_warps: int, num_stages: int, arch: int = 90,
                maxnreg: int | None = None):
    """The kernel compiled for sm_<arch> as the launcher would specialize it (16-byte aligned pointers);
    ``maxnreg`` caps the registers per thread as a ``triton.Config`` with that field does."""
    fn = _jit_function(kernel)
    names = fn.arg_names
    sig = {}
    for n in names:
        if n in const:
            sig[n] = "constexpr"
        elif n in _SCALARS:
            sig[n] = _SCALARS[n]
        elif n in _INDEX_POINTERS:
            sig[n] = "*i32"
        else:
            sig[n] = "*bf16" if n in _BF16[group] else "*fp32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(c),): v for c, v in const.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages,
                                       **({"maxnreg": maxnreg} if maxnreg else {})))


def _cuobjdump(compiled, flag: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


# one SASS instruction line: /*0a30*/  @!P0 FFMA.FTZ R4, ...  -> FFMA
_SASS_OP = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def opcode_counts(compiled) -> collections.Counter:
    """Static SASS instructions of a compiled kernel, per opcode (modifiers dropped: FFMA.FTZ is FFMA)."""
    return collections.Counter(m.group(1) for line in _cuobjdump(compiled, "-sass").splitlines()
                               if (m := _SASS_OP.match(line)))


def resource_usage(compiled) -> dict:
    """Registers per thread, spill stack bytes per thread and shared memory bytes of a compiled kernel."""
    out = _cuobjdump(compiled, "--dump-resource-usage")
    fields = dict(tok.split(":", 1) for line in out.splitlines() if "REG:" in line
                  for tok in line.split() if ":" in tok)
    if "REG" not in fields:
        raise RuntimeError(f"cuobjdump printed no resource line:\n{out}")
    return dict(registers=int(fields["REG"]), spill_bytes=int(fields["STACK"]),
                shared_bytes=int(compiled.metadata.shared))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", nargs="+", default=list(KERNELS[:5]),
                   help=f"any of {', '.join(KERNELS)} (default: the five backward kernels of KDA, GDN2 and GDN)")
    p.add_argument("--warps", type=int, default=None, help="with --stages: this config instead of the autotune list")
    p.add_argument("--stages", type=int, default=None)
    p.add_argument("--maxnreg", type=int, default=None, help="with --warps / --stages: a register cap per thread")
    p.add_argument("--bv", type=int, default=None,
                   help="with --warps / --stages: value columns per step (BV) of the kernels that tune it")
    p.add_argument("--block-k", type=int, default=None, help="key channels per program (default: the wrapper's)")
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--packed", action="store_true",
                   help="compile each kernel as a call with packed sequences (cu_seqlens) does")
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 / H200)")
    p.add_argument("--opcodes", type=int, default=0, help="also print the N most frequent SASS opcodes")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--picks", default=None, metavar="RUN.json",
                   help="compile each of rewy's kernels at the configs a GPU dev/bench_lab --json run picked")
    a = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("TRITON_INTERPRET=1 makes Triton's kernels Python functions, which cannot be compiled: unset it")
    if (a.warps is None) != (a.stages is None):
        p.error("--warps and --stages go together")
    if a.maxnreg and a.warps is None:
        p.error("--maxnreg needs --warps and --stages (it caps one config)")
    if a.picks:
        if a.warps or a.stages or a.packed or a.bv or a.block_k or a.maxnreg or p.get_default("kernel") != a.kernel:
            p.error("--picks takes the kernels, shapes and configs from the run's file: leave out --kernel, --warps, "
                    "--stages, --maxnreg, --bv, --block-k and --packed")
        return _compile_picks(a, p)
    rows = []
    print(f"triton {triton.__version__}, sm_{a.arch}, K = {a.K}, V = {a.V}{', packed' if a.packed else ''}", flush=True)
    for name in a.kernel:
        try:
            kernel, group, const = kernel_spec(name, a.K, a.V, block_k=a.block_k, packed=a.packed)
        except ValueError as e:
            p.error(str(e))
        # a kernel without an autotune list is compiled as launched: 4 warps, Triton's default 3 stages
        tuned = {"BV": a.bv} if a.bv else {}
        configs = ([triton.Config(tuned, num_warps=a.warps, num_stages=a.stages, maxnreg=a.maxnreg)] if a.warps
                   else getattr(kernel, "configs", [triton.Config({}, num_warps=4, num_stages=3)]))
        for c in configs:
            knobs, use = _measure(kernel, group, const, c, a.arch, a.opcodes, name)
            rows.append(dict(kernel=name, packed=a.packed, **knobs, **use, triton=triton.__version__))
    _write_rows(a.json, rows)
    return 0


def _measure(kernel, group: str, const: dict, c: triton.Config, arch: int, opcodes: int, name: str,
             packed: bool = False, note: str = "") -> tuple[dict, dict]:
    """Compile one config, print its line (and its ``opcodes`` most frequent opcodes); (knobs, usage)."""
    compiled = compile_for(kernel, group, {**const, **c.kwargs}, c.num_warps, c.num_stages, arch, c.maxnreg)
    use = resource_usage(compiled)
    ops = opcode_counts(compiled)
    use["instructions"] = sum(ops.values())
    knobs = {**c.kwargs, "warps": c.num_warps, "stages": c.num_stages, **({"maxnreg": c.maxnreg} if c.maxnreg else {})}
    cfg = " ".join(f"{k}={v}" for k, v in knobs.items())
    print(f"{name:<11} {cfg:<28} registers {use['registers']:>3}  spill {use['spill_bytes']:>4} B"
          f"  shared {use['shared_bytes']:>6} B  instructions {use['instructions']:>5}"
          + ("  (packed)" if packed else "") + note, flush=True)
    if opcodes:
        print("    " + "  ".join(f"{op} {n}" for op, n in ops.most_common(opcodes)), flush=True)
    return knobs, use


def _write_rows(path: str | None, rows: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def _compile_picks(a, p: argparse.ArgumentParser) -> int:
    try:
        picked, others = picked_configs(a.picks)
    except (OSError, ValueError, KeyError) as e:
        p.error(f"--picks {a.picks}: not a `rewy-hf bench --json` file ({type(e).__name__}: {e})")
    print(f"triton {triton.__version__}, sm_{a.arch}, the configs picked in {a.picks}", flush=True)
    if not picked:
        p.error(f"--picks {a.picks}: no row records a pick of a kernel this tool builds (dev/bench_lab records "
                "them on a GPU, in each row's autotune_picks)")
    rows = []
    for e in picked:
        knobs, use = _measure(e["kernel"], e["group"], e["const"], e["config"], a.arch, a.opcodes, e["name"],
                              e["packed"], f"  <- {'; '.join(e['rows'])}")
        shape = {k: e["const"][k] for k in ("H", "HV", "K", "V", "BK") if k in e["const"]}
        rows.append(dict(kernel=e["name"], packed=e["packed"], **knobs, **shape, **use, triton=triton.__version__,
                         bench_rows=e["rows"]))
    if others:
        print(f"({others} picks of kernels this tool does not build, FLA's, left out)", flush=True)
    _write_rows(a.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
