"""dev/gdn_floor.py: the product counts it publishes follow the kernels' product lists, the floor is the
roofline's, and docs/bench/floor/gdn-floor.json is what the script makes of the kept profiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dev_scripts import load_dev_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def floor():
    return load_dev_script("gdn_floor")


def test_counts_follow_the_product_lists(floor):
    C, K, V = floor.C, floor.K, floor.V
    state, square = 2 * C * K * V, 2 * C * C * K
    # rewy's local kernel: three state-sized products, seven chunk-square ones, no key Gram.
    assert floor.per_chunk("rewy_gdn_bwd_local_kernel")[0] == 3 * state + 7 * square
    # FlashQLA's fused kernel: seven state-sized, ten chunk-square and two C x C x C products.
    assert floor.per_chunk("tilelang_fused_chunk_gdr_bwd_kernel_kernel")[0] == 7 * state + 10 * square + 2 * 2 * C ** 3
    # At C = 64 and K = 128 the WY backward's two C^3 products cost one chunk-square product: the fused
    # Residual WY design and FlashQLA's kernel issue the same FLOPs, and read and write the same tiles.
    assert floor.per_chunk("fused ReWY (design)") == floor.per_chunk("tilelang_fused_chunk_gdr_bwd_kernel_kernel")


def test_the_floor_is_the_slower_of_compute_and_memory(floor):
    row = next(r for r in floor.rows() if (r["B"], r["T"], r["H"]) == (8, 2048, 16)
               and r["kernel"] == "rewy_gdn_bwd_local_kernel" and r["pipeline"] == "rewy recompute")
    chunks = 8 * 16 * 2048 // floor.C
    flops, nbytes = floor.per_chunk("rewy_gdn_bwd_local_kernel")
    compute_ms = chunks * flops / (floor.PEAK_TFLOPS * 1e12) * 1e3
    memory_ms = chunks * nbytes / (floor.PEAK_TBPS * 1e12) * 1e3
    assert row["floor_ms"] == pytest.approx(max(compute_ms, memory_ms), rel=1e-12)
    assert row["ms"] is not None and row["of_floor"] == pytest.approx(row["floor_ms"] / row["ms"])


def test_packed_rows_count_each_sequences_last_chunk(floor):
    assert floor.chunk_heads(1, 32768, 32, 8) == 32 * 8 * 64
    assert floor.chunk_heads(1, 32768 + 8, 1, 8) == 8 * 65      # each 4097-token sequence ends in a chunk of its own


def test_the_kept_file_is_what_the_script_makes(floor, tmp_path):
    out = tmp_path / "floor.json"
    assert floor.main(["--json", str(out), "--markdown", str(tmp_path / "floor.md")]) == 0
    assert json.loads(out.read_text()) == json.loads((ROOT / "docs/bench/floor/gdn-floor.json").read_text())


def test_the_study_publishes_the_generated_tables(floor, tmp_path):
    """docs/studies.md's floor section carries both tables exactly as the script prints them."""
    out = tmp_path / "floor.md"
    floor.main(["--markdown", str(out)])
    doc = (ROOT / "docs/studies.md").read_text()
    start = doc.index("\n## The floor of a GDN backward\n")
    section = doc[start:doc.index("\n## ", start + 1)].splitlines()
    generated = [line for line in out.read_text().splitlines() if line]
    it = iter(section)
    assert all(any(line == want for line in it) for want in generated)
