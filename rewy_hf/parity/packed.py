"""`rewy-hf parity --packed`: one padding-free packed row against its documents run one by one.

A padding-free collator (transformers' ``DataCollatorWithFlattening``, TRL's
padding-free mode) puts several documents in one row (B = 1) whose
``position_ids`` restart at every document, optionally with the
flash-attention bounds ``cu_seq_lens_q`` / ``cu_seq_lens_k`` /
``max_length_q`` / ``max_length_k``. A model that keeps the documents apart
gives the packed row the logits of its documents run alone, and, for a loss
that is a sum over tokens, their summed gradients.

Each model is held against itself: the patched model's packed row against the
patched model running the documents one by one, the unpatched model's against
the unpatched model's. So the check measures packing alone, in any dtype
(rewy's core against the model's own is what parity without ``--packed``
measures). The row is fed as the collator builds it, both with
``position_ids`` only and with the flash-attention bounds too. The verdict is
the patched model's; the unpatched model's figures show what the model does
without rewy (transformers' delta-rule layers run each document's recurrence
and convolution on from the one before).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn as nn

from ..patching.dispatch import dispatch_report, report_difference, total_calls
from ..patching.patch import patch_model, unpatch_model
from ..patching.reference_cores import use_reference_cores
from .comparison import (DEFAULT_TOLERANCES, TINY_GRADIENT, ParamResult, Tolerance, compare,
                         original_core_errors)

CHUNK = 64      # the delta-rule cores' chunk: bounds on and off its edges take different paths
MIN_TOKENS = CHUNK + 3          # a first document of one chunk, then three more of at least one token

# In float64 the parameters a model itself computes in float32 set the floor: transformers' RMSNorms
# and GDN gate compute in float32 whatever the model's dtype, so the gradients of their weights are
# float32 sums over tokens, which the packed row and the documents alone add in other orders:
# 1e-7 to 3e-7 relative on tiny-qwen3.5 (every other gradient agrees to 1e-14 or better). A leak across
# documents moves the logits and gradients by 1e-2 or more. Other dtypes keep parity's tolerances.
PACKED_TOLERANCES = {**DEFAULT_TOLERANCES,
                     torch.float64: replace(DEFAULT_TOLERANCES[torch.float64], grad_rel=1e-6)}

# How the row is handed to the model: as DataCollatorWithFlattening builds it, without and with
# return_flash_attn_kwargs=True.
ROW_FORMS = {"position_ids": False, "position_ids + cu_seq_lens": True}


def document_lengths(seq_len: int) -> list[int]:
    """Lengths of the documents packed in a row of ``seq_len`` tokens: one chunk (a bound on a chunk
    edge), then the rest split around a one-token document, so the other bounds fall inside a chunk."""
    if seq_len < MIN_TOKENS:
        raise ValueError(f"--packed needs --seq-len {MIN_TOKENS} or more (got {seq_len}): the row packs a "
                         f"{CHUNK}-token document, ending on a chunk edge, and three more after it")
    rest = seq_len - CHUNK
    second = rest * 37 // CHUNK     # about 58 % of the rest (at seq_len 128: 37)
    if second % CHUNK == 0:          # the bounds after it, CHUNK + second and + 1, stay off chunk edges
        second -= 2
    elif second % CHUNK == CHUNK - 1:
        second -= 1
    return [CHUNK, second, 1, rest - second - 1]


def packed_row(documents: list[torch.Tensor], flash_kwargs: bool, device) -> dict:
    """The row ``DataCollatorWithFlattening`` makes of ``documents`` (its labels left out)."""
    from transformers import DataCollatorWithFlattening

    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(
        [{"input_ids": d.tolist()} for d in documents])
    batch.pop("labels")
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@dataclass
class PackedRow:
    """One model on one form of the row: its logits and gradients against its documents alone."""
    model: str                  # "patched" or "unpatched"
    given: str                  # a key of ROW_FORMS
    logits: ParamResult
    gradients: list[ParamResult]

    @property
    def ok(self) -> bool:
        return self.logits.ok and all(g.ok for g in self.gradients)

    @property
    def worst_gradient(self) -> ParamResult:
        return max(self.gradients, key=lambda g: g.rel_err)

    def to_dict(self) -> dict:
        worst = self.worst_gradient
        return {"model": self.model, "given": self.given, "ok": self.ok,
                "logits_rel_err": self.logits.rel_err, "logits_cosine": self.logits.cosine,
                "max_grad_rel_err": worst.rel_err, "worst_param": worst.name,
                "failing": [asdict(g) for g in [self.logits, *self.gradients] if not g.ok]}


@dataclass
class PackedResult:
    tolerance: Tolerance
    lengths: list[int]
    rows: list[PackedRow] = field(default_factory=list)
    patch_report: dict | None = None
    dispatch: dict | None = None        # what the patched model's calls ran

    @property
    def bounds(self) -> list[int]:
        """Where a document ends inside the row."""
        ends = torch.tensor(self.lengths).cumsum(0).tolist()
        return ends[:-1]

    @property
    def optimized_backward_calls(self) -> int:
        return total_calls(self.dispatch or {}, "optimized_backward_calls")

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows if r.model == "patched") and self.optimized_backward_calls > 0

    @property
    def unpatched_leaks(self) -> bool:
        return any(not r.ok for r in self.rows if r.model == "unpatched")

    def failing(self) -> list[tuple[ParamResult, str]]:
        """The patched model's tensors out of tolerance, each at its worst row form, worst first."""
        worst: dict[str, tuple[ParamResult, str]] = {}
        for r in self.rows:
            if r.model != "patched":
                continue
            for g in [r.logits, *r.gradients]:
                if not g.ok and (g.name not in worst or g.rel_err > worst[g.name][0].rel_err):
                    worst[g.name] = (g, r.given)
        return sorted(worst.values(), key=lambda w: -w[0].rel_err)

    def to_dict(self) -> dict:
        # the loss tolerance judges nothing here: the logits are held to the gradients' rule
        tolerance = {"grad_rel": self.tolerance.grad_rel, "min_cosine": self.tolerance.min_cosine}
        return {"ok": self.ok, "tolerance": tolerance, "lengths": self.lengths,
                "bounds": self.bounds, "chunk": CHUNK, "rows": [r.to_dict() for r in self.rows],
                "unpatched_leaks": self.unpatched_leaks,
                "optimized_backward_calls": self.optimized_backward_calls,
                "patch_report": self.patch_report, "dispatch": self.dispatch}


class Readout:
    """Fixed random weights per (token, logit) of the row, drawn from ``seed`` once the logits' width
    is seen: the loss sum(logits * weights) is a sum over tokens, so the packed row's gradient must be
    the sum of its documents' gradients."""

    def __init__(self, tokens: int, dtype: torch.dtype, seed: int, device):
        self.tokens, self.dtype, self.seed, self.device = tokens, dtype, seed, device
        self.weights: torch.Tensor | None = None

    def loss(self, logits: torch.Tensor, start: int) -> torch.Tensor:
        if self.weights is None:
            gen = torch.Generator().manual_seed(self.seed)
            self.weights = torch.randn((self.tokens, logits.shape[-1]), generator=gen, dtype=torch.float64).to(
                device=self.device, dtype=self.dtype)
        return (logits.to(self.dtype) * self.weights[start:start + logits.shape[0]]).sum()


def trainable_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def backward_through(model: nn.Module, inputs: dict, readout: Readout, start: int = 0) -> torch.Tensor:
    logits = model(**inputs, use_cache=False).logits[0]
    readout.loss(logits, start).backward()
    return logits.detach()


def documents_alone(model: nn.Module, documents: list[torch.Tensor], readout: Readout):
    """Logits of the documents run one by one, concatenated, and their gradients summed (accumulated)."""
    model.zero_grad(set_to_none=True)
    logits, start = [], 0
    for doc in documents:
        logits.append(backward_through(model, {"input_ids": doc[None]}, readout, start))
        start += len(doc)
    return torch.cat(logits), trainable_grads(model)


def _compare_row(side: str, given: str, logits, grads, ref_logits, ref_grads, tol: Tolerance) -> PackedRow:
    floor = TINY_GRADIENT * max((g.double().norm().item() for g in ref_grads.values()), default=0.0)
    results = []
    for name in sorted(ref_grads.keys() | grads.keys()):
        # a parameter no token of one run reached (an expert) has no gradient there: zero, as parity takes it
        g, ref = grads.get(name), ref_grads.get(name)
        g = torch.zeros_like(ref) if g is None else g
        ref = torch.zeros_like(g) if ref is None else ref
        results.append(compare(name, g, ref, tol, floor))
    return PackedRow(side, given, compare("logits", logits, ref_logits, tol), results)


def _check_side(side: str, model: nn.Module, documents: list[torch.Tensor], readout: Readout,
                tol: Tolerance) -> list[PackedRow]:
    ref_logits, ref_grads = documents_alone(model, documents, readout)
    rows = []
    for given, flash_kwargs in ROW_FORMS.items():
        model.zero_grad(set_to_none=True)
        logits = backward_through(model, packed_row(documents, flash_kwargs, readout.device), readout)
        rows.append(_compare_row(side, given, logits, trainable_grads(model), ref_logits, ref_grads, tol))
    model.zero_grad(set_to_none=True)
    return rows


def run_packed_parity(model: nn.Module, tokens: torch.Tensor, *, tolerance: Tolerance, seed: int,
                      backend: str = "auto", policy: str = "recompute",
                      reference_cores: bool | None = None) -> PackedResult:
    """Pack ``tokens`` (one row's worth, 1-D) into documents (``document_lengths``) and hold each side's
    packed row against its documents run one by one.

    ``model`` itself becomes the patched side; an unpatched deep copy is the other. The unpatched side
    runs the reference cores where ``reference_cores`` says so (default: off CUDA, as ``run_parity``);
    where its original cores run and fail, ``OriginalCoreError`` is raised.
    """
    reference_model = copy.deepcopy(model)
    unpatch_model(reference_model)          # in case the caller had patched it already
    device = next(model.parameters()).device
    use_reference = device.type != "cuda" if reference_cores is None else reference_cores
    lengths = document_lengths(tokens.numel())
    documents = list(tokens.to(device).split(lengths))
    # the loss at float32 or wider, as transformers computes its own
    readout = Readout(tokens.numel(), torch.promote_types(next(model.parameters()).dtype, torch.float32), seed,
                      device)
    result = PackedResult(tolerance=tolerance, lengths=lengths)
    result.patch_report = patch_model(model, backend=backend, policy=policy).to_dict()

    scope = use_reference_cores(reference_model) if use_reference else contextlib.nullcontext()
    with original_core_errors(use_reference), scope:
        unpatched = _check_side("unpatched", reference_model, documents, readout, tolerance)
    before = dispatch_report()
    result.rows = _check_side("patched", model, documents, readout, tolerance) + unpatched
    result.dispatch = report_difference(before, dispatch_report())
    return result
