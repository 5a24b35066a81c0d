"""Model classes that rewy-hf provides where neither transformers nor FLA has one.

* ``rewy_hf.models.gdn2``: a Gated DeltaNet-2 causal LM built from FLA's
  ``fla.layers.GatedDeltaNet2`` mixer (importing it registers model type
  ``"gdn2"`` with transformers' Auto classes).
"""
