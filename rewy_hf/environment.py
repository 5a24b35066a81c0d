"""The environment report behind `rewy-hf env` and bug reports.

Everything here is feature detection: a missing or broken package shows up as
``None`` or an error string in the report, never as an exception, because this
is the command users run precisely when their install is broken.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import sys
import warnings
from typing import Any

from . import settings

# FLA kernel internals are not a stable API; we build against exactly this.
PINNED_FLA_VERSION = "0.6.0"

# Distribution names (as pip knows them), reported in this order.
PACKAGES = (
    "torch",
    "triton",
    "flash-linear-attention",
    "fla-core",
    "transformers",
    "accelerate",
    "peft",
    "safetensors",
    # Optional; each changes what runs: `kernels` makes transformers' modeling functions kernel
    # modules (5.25 on), flash-qla / tilelang take over some of FLA's GDN and KDA kernels, and
    # causal-conv1d replaces transformers' torch short convolution.
    "kernels",
    "flash-qla",
    "tilelang",
    "causal-conv1d",
)


def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def rewy_hf_version() -> str:
    version = package_version("rewy-hf")
    if version is not None:
        return version
    # Running from a source tree that was never pip-installed.
    try:
        from rewy_hf import __version__  # type: ignore[attr-defined]
    except Exception:
        return "0+unknown"
    return str(__version__)


def _cuda_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "available": False,
        "torch_cuda_version": None,
        "device_count": 0,
        "devices": [],
    }
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken CUDA build raising OSError
        info["error"] = f"torch not importable: {exc}"
        return info
    info["torch_cuda_version"] = getattr(torch.version, "cuda", None)
    try:
        if not torch.cuda.is_available():
            return info
        info["available"] = True
        info["device_count"] = torch.cuda.device_count()
        for i in range(info["device_count"]):
            major, minor = torch.cuda.get_device_capability(i)
            info["devices"].append(
                {
                    "index": i,
                    "name": torch.cuda.get_device_name(i),
                    "capability": f"{major}.{minor}",
                }
            )
    except Exception as exc:  # driver problems surface here, not at import
        info["error"] = f"CUDA query failed: {exc}"
    return info


def fla_pin(fla: str | None, fla_core: str | None) -> dict[str, Any]:
    pin = PINNED_FLA_VERSION
    ok = fla == pin and fla_core == pin
    if ok:
        message = f"flash-linear-attention and fla-core {pin} match the pin"
    else:
        found = ", ".join(
            f"{dist} {'not installed' if v is None else v}"
            for dist, v in (("flash-linear-attention", fla), ("fla-core", fla_core))
        )
        message = (
            f"FLA does NOT match the pinned {pin} (found {found}); rewy-hf "
            f"imports FLA internals and is only tested against {pin}: "
            f"pip install flash-linear-attention=={pin} fla-core=={pin}"
        )
    return {
        "required": pin,
        "installed": {"flash-linear-attention": fla, "fla-core": fla_core},
        "ok": ok,
        "message": message,
    }


def _fla_import() -> dict[str, Any]:
    # FLA warns "Triton is not supported on current platform" on CPU-only
    # machines at import; that is expected here and would only clutter output.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            importlib.import_module("fla")
        except Exception as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return {"ok": True, "error": None}


def _backends(fla_ok: bool) -> dict[str, dict[str, Any]]:
    """{usable, reason} per backend: the torch backend always; the triton
    backend needs a CUDA device and an importable FLA (its forward kernels)."""
    import torch

    if not torch.cuda.is_available():
        triton = {"usable": False, "reason": "needs a CUDA device (none found)"}
    elif not fla_ok:
        triton = {"usable": False, "reason": "FLA could not be imported (its forward kernels are needed)"}
    else:
        triton = {"usable": True, "reason": "all four ops (DeltaNet, GDN, KDA, GDN2), packed sequences included: "
                                            "FLA forward + ReWY backward kernels; float64 inputs and key head dims "
                                            "over 256 go to the torch backend under auto"}
    from .kernels.flash_qla_route import environment_reason

    try:
        index = torch.cuda.current_device() if torch.cuda.is_available() else -1
        why_not = environment_reason("cuda" if torch.cuda.is_available() else "cpu", index)
    except Exception as exc:        # a driver problem: this report exists to show it
        why_not = f"its GPU check failed: {type(exc).__name__}: {exc}"
    flash_qla = ({"usable": False, "reason": why_not} if why_not else
                 {"usable": True, "reason": "GDN calls with K = V = 128 in bf16/fp16 go to FlashQLA's kernels under "
                                            "auto where it is faster (kernels/flash_qla_route.py)"})
    return {"torch": {"usable": True, "reason": "pure PyTorch, runs on any device"}, "triton": triton,
            "flash_qla": flash_qla}


def _eager_parts(cuda: bool, fla: bool | None) -> dict[str, str]:
    """What a patched transformers layer runs around its core in eager mode here (patching/layer_parts.py,
    kernels/short_conv.py); ``fla``: FLA imported (None: not tried). The kernels serve eager CUDA calls only."""
    if not cuda or fla is False:
        why = "no CUDA device" if not cuda else "FLA could not be imported"
        return {"short_conv": f"the layer's own convolution ({why}); on packed rows rewy's, restarting at every "
                              "document",
                "gated_norm": f"the layer's own torch norm ({why})",
                "forget_gate": f"Kimi-Linear's own torch gate ({why})"}
    if fla is None:
        conv = "FLA's Gluon or Triton kernels (which: not checked, FLA was not imported for this report)"
    else:
        from .kernels.short_conv import fla_gluon_conv

        try:
            gluon = fla_gluon_conv() is not None
        except Exception as exc:    # an FLA other than the pinned one: this report exists to show it
            gluon = f"{type(exc).__name__}: {exc}"
        conv = ("FLA's Gluon kernels wherever FLA's own check accepts the call (one process, width 2-4, one packed "
                "row), else FLA's Triton kernels" if gluon is True else
                "FLA's Triton kernels (FLA's Gluon kernels cannot run with this GPU or Triton)" if gluon is False else
                f"none: checking FLA's Gluon kernels failed ({gluon}), and a patched layer's eager CUDA "
                "convolution would fail the same way; install the pinned FLA")
    return {"short_conv": conv + ", the activation fused (a `causal-conv1d` package the layer found keeps its "
                                 "unpacked calls)",
            "gated_norm": "FLA's fused rms_norm_gated",
            "forget_gate": "rewy's one-node gate activation (Kimi-Linear)"}


def collect_env(import_fla: bool = True) -> dict[str, Any]:
    """Return a JSON-serialisable description of the environment.

    ``import_fla=False`` skips actually importing FLA (slow: ~10 s on CPU) and
    reports only what the package metadata says.
    """
    versions = {dist: package_version(dist) for dist in PACKAGES}
    fla_import = _fla_import() if import_fla else None
    fla_ok = fla_import["ok"] if fla_import else versions["flash-linear-attention"] is not None
    cuda = _cuda_info()
    return {
        "rewy_hf": rewy_hf_version(),
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
            "platform": platform.platform(),
        },
        "packages": versions,
        "fla_pin": fla_pin(versions["flash-linear-attention"], versions["fla-core"]),
        "fla_import": fla_import,
        "cuda": cuda,
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "settings": {s.name: {"value": settings.current()[s.name], "default": s.default, "meaning": s.meaning}
                     for s in settings.SETTINGS},
        "backends": _backends(fla_ok),
        "eager_parts": _eager_parts(cuda["available"], fla_import["ok"] if fla_import else None),
    }


def format_env(d: dict[str, Any]) -> str:
    """Human-readable rendering of :func:`collect_env`'s result."""

    def show(value: Any) -> str:
        return "not installed" if value is None else str(value)

    lines = [f"rewy-hf {d['rewy_hf']}", ""]
    py = d["python"]
    w = 24  # fits "flash-linear-attention" plus a gap
    lines.append(f"{'python':<{w}}{py['version']} ({py['implementation']}, {py['platform']})")
    for dist, version in d["packages"].items():
        lines.append(f"{dist:<{w}}{show(version)}")

    pin = d["fla_pin"]
    lines += ["", ("OK    " if pin["ok"] else "WARN  ") + pin["message"]]
    fla_import = d.get("fla_import")
    if fla_import is not None and not fla_import["ok"]:
        lines.append(f"WARN  import fla failed: {fla_import['error']}")

    cuda = d["cuda"]
    lines += ["", f"{'CUDA available':<{w}}{cuda['available']}"]
    if cuda.get("torch_cuda_version"):
        lines.append(f"{'torch CUDA':<{w}}{cuda['torch_cuda_version']}")
    for dev in cuda["devices"]:
        label = f"  cuda:{dev['index']}"
        lines.append(f"{label:<{w}}{dev['name']} (sm {dev['capability']})")
    if cuda.get("error"):
        lines.append(f"WARN  {cuda['error']}")
    interpret = d["triton_interpret"]
    lines.append(f"{'TRITON_INTERPRET':<{w}}{'unset' if interpret is None else interpret}")

    lines += ["", "rewy-hf settings (environment variables):"]
    for name, setting in d["settings"].items():
        value = "unset" if setting["value"] is None else repr(setting["value"])
        lines.append(f"  {name:<{w}}{value} (default {setting['default']!r}): {setting['meaning']}")

    lines += ["", "backends:"]
    for name, backend in d["backends"].items():
        state = "usable" if backend["usable"] else "not usable"
        lines.append(f"  {name:<10}{state}: {backend['reason']}")
    lines += ["", "a patched transformers layer around its core, eagerly:"]
    lines += [f"  {name:<12}{what}" for name, what in d["eager_parts"].items()]
    return "\n".join(lines)
