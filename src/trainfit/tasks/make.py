"""Resolve a model spec into a :class:`~trainfit.tasks.base.Task`: built-ins, ``hf:Class`` (transformers) and
``module:callable``. Builds torch modules; ``trainfit.tasks`` itself imports nothing, so the package's pure
modules (``tasks.spec``, ``tasks.tokenizer``, ``tasks.corpus``) load without torch."""

from __future__ import annotations

from trainfit.errors import ConfigError
from trainfit.presets import GPT_PRESETS, HF_PRESETS, resolve_model
from trainfit.tasks.base import Task
from trainfit.tasks.builtin import BUILTIN_MODELS, cnn_task, gpt_task
from trainfit.tasks.spec import DataSpec

DATA_MODELS = "the GPT built-ins (" + ", ".join(GPT_PRESETS) + ") and hf: causal LMs (...ForCausalLM, ...LMHeadModel)"
"""The models ``--data`` feeds (they read token rows); the others train on their generated data."""


def is_user_model(model: str) -> bool:
    """Whether ``model`` names a user's ``module:callable`` (its protocol is checked where it is used)."""
    return ":" in model and not model.startswith("hf:")


def make_task(model: str, *, model_config: str = "", seq_len: int = 64, seed: int = 0, dataset_size: int = 4096,
              data: DataSpec | None = None) -> Task:
    """Resolve a model spec into a Task. A ``module:callable`` is imported only here, when named.
    ``data``: token rows from files (GPT built-ins and hf: causal LMs) instead of the generated data."""
    model, model_config = resolve_model(model, model_config)  # llama-7b -> hf:LlamaForCausalLM + its config
    if model in GPT_PRESETS:
        return gpt_task(model, seq_len=seq_len, seed=seed, dataset_size=dataset_size, overrides=model_config,
                        data=data)
    if data is not None and not model.startswith("hf:"):
        raise ConfigError("data", data.data, f"no --data with model {model}", f"data files feed {DATA_MODELS}")
    if model == "cnn":
        return cnn_task(seed=seed, dataset_size=dataset_size, overrides=model_config)
    if model.startswith("hf:"):
        from trainfit.tasks.hf import hf_task  # lazy: imports transformers (~2 s), only for hf: models

        return hf_task(model[3:], model_config=model_config, seq_len=seq_len, seed=seed, dataset_size=dataset_size,
                       data=data)
    if is_user_model(model):
        from trainfit.tasks.user import user_task  # lazy: the user's module is imported only when named

        return user_task(model, model_config=model_config, seq_len=seq_len, seed=seed, dataset_size=dataset_size)
    raise ConfigError("model", model, (*BUILTIN_MODELS, *HF_PRESETS, "hf:<ArchitectureClass>", "<module>:<callable>"))



def task_of(cfg) -> Task:
    """The configured task of a ``RunConfig`` (model + data + loss): the run and every probe build this one."""
    return make_task(cfg.model, model_config=cfg.model_config, seq_len=cfg.seq_len, seed=cfg.seed,
                     dataset_size=cfg.dataset_size, data=DataSpec.from_config(cfg))
