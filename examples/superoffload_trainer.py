"""The stock-Trainer script with superoffload's Trainer and TrainingArguments (for torchrun):
`torchrun --nproc_per_node 2 superoffload_trainer.py --superoffload true ...`."""

import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM

from superoffload_hf import Trainer, TrainingArguments

from stock_trainer import TinyDataset


def main():
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    trainer = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=TinyDataset())
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_state()


if __name__ == "__main__":
    main()
