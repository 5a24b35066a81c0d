"""The comparison behind `rewy-hf parity`: a patched model against its unpatched self
(``comparison``), what it is fed (``inputs``: LoRA wrap, token batches), and how the
result is shown (``output``)."""
