"""Recipe data: the shipped corpus and tokenizer, reading local files and hub datasets, packing."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from superoffload_hf.train.corpus import corpus_files, corpus_texts
from superoffload_hf.train.data import PackedDataset, build_dataset, pack, read_documents, tokenize_documents
from superoffload_hf.train.recipe import DataSpec, RecipeError
from superoffload_hf.train.tokenizer import EOS_TOKEN, PAD_TOKEN, shipped_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return shipped_tokenizer(vocab_size=512)


# ---- corpus and tokenizer ---------------------------------------------------------------------


def test_shipped_corpus_is_package_data_of_a_few_dozen_kilobytes():
    sizes = [len(text.encode("utf-8")) for text in corpus_texts()]
    assert len(corpus_files()) == len(sizes) >= 10
    assert 50_000 < sum(sizes) < 300_000
    assert all(name.endswith(".txt") for name in corpus_files())


def test_shipped_tokenizer_is_deterministic(tokenizer):
    again = shipped_tokenizer(vocab_size=512)
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()


def test_shipped_tokenizer_has_the_asked_vocab_and_special_tokens(tokenizer):
    assert len(tokenizer) == 512
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.bos_token == EOS_TOKEN
    assert tokenizer.pad_token == PAD_TOKEN and tokenizer.pad_token_id != tokenizer.eos_token_id


def test_shipped_tokenizer_round_trips_any_text_byte_for_byte(tokenizer):
    text = "Naïve café — 東京, tabs\tand\nnewlines; emoji 🐝 and 3.14e-5."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


# ---- packing ----------------------------------------------------------------------------------


def test_pack_cuts_the_stream_into_full_blocks_and_drops_the_tail():
    blocks = pack(torch.arange(10), 4)
    assert torch.equal(blocks, torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]))


def test_pack_of_a_stream_shorter_than_a_block_is_empty():
    assert pack(torch.arange(3), 4).shape == (0, 4)


def test_tokenize_documents_ends_every_document_with_eos(tokenizer):
    docs = ["The river.", "A bee."]
    stream = tokenize_documents(docs, tokenizer)
    expected = []
    for doc in docs:
        expected += tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert stream.dtype == torch.int64 and stream.tolist() == expected


def test_packed_dataset_items_are_blocks_with_labels_equal_to_inputs():
    dataset = PackedDataset(torch.arange(12).view(3, 4))
    item = dataset[1]
    assert len(dataset) == 3 and dataset.num_tokens == 12
    assert torch.equal(item["input_ids"], torch.tensor([4, 5, 6, 7]))
    assert torch.equal(item["labels"], item["input_ids"])


def test_shipped_corpus_dataset_is_the_tokenized_corpus_in_order(tokenizer):
    spec = DataSpec(seq_len=64, shipped_corpus=True)
    dataset = build_dataset(spec, tokenizer)
    stream = tokenize_documents(read_documents(spec), tokenizer)
    assert len(dataset) == stream.numel() // 64
    assert torch.equal(dataset.blocks_i64.reshape(-1), stream[: len(dataset) * 64])


def test_max_examples_limits_the_documents_read(tokenizer):
    small = build_dataset(DataSpec(seq_len=8, shipped_corpus=True, max_examples=3), tokenizer)
    docs = list(read_documents(DataSpec(seq_len=8, shipped_corpus=True)))[:3]
    assert small.num_tokens == tokenize_documents(docs, tokenizer).numel() // 8 * 8


def test_data_shorter_than_one_block_says_to_lower_seq_len(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text("Just a few words.")
    spec = DataSpec(seq_len=4096, files=[str(tmp_path / "a.txt")])
    with pytest.raises(RecipeError, match=r"fewer than one block of `data.seq_len` = 4096"):
        build_dataset(spec, tokenizer)


# ---- local files ------------------------------------------------------------------------------


def test_text_files_give_one_document_per_paragraph(tmp_path):
    (tmp_path / "a.txt").write_text("First paragraph\nstill first.\n\n\nSecond.\n")
    (tmp_path / "b.md").write_text("# Title\n\nBody.")
    spec = DataSpec(seq_len=8, files=[str(tmp_path / "a.txt"), str(tmp_path / "b.md")])
    assert list(read_documents(spec)) == ["First paragraph\nstill first.", "Second.", "# Title", "Body."]


def test_json_and_jsonl_records_give_their_text_column(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"body": "one", "id": 1}\n\n{"body": "two"}\n')
    (tmp_path / "b.json").write_text(json.dumps([{"body": "three"}]))
    spec = DataSpec(seq_len=8, files=[str(tmp_path / "a.jsonl"), str(tmp_path / "b.json")], text_column="body")
    assert list(read_documents(spec)) == ["one", "two", "three"]


def test_record_without_the_text_column_names_the_fields_it_has(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"content": "one"}\n')
    spec = DataSpec(seq_len=8, files=[str(tmp_path / "a.jsonl")])
    with pytest.raises(RecipeError, match=r"record 1 has no string field `text` \(it has \['content'\]\); set `data.text_column`"):
        list(read_documents(spec))


def test_invalid_jsonl_line_is_named(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{not json\n')
    with pytest.raises(RecipeError, match=r"a.jsonl line 2 is not valid JSON"):
        list(read_documents(DataSpec(seq_len=8, files=[str(tmp_path / "a.jsonl")])))


def test_json_file_that_is_not_a_list_says_to_use_jsonl(tmp_path):
    (tmp_path / "a.json").write_text('{"text": "one"}')
    with pytest.raises(RecipeError, match=r"holds a dict; expected a list of records"):
        list(read_documents(DataSpec(seq_len=8, files=[str(tmp_path / "a.json")])))


# ---- hub datasets (the `datasets` package, faked: nothing is downloaded) ----------------------


def test_hub_dataset_is_loaded_with_the_recipe_arguments(monkeypatch):
    calls = []

    def load_dataset(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        return iter([{"text": "alpha"}, {"text": "beta"}, {"text": "gamma"}])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    spec = DataSpec(seq_len=8, name="org/corpus", config="v1", split="train", streaming=True)
    assert list(read_documents(spec)) == ["alpha", "beta", "gamma"]
    assert calls == [("org/corpus", "v1", "train", True)]


def test_hub_dataset_without_the_datasets_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(RecipeError, match=r"`datasets` package is not installed; `pip install datasets`"):
        list(read_documents(DataSpec(seq_len=8, name="org/corpus")))
