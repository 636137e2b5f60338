"""Tokenizers for recipes: a byte-level BPE trained offline on the shipped corpus, or a
pretrained one from the hub / a local directory.

The shipped tokenizer is trained in well under a second and is deterministic (same corpus and
vocab size, same vocabulary and merges), so it is rebuilt on every run instead of cached; the
Trainer saves it next to each checkpoint.
"""

from __future__ import annotations

from typing import Iterable

from superoffload_hf.train.corpus import corpus_texts

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int):
    """A PreTrainedTokenizerFast holding a byte-level BPE trained on `texts` (any byte
    sequence encodes; no unknown token). EOS doubles as BOS; PAD is its own token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_paragraphs(texts), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        model_max_length=int(1e9),
    )


def _paragraphs(texts: Iterable[str]) -> Iterable[str]:
    for text in texts:
        yield from (p for p in text.split("\n\n") if p.strip())


def shipped_tokenizer(vocab_size: int = 2048):
    """The byte-level BPE of the shipped corpus (what `tokenizer: {shipped: true}` builds)."""
    return train_byte_level_bpe(corpus_texts(), vocab_size)


def pretrained_tokenizer(name_or_path: str):
    """AutoTokenizer.from_pretrained, with a PAD token (EOS) when the tokenizer has none."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
