"""The math: float64 reference recurrences, torch backend and triton backend (installed as rewy_hf.kernels)."""
