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
from torch._guards import detect_fake_mode
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from trainfit.checkpoint import list_checkpoints, load_latest
from trainfit.config import RunConfig
from trainfit.errors import CheckpointError, ConfigError, ModelError
from trainfit.gate import RECORD, read_document
from trainfit.levers.finetune import merged_state_dict
from trainfit.levers.precision import Precision
from trainfit.presets import GPT_PRESETS, GPTConfig
from trainfit.strategies.base import unwrap
from trainfit.strategies.dist_checkpoint import list_dcp
from trainfit.tasks.files import load_text_data
from trainfit.tasks.spec import DataSpec
from trainfit.tasks.gpt import GPT
from trainfit.tasks.hf import WEIGHTS, pretrained_dir, quiet_progress, safetensors_files
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
        tok = Path(_tokenizer_dir(run.cfg))
        if str(tok) and tok.is_dir():
            for name in TOKENIZER_FILES:
                if (tok / name).is_file():
                    shutil.copy2(tok / name, out / name)
        return
    _save_safetensors(sd, out / WEIGHTS)
    meta = {GPT_MARKER: run.cfg.model}
    if isinstance(model, GPT):
        meta.update(dataclasses.asdict(model.cfg))
    _write_json(out / "config.json", meta)


def _tokenizer_dir(cfg: RunConfig) -> str:
    """The tokenizer directory the run's data was tokenized with: ``--tokenizer DIR``, or the one a prepared
    token directory records (its sidecar); "" for the byte tokenizer."""
    if cfg.data:
        return load_text_data(DataSpec.from_config(cfg)).tokenizer_dir  # cached: read once per process
    return cfg.tokenizer if cfg.tokenizer != "byte" else ""


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
    meta = read_document(directory / "config.json", field="config.json", fmt="json", limits=RECORD, error=ModelError)
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


# -- weights in: --init-from RUN_DIR -------------------------------------------------------------------------
def _lora_scaling(config: object) -> float:
    """alpha / r of the run that wrote a state (0 without LoRA): what its adapters add when merged."""
    spec = parse_lora(config.get("lora", "")) if isinstance(config, dict) else None
    return spec.alpha / spec.r if spec is not None else 0.0


def _from_dcp(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The model tensors of a sharded checkpoint (the fp32 masters where it holds them), read whole by this
    process alone (``no_dist``: every rank of a distributed run reads them itself)."""
    try:
        meta = read_document(path / "trainfit.json", field="trainfit.json", fmt="json", limits=RECORD,
                             error=CheckpointError)
        layout = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - OSError, DCP's own: one line naming the checkpoint
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(e).__name__})") from None
    wanted: dict[str, dict[str, torch.Tensor]] = {"model": {}, "master": {}}
    for key, m in layout.items():
        part, _, name = key.partition(".")
        if part in wanted and isinstance(m, TensorStorageMetadata):
            wanted[part][name] = torch.empty(m.size, dtype=m.properties.dtype)
    wanted = {k: v for k, v in wanted.items() if v}
    try:
        dcp.load(wanted, checkpoint_id=str(path), no_dist=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:160] if str(e) else ''})") from None
    sd = {**wanted.get("model", {}), **wanted.get("master", {})}  # fp32 masters over the half weights
    return sd, meta.get("config", {})


def init_state(run_dir: str | Path) -> tuple[dict[str, torch.Tensor], str]:
    """The weights a trainfit run left, under the base model's names, and where they came from: its
    ``model`` export if that holds full weights, else its newest checkpoint (one-file or sharded). LoRA
    adapters in a checkpoint are merged into their base weights.

    Raises:
        ConfigError: ``init_from`` is no directory or holds neither an export nor a checkpoint.
        CheckpointError: the newest checkpoint cannot be read.
    """
    d = Path(run_dir)
    if not d.is_dir():
        raise ConfigError("init_from", str(run_dir), "an existing trainfit run directory")
    export = d / "model"
    files = safetensors_files(export, field="init_from", value=str(export))
    if files is not None:
        return _read_safetensors(files), str(export)
    sharded, single = list_dcp(d), list_checkpoints(d)
    newest_single = int(single[-1].stem.split("-")[-1]) if single else -1
    if sharded and int(sharded[-1].name.split("-")[1].split(".")[0]) >= newest_single:
        sd, config = _from_dcp(sharded[-1])
        source = str(sharded[-1])
    elif single:
        path, state = load_latest(d)
        sd, config, source = state.get("model"), state.get("config", {}), str(path)
        if not isinstance(sd, dict):
            raise CheckpointError(f"checkpoint {path} holds no model weights")
    else:
        raise ConfigError("init_from", str(run_dir), "a trainfit run directory with an exported model/ or a "
                          "checkpoint", "it holds neither; train that run first (checkpoints/ or model/)")
    return merged_state_dict(sd, _lora_scaling(config)), source


@torch.no_grad()
def init_weights(model: nn.Module, run_dir: str | Path) -> str:
    """Copy another run's weights (:func:`init_state`) into ``model``, as the task built it; returns where
    they came from. Tied weights (one tensor under two names) need one of their names only.

    Raises:
        ConfigError: naming the first parameter or buffer whose name or shape differs.
    """
    if detect_fake_mode() is not None:  # the memory estimate: only shapes matter, and the task built them
        return ""
    sd, source = init_state(run_dir)
    own = model.state_dict()
    storages: dict[int, list[str]] = {}
    for k, v in own.items():
        storages.setdefault(v.untyped_storage().data_ptr(), []).append(k)
    for k, v in own.items():
        if k in sd:
            if tuple(sd[k].shape) != tuple(v.shape):
                raise ConfigError("init_from", str(run_dir), "a run of this model's shape",
                                  f"{k} is {tuple(sd[k].shape)} in {source}, {tuple(v.shape)} here")
        elif not any(t in sd for t in storages[v.untyped_storage().data_ptr()]):
            raise ConfigError("init_from", str(run_dir), "a run of this model", f"{source} lacks {k}")
    extra = [k for k in sd if k not in own]
    if extra:
        raise ConfigError("init_from", str(run_dir), "a run of this model",
                          f"{source} holds {extra[0]}, which this model has not")
    for k, v in own.items():
        if k in sd:
            v.copy_(sd[k])
    return source
