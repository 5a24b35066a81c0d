"""The self-check behind `rewy-hf verify` (``checklist``) and the per-op checks it shares
with `rewy-hf demo` (``op_checks``)."""
