"""An unmodified TRL SFT script: TRL's SFTTrainer with its own SFTConfig from the command line,
a tiny Llama from LlamaConfig and a tiny in-code text dataset (no downloads). It does not know
superoffload exists; `superoffload launch` must make it train with superoffload."""

import torch
from datasets import Dataset
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "the a river runs to sea and light house keeps ships off rocks at night".split()
    vocab = {"<unk>": 0, "<pad>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")


def main():
    (args,) = HfArgumentParser(SFTConfig).parse_args_into_dataclasses()
    torch.manual_seed(args.seed)
    texts = ["the river runs to the sea", "a light house keeps ships off the rocks at night",
             "the sea and the light", "ships at night keep off rocks"] * 8
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=1, eos_token_id=2, bos_token_id=2)
    trainer = SFTTrainer(model=LlamaForCausalLM(config), args=args, train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=tokenizer())
    trainer.train()
    trainer.save_state()


if __name__ == "__main__":
    main()
