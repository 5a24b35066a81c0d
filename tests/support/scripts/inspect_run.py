"""Records what a script sees when run by `rewy-hf run` into a JSON file:
__name__, sys.argv, sys.path[0], whether post_init is hooked, and (with
--model qwen35|llama) how many layers of a freshly built model are patched.
Never runs a forward, so it is safe unpatched on CPU.

    python inspect_run.py OUT.json [--model qwen35|llama|none] [extra args ...]
"""

import json
import sys

import transformers

import rewy_hf


def main() -> None:
    out, rest = sys.argv[1], sys.argv[2:]
    model_kind = "none"
    if "--model" in rest:
        model_kind = rest[rest.index("--model") + 1]
    patched = None
    if model_kind != "none":
        import _tiny_models

        model = getattr(_tiny_models, {"qwen35": "tiny_qwen35", "llama": "tiny_llama"}[model_kind])()
        patched = sum(rewy_hf.is_patched(m) for m in model.modules())
    with open(out, "w") as f:
        json.dump({
            "name": __name__,
            "argv": sys.argv,
            "path0": sys.path[0],
            "post_init_hooked": bool(getattr(transformers.PreTrainedModel.post_init, "_rewy_run_hook", False)),
            "patched_layers": patched,
        }, f)


if __name__ == "__main__":
    main()
