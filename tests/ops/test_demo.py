"""`rewy-hf demo`: it must pass, and a broken op must fail it."""

from rewy_hf import cli


def test_demo_reports_parity_for_all_ops(capsys):
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    for op in ("chunk_delta_rule", "chunk_gated_delta_rule", "chunk_kda", "chunk_gdn2"):
        line = next(l for l in out.splitlines() if l.startswith(op))
        assert line.rstrip().endswith("PASS")
    assert "all ops match" in out


def test_demo_fails_when_an_op_is_wrong(capsys, monkeypatch):
    from rewy_hf import ops

    kda = ops.chunk_kda

    def off_by_a_little(*args, **kwargs):
        o, ht = kda(*args, **kwargs)
        return o * (1 + 1e-6), ht

    monkeypatch.setattr(ops, "chunk_kda", off_by_a_little)
    assert cli.main(["demo"]) == 1
    out = capsys.readouterr().out
    assert next(l for l in out.splitlines() if l.startswith("chunk_kda")).rstrip().endswith("FAIL")
    assert "MISMATCH" in out
