"""The result of patch_model: which layers now run rewy, which do not and why."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class PatchedLayer:
    name: str
    layer_class: str
    op: str
    backend: str
    policy: str
    already: bool = False      # patched by an earlier call


@dataclass
class SkippedLayer:
    name: str
    layer_class: str
    reason: str


@dataclass
class PatchReport:
    backend: str
    policy: str
    fallback: str
    patched: list[PatchedLayer] = field(default_factory=list)
    skipped: list[SkippedLayer] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)      # what the user should know (also warned)

    def to_dict(self) -> dict:
        return {"backend": self.backend, "policy": self.policy, "fallback": self.fallback,
                "patched": [asdict(p) for p in self.patched], "skipped": [asdict(s) for s in self.skipped],
                "notes": list(self.notes)}

    def __len__(self) -> int:
        return len(self.patched)

    def __str__(self) -> str:
        lines = [f"rewy-hf: {len(self.patched)} delta-rule layer(s) patched, {len(self.skipped)} not patched "
                 f"(backend={self.backend}, policy={self.policy}, fallback={self.fallback})"]
        if self.patched:
            rows = [(p.name or "<root>", p.layer_class, p.op, p.backend, p.policy + (" (already)" if p.already else ""))
                    for p in self.patched]
            lines += _table(("module", "layer class", "op", "backend", "policy"), rows)
        if self.skipped:
            lines.append("not patched:")
            lines += _table(("module", "layer class", "reason"),
                            [(s.name or "<root>", s.layer_class, s.reason) for s in self.skipped])
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  " + "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]
