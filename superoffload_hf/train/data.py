"""Training data for recipes: read documents, tokenize, pack into fixed-length blocks.

Sources (a recipe's `data:` section picks one): the corpus shipped in superoffload_hf/train/corpus,
local .txt/.md/.json/.jsonl files (read with the standard library), or a hub dataset
(`datasets` is imported only for that, since not every machine has it). Documents are
tokenized without special tokens, joined with EOS, and cut into blocks of `seq_len` tokens;
the last partial block is dropped. Labels equal input_ids (the model shifts them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch

from superoffload_hf.train.corpus import corpus_texts
from superoffload_hf.train.recipe import DataSpec, RecipeError

TOKENIZE_BATCH_DOCS = 256


class PackedDataset(torch.utils.data.Dataset):
    """Blocks of token ids, one training sequence each: {"input_ids", "labels"} (int64)."""

    def __init__(self, blocks_i64: torch.Tensor) -> None:
        self.blocks_i64 = blocks_i64

    def __len__(self) -> int:
        return self.blocks_i64.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        block = self.blocks_i64[index]
        return {"input_ids": block, "labels": block}

    @property
    def num_tokens(self) -> int:
        return self.blocks_i64.numel()


def build_dataset(spec: DataSpec, tokenizer: Any) -> PackedDataset:
    """Read the documents `spec` names, tokenize with `tokenizer`, pack into seq_len blocks."""
    documents = _take((d for d in read_documents(spec) if d.strip()), spec.max_examples)
    ids = tokenize_documents(documents, tokenizer)
    blocks_i64 = pack(ids, spec.seq_len)
    if blocks_i64.shape[0] == 0:
        raise RecipeError(
            f"`data` yields {ids.numel()} tokens, fewer than one block of `data.seq_len` = "
            f"{spec.seq_len}; lower seq_len or add text."
        )
    return PackedDataset(blocks_i64)


def pack(ids_i64: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cut a 1-D token stream into [n, seq_len] blocks (n = len // seq_len), dropping the tail."""
    num_blocks = ids_i64.numel() // seq_len
    return ids_i64[: num_blocks * seq_len].reshape(num_blocks, seq_len).clone()


def tokenize_documents(documents: Iterable[str], tokenizer: Any) -> torch.Tensor:
    """One int64 token stream: each document's ids followed by EOS (when the tokenizer has one).
    Kept as tensors per batch of documents: a Python list of ints costs ~5x the memory."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    chunks_i64 = [torch.zeros(0, dtype=torch.int64)]
    for batch in _batches(documents, TOKENIZE_BATCH_DOCS):
        ids = [token for doc_ids in tokenizer(batch, add_special_tokens=False)["input_ids"] for token in doc_ids + eos]
        chunks_i64.append(torch.tensor(ids, dtype=torch.int64))
    return torch.cat(chunks_i64)


def read_documents(spec: DataSpec) -> Iterator[str]:
    """The documents of the source `spec` names, in a deterministic order."""
    if spec.shipped_corpus:
        return _paragraph_documents(corpus_texts())
    if spec.files:
        return _file_documents(spec.files, spec.text_column)
    return _hub_documents(spec)


def _paragraph_documents(texts: Iterable[str]) -> Iterator[str]:
    # A text file is one document per blank-line-separated paragraph: keeps tokenizer calls small.
    for text in texts:
        yield from (p.strip() for p in text.split("\n\n") if p.strip())


def _file_documents(files: Iterable[str], text_column: str) -> Iterator[str]:
    for name in files:
        path = Path(name).expanduser()
        if path.suffix in (".txt", ".md"):
            yield from _paragraph_documents([path.read_text(encoding="utf-8")])
        else:
            yield from _json_documents(path, text_column)


def _json_documents(path: Path, text_column: str) -> Iterator[str]:
    """.jsonl: one record per line; .json: a list of records. Each record holds `text_column`."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        records = (_json_record(path, n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip())
    else:
        records = _json_list(path, text)
    for number, record in enumerate(records, 1):
        yield _record_text(record, text_column, f"{path} record {number}")


def _json_record(path: Path, line_number: int, line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise RecipeError(f"`data.files`: {path} line {line_number} is not valid JSON: {exc}") from exc


def _json_list(path: Path, text: str) -> list:
    try:
        records = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RecipeError(f"`data.files`: {path} is not valid JSON: {exc}") from exc
    if not isinstance(records, list):
        raise RecipeError(
            f"`data.files`: {path} holds a {type(records).__name__}; expected a list of records "
            "(or use .jsonl with one record per line)."
        )
    return records


def _record_text(record: Any, text_column: str, where: str) -> str:
    if not isinstance(record, dict) or not isinstance(record.get(text_column), str):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise RecipeError(
            f"{where} has no string field `{text_column}` (it has {keys}); set "
            "`data.text_column` to the field holding the text."
        )
    return record[text_column]


def _hub_documents(spec: DataSpec) -> Iterator[str]:
    try:
        import datasets
    except ImportError as exc:
        raise RecipeError(
            f"`data.name` is {spec.name!r}, a hub dataset, but the `datasets` package is not "
            "installed; `pip install datasets`, or use `data.files` / `data.shipped_corpus`."
        ) from exc
    rows = datasets.load_dataset(spec.name, spec.config, split=spec.split, streaming=spec.streaming)
    for number, row in enumerate(rows, 1):
        yield _record_text(row, spec.text_column, f"dataset {spec.name!r} row {number}")


def _take(items: Iterable[str], limit: Optional[int]) -> Iterator[str]:
    for count, item in enumerate(items):
        if limit is not None and count >= limit:
            return
        yield item


def _batches(items: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
