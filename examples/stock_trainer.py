"""An unmodified stock-Trainer training script: it does not know superoffload exists.

Tiny Llama from LlamaConfig, a tiny in-code dataset, stock transformers.Trainer and
TrainingArguments parsed from the command line. `superoffload launch` must make it train with
superoffload (tests/integrations/test_launcher.py); `python stock_trainer.py --output_dir out` trains
it with the stock optimizer.
"""

import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class TinyDataset(torch.utils.data.Dataset):
    def __init__(self, size=32, seq=16, vocab=128):
        generator = torch.Generator().manual_seed(0)
        self.input_ids = torch.randint(0, vocab, (size, seq), generator=generator)

    def __len__(self):
        return len(self.input_ids)

    def __getitem__(self, index):
        return {"input_ids": self.input_ids[index], "labels": self.input_ids[index]}


def main():
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    trainer = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=TinyDataset())
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)  # as stock examples do
    trainer.save_state()


if __name__ == "__main__":
    main()
