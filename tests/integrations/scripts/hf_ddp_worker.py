"""Run under ``torchrun --nproc_per_node 2``: one Trainer step from a ``--write-for hf-trainer`` JSON; each rank
writes what the Trainer's own objects say (distributed type, processes, the model's wrapper, shard shapes).
trainfit's callback rides along: its memory.json must name the strategy and world size that ran."""

import json
import sys
import warnings

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from trainfit.integrations.hf_callback import TrainfitCallback

args_file, out_dir = sys.argv[1], sys.argv[2]
kwargs = json.load(open(args_file))
args = TrainingArguments(output_dir=out_dir, **kwargs, max_steps=2, report_to=[], save_strategy="no",
                         logging_strategy="no", disable_tqdm=True)
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                                   eos_token_id=0))
rows = [{"input_ids": torch.randint(0, 64, (8,)), "labels": torch.randint(0, 64, (8,))} for _ in range(16)]
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[TrainfitCallback(measure_step=1)])
    trainer.train()
state = trainer.accelerator.state
wrapped = trainer.model_wrapped
p = next(wrapped.parameters())
info = {"rank": state.process_index, "distributed_type": str(state.distributed_type.value),
        "num_processes": state.num_processes, "wrapper": type(wrapped).__name__, "param_type": type(p).__name__,
        "local_numel": (p.to_local() if hasattr(p, "to_local") else p).numel(), "numel": p.numel(),
        "steps": trainer.state.global_step}
open(f"{out_dir}/rank{state.process_index}.json", "w").write(json.dumps(info))
if torch.distributed.is_initialized():  # as a torchrun script should end: without it a rank's gloo threads can
    torch.distributed.barrier()  # still be running at interpreter exit (one CI run: "terminate called without an
    torch.distributed.destroy_process_group()  # active exception", SIGABRT on rank 1 after both ranks had trained)
