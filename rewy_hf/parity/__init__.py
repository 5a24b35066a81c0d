"""The comparison behind `rewy-hf parity`: a patched model against its unpatched self
(``comparison``), and how the result is shown (``output``)."""
