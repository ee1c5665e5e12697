"""A Hugging Face Trainer with automp as one callback (docs/integrations.md). A tiny GPT-2 on random tokens, made here,
so it runs anywhere: `python examples/train_hf_trainer.py [--steps N] [--out DIR]` (needs transformers and
accelerate). The report lands in DIR/automp-report.json."""
import argparse

import torch
import transformers

from automp.integrations.transformers import AutoMPCallback


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 32, vocab: int = 128):
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="automp-hf-example")
    opts = p.parse_args()
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64,
                                                                 n_layer=2, n_head=2))
    args = transformers.TrainingArguments(output_dir=opts.out, max_steps=opts.steps, per_device_train_batch_size=8,
                                          logging_steps=5, report_to=[], save_strategy="no")
    transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[AutoMPCallback()]).train()
