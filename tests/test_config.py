"""config: RunConfig refuses a bad value by name, coerces command-line text, and its TOML reads back unchanged."""

import pytest

from trainfit.config import dump_toml, load_toml, make_config
from trainfit.errors import ConfigError
from trainfit.vocabulary import Optimizer, PrecisionName


@pytest.mark.parametrize("key, value, allowed", [
    ("accumulation", 0, "an integer >= 1"),
    ("micro_batch", "x", "an integer"),
    ("precision", "fp8", "one of: fp32, bf16-mixed"),
    ("lr", "fast", "a number"),
    ("optimizer", "lion", "one of:"),
    ("checkpointing", "sometimes", ""),
])
def test_a_bad_value_is_refused_naming_the_field_the_value_and_what_is_allowed(key, value, allowed):
    with pytest.raises(ConfigError) as e:
        make_config({key: value})
    assert e.value.field == key
    assert f"{key}={value!r} is not valid; allowed: " in str(e.value) or f"{key}={value} is not valid" in str(e.value)
    assert allowed in str(e.value)
    assert "\n" not in str(e.value)


def test_an_unknown_key_is_refused_with_the_known_ones():
    with pytest.raises(ConfigError, match=r"config key='micro_bach' is not valid; allowed: one of: .*micro_batch"):
        make_config({"micro_bach": 4})


def test_command_line_text_becomes_the_fields_types():
    cfg = make_config({"micro_batch": "4", "lr": "1e-2", "packing": "off", "precision": "bf16-mixed",
                       "optimizer": "sgd", "memory_cap": "2MiB", "nproc": "2"})
    assert cfg.micro_batch == 4 and cfg.lr == 0.01 and cfg.packing is False and cfg.devices == 2
    assert cfg.precision is PrecisionName.BF16_MIXED and cfg.optimizer is Optimizer.SGD
    assert cfg.memory_cap == 2 * 2**20


def test_toml_written_reads_back_to_the_same_config(tmp_path):
    cfg = make_config({"precision": "fp16-mixed", "micro_batch": 3, "accumulation": 5, "checkpointing": "every:2",
                       "lr": 1e-4, "run_dir": 'a "quoted" dir', "freeze": "*.bias", "schedule": "cosine",
                       "warmup_steps": 3})
    for only_changed in (False, True):
        path = tmp_path / f"c{only_changed}.toml"
        path.write_text(dump_toml(cfg, only_changed=only_changed))
        assert make_config(load_toml(path)) == cfg
