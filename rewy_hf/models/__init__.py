"""Models for rewy-hf's commands and recipes.

* ``rewy_hf.models.gdn2``: a Gated DeltaNet-2 causal LM built from FLA's
  ``fla.layers.GatedDeltaNet2`` mixer, where neither transformers nor FLA has
  one (importing it registers model type ``"gdn2"`` with transformers' Auto
  classes).
* ``presets``: random models built from config with a fixed seed (tiny ones
  for CPU checks, ~1B ones for GPU benchmarks).
* ``loading``: a causal LM from a preset, a local directory or a hub id.
"""
