"""Run as ``python THIS pl.json OUT``: Lightning's own launcher starts the other processes from the Trainer
arguments of a ``--write-for lightning`` file; each rank writes what the Trainer's own objects say."""

import json
import sys
import warnings

import lightning.pytorch as pl
import torch
from torch import nn

cfg_file, out_dir = sys.argv[1], sys.argv[2]
cfg = json.load(open(cfg_file))


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 1)

    def training_step(self, batch, i):
        self.wrapper = type(self.trainer.strategy.model).__name__  # during fit (teardown unwraps it)
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


warnings.simplefilter("ignore")
trainer = pl.Trainer(**cfg["trainer"], max_steps=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=out_dir)
module = Tiny()
trainer.fit(module, torch.utils.data.DataLoader(torch.randn(64, 8), batch_size=cfg["batch_size"]))
info = {"rank": trainer.global_rank, "world_size": trainer.world_size, "strategy": type(trainer.strategy).__name__,
        "wrapper": module.wrapper, "steps": trainer.global_step,
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None}
open(f"{out_dir}/rank{trainer.global_rank}.json", "w").write(json.dumps(info))
if torch.distributed.is_initialized():  # as a torchrun script should end: without it a rank's gloo threads can
    torch.distributed.barrier()  # still be running at interpreter exit (one CI run: "terminate called without an
    torch.distributed.destroy_process_group()  # active exception", SIGABRT on rank 1 after both ranks had trained)
