"""The README's first command ends in `python -m rewy_hf.demo`: it must pass."""

from rewy_hf import demo


def test_demo_reports_parity_for_all_ops(capsys):
    assert demo.main() == 0
    out = capsys.readouterr().out
    for op in ("chunk_delta_rule", "chunk_gated_delta_rule", "chunk_kda", "chunk_gdn2"):
        line = next(l for l in out.splitlines() if l.startswith(op))
        assert line.rstrip().endswith("PASS")
