import torch
from torch import nn
from torch.nn import functional as F

import trainfit

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
teacher = torch.randn(16, 4)
xs = [torch.randn(8, 16) for _ in range(64)]
data = [(x, (x @ teacher).argmax(1)) for x in xs] * 3  # learnable labels, 3 epochs

# The levers: precision (here bf16 autocast), accumulation (4 micro-batches), checkpointing.
precision = trainfit.make_precision("bf16-mixed")          # or fp16-mixed, bf16-true, fp16-true
trainfit.apply_checkpointing(model, trainfit.parse_checkpoint_policy("full"), block_names=["0", "2"])
precision.prepare(model)                                     # casts weights / makes fp32 masters
optimizer = torch.optim.AdamW(precision.optimizer_params(model), lr=1e-2)


def loss_fn(model, batch):  # return the SUM of per-item losses and the item count
    x, y = batch
    return F.cross_entropy(model(x).float(), y, reduction="sum"), y.numel()


losses = []
for i in range(0, len(data), 4):
    result = trainfit.optimizer_step(
        model=model, optimizer=optimizer, precision=precision, micro_batches=data[i : i + 4],
        loss_fn=loss_fn, count_fn=lambda batch: batch[1].numel(), grad_clip=1.0,
    )
    losses.append(result.loss)  # also: result.stepped, result.loss_scale, result.grad_norm
print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
