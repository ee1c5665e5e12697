"""A Lightning Trainer with automp as its precision plugin (docs/integrations.md). A small MLP regression on data
made here, so it runs anywhere: `python examples/train_lightning.py [--steps N] [--out DIR]` (needs lightning).
The report lands in the Trainer's log_dir, under DIR."""
import argparse

import lightning.pytorch as pl
import torch
import torch.nn as nn

from automp.integrations.lightning import AutoMP


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 1))

    def training_step(self, batch: tuple, index: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", default="automp-lightning-example")
    opts = p.parse_args()
    x = torch.randn(1024, 32, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(x, x.sin().sum(1, keepdim=True))
    trainer = pl.Trainer(max_steps=opts.steps, default_root_dir=opts.out, plugins=[AutoMP()],
                         enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(Regression(), torch.utils.data.DataLoader(data, batch_size=64, shuffle=True))
    print(f"report: {trainer.log_dir}/automp-report.json")
