"""``--help`` of each run command groups its flags by the config's sections and lists only the flags the command
reads (issue 28 item 6); ``--devices`` counts devices per node and ``--nodes`` the nodes."""

from __future__ import annotations

import json

import pytest

from trainfit.config import SECTIONS

HEADINGS = {
    "memory": ("model", "data", "levers", "distribution", "schedule", "run", "output"),
    "profile": ("model", "data", "levers", "distribution", "schedule", "run", "output"),
    "train": ("model", "data", "levers", "distribution", "schedule", "run", "output"),
    "prepare": ("data", "output"),
}


def _help(trainfit_cli, command: str) -> str:
    done = trainfit_cli(command, "--help")
    assert done.returncode == 0, done.stderr
    return done.stdout


def _groups(text: str) -> dict[str, list[str]]:
    """Heading -> the long flags listed under it (argparse prints ``heading:`` then indented flags)."""
    groups: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = line[:-1]
            groups[current] = []
        elif current and line.startswith("  -"):
            groups[current] += [w.rstrip(",") for w in line.split() if w.startswith("--")]
    return groups


@pytest.mark.parametrize("command", sorted(HEADINGS))
def test_help_shows_the_section_headings(trainfit_cli, command):
    groups = _groups(_help(trainfit_cli, command))
    assert set(HEADINGS[command]) <= set(groups), groups.keys()
    for section in set(HEADINGS[command]) & set(SECTIONS):  # each run flag under its own section
        for flag in groups[section]:
            key = flag[2:].replace("-", "_")
            if key in {k for keys in SECTIONS.values() for k in keys}:
                assert key in SECTIONS[section], (command, flag, section)
    assert "--json" in groups["output"]


def test_each_command_lists_only_the_flags_it_reads(trainfit_cli):
    memory, profile, train = (_help(trainfit_cli, c) for c in ("memory", "profile", "train"))
    for flag in ("--checkpoint-every", "--steps", "--lr", "--schedule", "--eval-every", "--log ", "--save-every"):
        assert flag not in memory, flag
        assert flag in train, flag
    for flag in ("--checkpoint-every", "--eval-every", "--save-every", "--log "):
        assert flag not in profile, flag
    assert "--steps" in profile and "--nodes" in memory and "--nodes" in train
    # a key memory does not read may still sit in a TOML file, as before
    done = trainfit_cli("memory", "--help")
    assert done.returncode == 0


def test_a_toml_key_memory_ignores_is_still_read(trainfit_cli, tmp_path):
    cfg = tmp_path / "job.toml"
    cfg.write_text('model_config = "n_layer=1,d_model=16,n_head=2"\nseq_len = 8\nmicro_batch = 1\naccumulation = 1\n'
                   "checkpoint_every = 7\nsteps = 11\nlr = 0.001\n")
    done = trainfit_cli("memory", str(cfg), "--estimate", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["seq_len"] == 8


def test_memory_estimate_devices_times_nodes_equals_the_ranks(trainfit_cli):
    flags = ["memory", "--estimate", "--model-config", "n_layer=1,d_model=16,n_head=2", "--seq", "8",
             "--micro-batch", "1", "--accumulation", "1", "--strategy", "zero3", "--json"]
    two_nodes = trainfit_cli(*flags, "--devices", "4", "--nodes", "2")
    one_node = trainfit_cli(*flags, "--devices", "8")
    assert two_nodes.returncode == one_node.returncode == 0, two_nodes.stderr + one_node.stderr
    a, b = json.loads(two_nodes.stdout), json.loads(one_node.stdout)
    for d in (a, b):
        d.pop("wall_s")
    assert a == b and a["world_size"] == 8
    single = json.loads(trainfit_cli(*flags[:-3], "--json").stdout)  # one rank: zero3 shards nothing
    assert a["params_bytes"] < single["params_bytes"]


def test_memory_measure_refuses_nodes(trainfit_cli):
    done = trainfit_cli("memory", "--nodes", "2")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "nodes=2" in done.stderr
