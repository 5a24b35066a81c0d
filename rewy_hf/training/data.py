"""Corpus reading, a byte-level fallback tokenizer, and sequence packing.

Packing concatenates every document (each followed by the tokenizer's EOS) and
cuts the stream into windows of ``seq_len + 1`` tokens: inputs are
``window[:-1]``, targets ``window[1:]``. The order in which windows are drawn is
a pure function of (seed, sample position), so a resumed run draws exactly the
windows an uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from pathlib import Path

import torch

from .progress import datasets_bars_off


class DataError(ValueError):
    """Bad --data / --seq-len input; the message says how to fix it."""


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then ``<bos>`` = 256, ``<eos>`` = 257, ``<pad>`` = 258."""

    FILE = "byte_tokenizer.json"

    def __init__(self) -> None:
        self.bos_token_id, self.eos_token_id, self.pad_token_id = 256, 257, 258
        self.vocab_size = 259

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        Path(directory, self.FILE).write_text(json.dumps(
            {"type": "rewy-byte-tokenizer", "vocab_size": self.vocab_size, "bos_token_id": self.bos_token_id,
             "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id}, indent=1) + "\n")

    @classmethod
    def saved_in(cls, directory: str | os.PathLike) -> bool:
        return Path(directory, cls.FILE).is_file()


def encode(tokenizer, text: str) -> list[int]:
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(text)
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def _looks_like_path(spec: str) -> bool:
    return os.sep in spec or spec.startswith(".") or spec.endswith((".txt", ".jsonl", ".json", ".md"))


def _utf8_text(path: Path, spec: str) -> str:
    """The file's text; a file that is not UTF-8 text (binary data, another encoding) is refused rather
    than decoded with replacement characters and trained on."""
    raw = path.read_bytes()
    what = ("binary data, not text" if b"\0" in raw[:8192]
            else "not UTF-8 text")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"data file {spec} is {what} (byte {exc.start} does not decode as UTF-8); pass a UTF-8 "
                        ".txt or .jsonl file (convert another encoding first, e.g. `iconv -t UTF-8`)") from None
    if "\0" in text:
        raise DataError(f"data file {spec} holds NUL bytes (binary data, not text); pass a UTF-8 .txt or .jsonl "
                        "file")
    return text


def read_documents(spec: str, split: str = "train", progress: bool = True) -> list[str]:
    """Documents from a text file (one document), a JSONL file (one ``{"text": ...}`` per line),
    or, if the ``datasets`` package is installed, a ``datasets`` dataset name with a "text" column
    (loaded without progress bars where ``progress`` is False)."""
    path = Path(spec)
    if path.is_file():
        text = _utf8_text(path, spec)
        if path.suffix in (".jsonl", ".json"):
            docs = []
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{spec}, line {n}: not valid JSON ({exc.msg}); each line of a JSONL file "
                                    'must be an object like {"text": "..."}') from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise DataError(f'{spec}, line {n}: expected an object with a string "text" field')
                docs.append(record["text"])
        else:
            docs = [text]
        if not any(d.strip() for d in docs):
            raise DataError(f"data file {spec} is empty (no text); pass --data with a non-empty .txt file or a "
                            '.jsonl file of {"text": ...} records')
        return docs
    if path.exists():
        raise DataError(f"--data {spec} is a directory; pass a .txt or .jsonl file")
    if _looks_like_path(spec):
        raise DataError(f"data file not found: {spec}; pass --data with an existing .txt or .jsonl file "
                        "(or leave --data out to use the bundled corpus)")
    if importlib.util.find_spec("datasets") is None:
        raise DataError(f"--data {spec!r} is not a file, and the `datasets` package (needed for dataset names) is "
                        "not installed; pass a .txt/.jsonl file, or `pip install datasets`")
    import datasets

    with contextlib.nullcontext() if progress else datasets_bars_off():
        ds = datasets.load_dataset(spec, split=split)
    if "text" not in ds.column_names:
        raise DataError(f"dataset {spec!r} has no 'text' column (columns: {ds.column_names})")
    return [t for t in ds["text"] if t]


def pack(docs: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """All documents, each + EOS, concatenated and cut into ``[num_windows, seq_len + 1]`` (the tail is dropped)."""
    if seq_len < 1:
        raise DataError(f"--seq-len must be positive, got {seq_len}")
    eos = getattr(tokenizer, "eos_token_id", None)
    ids: list[int] = []
    for doc in docs:
        ids.extend(encode(tokenizer, doc))
        if eos is not None:
            ids.append(eos)
    window = seq_len + 1
    n = len(ids) // window
    if n == 0:
        raise DataError(f"the data has only {len(ids)} tokens, fewer than one training window of --seq-len + 1 = "
                        f"{window} tokens; use --seq-len {max(1, len(ids) - 1)} or less, or more data")
    return torch.tensor(ids[: n * window], dtype=torch.long).view(n, window)


class WindowSampler:
    """Which windows each (micro-step, rank) gets: epoch ``e`` is the permutation drawn from
    ``seed + e``; global sample position ``p`` is ``perm_e[p mod N]`` with ``e = p // N``."""

    def __init__(self, num_windows: int, batch_size: int, world_size: int = 1, rank: int = 0, seed: int = 0):
        self.n, self.batch_size, self.world_size, self.rank, self.seed = num_windows, batch_size, world_size, rank, seed
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            self._perms = {epoch: torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch))}
        return self._perms[epoch]

    def indices(self, micro_step: int) -> list[int]:
        start = (micro_step * self.world_size + self.rank) * self.batch_size
        out = []
        for pos in range(start, start + self.batch_size):
            epoch, i = divmod(pos, self.n)
            out.append(int(self._perm(epoch)[i]))
        return out

    def epoch(self, micro_step: int) -> float:
        return (micro_step * self.world_size * self.batch_size) / self.n
