"""Weights out (``RUN_DIR/model``) and weights in (``--init-from RUN_DIR``).

:func:`export_model` is a collective: every rank calls it, rank 0 writes. It gathers the whole model
for every strategy -- single and ddp/zero1 hold it whole already; zero2/zero3 (FSDP2) gather it with
``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` -- and writes floating tensors in fp32:
where the precision keeps fp32 master copies (bf16-true, fp16-true) the masters are written, not the
half weights the forward pass uses, so an export loses nothing training kept. What is written:

==============================  ============================================================================
the run's model                  RUN_DIR/model holds
==============================  ============================================================================
``hf:`` (transformers)           ``save_pretrained``: config.json + model.safetensors (dtype float32); loads
                                 with ``AutoModelFor...from_pretrained``; the tokenizer files when
                                 ``--tokenizer`` is a directory
built-in GPT                     model.safetensors + config.json (GPTConfig's fields, ``trainfit_model``);
                                 :func:`load_gpt` rebuilds it
``--lora ...,merge=true``        the adapters merged into the base weights, then as above
``--lora`` (not merged)          the adapter: adapter_config.json + adapter_model.safetensors (peft's
                                 ``save_pretrained``; ``base_model_name_or_path`` = the absolute hf:DIR)
``module:callable``              model.safetensors + config.json naming the factory
==============================  ============================================================================

Atomic: written into ``.model.tmp`` beside it, then renamed over a previous export of the same run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from trainfit.checkpoint import list_checkpoints, load_latest
from trainfit.config import RunConfig
from trainfit.errors import CheckpointError, ModelError
from trainfit.levers.finetune import PEFT_PREFIX, base_name, merged_state_dict
from trainfit.levers.precision import Precision
from trainfit.presets import GPT_PRESETS, GPTConfig
from trainfit.strategies.base import unwrap
from trainfit.strategies.dist_checkpoint import list_dcp
from trainfit.tasks.gpt import GPT
from trainfit.tasks.hf import WEIGHTS, WEIGHTS_INDEX, pretrained_dir, quiet_progress
from trainfit.vocabulary import parse_lora

GPT_MARKER = "trainfit_model"
"""config.json key naming the trainfit model an export holds (``gpt-tiny``, ``module:callable``)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class Exportable(Protocol):
    """What export reads of a run (:class:`trainfit.run.Run` is one)."""

    cfg: RunConfig
    model: nn.Module
    precision: Precision


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def full_state_dict(run: Exportable) -> dict[str, torch.Tensor]:
    """The whole model's state on CPU, floating tensors in fp32 (masters where the precision keeps them);
    a collective under FSDP2. Every rank gets it except under FSDP2, where ranks other than 0 get ``{}``."""
    model = unwrap(run.model)
    if any(isinstance(p, DTensor) for p in model.parameters()):  # FSDP2: gather the shards (collective)
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimized = run.precision.optimizer_params(run.model)
    if sd and len(optimized) == len(trainable) and any(m is not p for (_, p), m in zip(trainable, optimized)):
        for (name, _), master in zip(trainable, optimized):  # bf16-true/fp16-true: the fp32 masters
            sd[name] = master.detach().cpu()
    return {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}


def _unshared(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing memory (tied weights): copy the second and later of each."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for k, v in sd.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset())
        out[k] = v.contiguous() if key not in seen else v.clone().contiguous()
        seen.add(key)
    return out


def _save_safetensors(sd: Mapping[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file  # lazy: safetensors comes with the hf/lora extras

    save_file(_unshared(sd), str(path))


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _set_fp32(config_json: Path) -> None:
    """The export holds fp32 tensors: say so, or ``from_pretrained(dtype="auto")`` reads a half dtype the
    training precision left in the config."""
    cfg = json.loads(config_json.read_text())
    for key in ("dtype", "torch_dtype"):
        if key in cfg:
            cfg[key] = "float32"
    _write_json(config_json, cfg)


def _write(run: Exportable, sd: dict[str, torch.Tensor], out: Path) -> None:
    """Rank 0: the export's files into the (empty) directory ``out``."""
    model = unwrap(run.model)
    spec = parse_lora(run.cfg.lora)
    peft_model = model if spec is not None and hasattr(model, "peft_config") else None
    if peft_model is not None and not spec.merge:
        base = pretrained_dir(run.cfg.model[3:]) if run.cfg.model.startswith("hf:") else None
        config = peft_model.peft_config["default"]
        before = config.base_model_name_or_path
        config.base_model_name_or_path = str(base) if base is not None else before
        try:
            peft_model.save_pretrained(str(out), state_dict=sd, safe_serialization=True)
        finally:
            config.base_model_name_or_path = before
        return
    if peft_model is not None:  # merge=true: W + alpha/r * B @ A, under the base model's own names
        sd = merged_state_dict(sd, spec.alpha / spec.r)
        model = peft_model.get_base_model()
    if hasattr(model, "save_pretrained") and hasattr(model, "config"):  # a transformers model
        with quiet_progress():
            model.save_pretrained(str(out), state_dict=sd, safe_serialization=True)
        _set_fp32(out / "config.json")
        tok = Path(run.cfg.tokenizer)
        if run.cfg.tokenizer != "byte" and tok.is_dir():
            for name in TOKENIZER_FILES:
                if (tok / name).is_file():
                    shutil.copy2(tok / name, out / name)
        return
    _save_safetensors(sd, out / WEIGHTS)
    meta = {GPT_MARKER: run.cfg.model}
    if isinstance(model, GPT):
        meta.update(dataclasses.asdict(model.cfg))
    _write_json(out / "config.json", meta)


def _replace_dir(tmp: Path, final: Path) -> None:
    """``tmp`` becomes ``final``; a previous ``final`` is removed only after the new one is in place."""
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def export_model(run: Exportable, out_dir: Path) -> Path | None:
    """Write the run's model to ``out_dir`` (a collective: every rank calls it; rank 0 writes).

    Returns:
        ``out_dir`` on rank 0, None on the other ranks.
    """
    out_dir = Path(out_dir)
    sd = full_state_dict(run)  # a collective under FSDP2
    written = None
    if _rank() == 0:
        tmp = out_dir.with_name(f".{out_dir.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # left by an export that died mid-write
        tmp.mkdir(parents=True)
        try:
            _write(run, sd, tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _replace_dir(tmp, out_dir)
        written = out_dir
    if _distributed():
        dist.barrier()  # every rank returns once the export is in place
    return written


def load_gpt(directory: str | Path) -> GPT:
    """The built-in GPT an export holds (config.json + model.safetensors), in fp32, in train mode."""
    directory = Path(directory)
    try:
        meta = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{directory}: no readable config.json ({type(e).__name__})") from None
    if not isinstance(meta, dict) or meta.get(GPT_MARKER) not in GPT_PRESETS:
        raise ModelError(f"{directory}/config.json does not hold a trainfit GPT export ({GPT_MARKER!r} missing)")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    model = GPT(GPTConfig(**{k: v for k, v in meta.items() if k in fields}))
    model.load_state_dict(_read_safetensors([directory / WEIGHTS]))
    return model


def _read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file  # lazy: safetensors comes with the hf/lora extras

    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            sd.update(load_file(str(f)))
        except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: unusable either way
            raise CheckpointError(f"{f} is not a readable safetensors file ({type(e).__name__})") from None
    return sd
