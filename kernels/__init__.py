"""The math (installed as rewy_hf.kernels): constants.py, reference.py (float64 naive recurrences),
torch_backend/ (the readable, float64-verified ReWY backward) and triton_backend/ (CUDA kernels).

vocabulary.py names the ops, backends and policies; errors.py, value_checks.py and settings.py hold
what the kernels raise and read. Nothing here imports rewy_hf outside rewy_hf.kernels: the package
above depends on the math, never the other way round."""

# This folder sits at the repository root but installs as ``rewy_hf.kernels``.
# Run from the root with ``python -m ...``, Python would find it as a
# top-level ``kernels`` and hide Hugging Face's hub-kernels package of that
# name, which transformers imports. Refuse loudly instead of misbehaving.
if __name__ == "kernels":
    raise ImportError(
        "the repository's kernels/ folder was imported as top-level `kernels`, which would shadow Hugging Face's "
        "`kernels` package; install rewy-hf (pip install -e .) and run tools with their console scripts "
        "(`pytest`, `rewy-hf`) or `python -P -m ...` so the current folder is not put on sys.path."
    )
