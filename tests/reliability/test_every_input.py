"""Property-based: every input to every command keeps the bad-input promise.

For each of the six commands (train, memory, profile, verify, plan, report) hypothesis draws flags, TOML
configs, ``--model-config`` keys and values (every built-in model and three ``transformers`` classes),
paths (quotes, backslashes, control characters, spaces, files where directories are expected and the
reverse), run directories holding the user's own files, checkpoints with missing or extra keys and report
inputs with malformed lines and files; and ``train --data`` over data files, tokenizers and prepared directories
(intact and tampered) and ``memory --from`` files (JSON, YAML, nested aliases, bytes, deep nesting), where a
refusal must be exactly one stderr line (``cli_harness.check_one_line``). Each example runs in a fresh
workspace that holds files of the user's; the assertion (``cli_harness.check_promise``) is the same for all: exit 0 or 2, no traceback,
stdout empty or exactly one strict JSON object, no pre-existing file of the user's changed (hashed before
and after), nothing left behind by a refused command.

Example counts are fixed (``derandomize=True``), so CI runs the same inputs each time;
``pytest tests/reliability/test_every_input.py --hypothesis-show-statistics`` prints how many ran.
"""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import tomli_w
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainfit.config import FIELDS, dump_toml, make_config
from trainfit.outputs import MARKER
from trainfit.presets import GPTConfig

from .cli_harness import check_one_line, check_promise, cli, snapshot

pytestmark = pytest.mark.filterwarnings("ignore")

def _settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large])


TINY = ["--model-config", "n_layer=1,d_model=16,n_head=2", "--seq", "8", "--micro-batch", "2", "--accumulation", "1"]

# -- the workspace: files of the user's, a trainfit run dir, things in the way ---------------------------------
USER_FILES = {"notes.txt": "my notes\n", "foreign/config.toml": "# mine\nsteps = 3\n",
              "foreign/metrics.jsonl": '{"mine": 1}\n', "afile": "a file, not a directory\n",
              "existing.png": "not really a png\n", "existing.toml": "# my plan\n", "existing.html": "<p>mine</p>\n",
              "emptydir/.keep": ""}


def _workspace() -> Path:
    root = Path(tempfile.mkdtemp(prefix="tf-prop-"))
    for rel, text in USER_FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "emptydir" / ".keep").unlink()
    owned = root / "owned"
    owned.mkdir()
    (owned / MARKER).write_text("")
    (owned / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5, "loss_scale": 1.0}\n')
    return root


def _run(args: list[str], setup=None) -> None:
    root = _workspace()
    try:
        if setup:
            setup(root)
        before = snapshot(root)
        r = cli(args, cwd=root)
        check_promise(r, root, before, json_mode="--json" in args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -- strategies ------------------------------------------------------------------------------------------------------
SPECIAL = ['q"uote', "back\\slash", "sp ace", "tab\tx", "nl\nx", "bell\x07", "ü-ñ", "'single'", "$HOME", "*",
           "..", "-dash"]
path = st.one_of(
    st.sampled_from(["new", "afile", "foreign", "owned", "emptydir", "afile/sub", "existing.png", "existing.toml",
                     "existing.html", "notes.txt", "new/deeper", "x.png", "dir.png", *SPECIAL]),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00/"), min_size=1, max_size=8),
)
odd_text = st.sampled_from(["0", "-1", "nan", "inf", "-inf", "1e400", "abc", "", " ", "0.5", "2.5", "1KiB",
                            "0.5B", "1GB/s", "true", "1_000", "0x10", "٣"])
small_number = st.one_of(st.integers(-3, 40).map(str), odd_text, st.floats(-5, 50).map(repr))
huge_number = st.one_of(small_number, st.integers(-(10**20), 10**20).map(str), st.sampled_from([str(10**18)]))

# A flag of the run (train/memory/profile/verify) and the values drawn for it; sizes kept small so a valid
# draw still runs in a second.
RUN_FLAG_VALUES = {
    "--precision": st.one_of(st.sampled_from(["fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp8", "FP32", ""]),
                             odd_text),
    "--micro-batch": st.one_of(small_number, st.just("auto")),
    "--accumulation": small_number, "--seq": small_number, "--steps": st.sampled_from(["0", "-1", "1", "x", "1.5"]),
    "--checkpointing": st.sampled_from(["none", "full", "every:1", "every:0", "every:x", "class:Block",
                                        "class:", "sometimes", ""]),
    "--strategy": st.sampled_from(["single", "ddp", "zero3", "zero9", ""]),
    "--grad-sync": st.sampled_from(["deferred", "per-micro-batch", "never"]),
    "--global-batch": small_number, "--optimizer": st.sampled_from(["adamw", "sgd", "lion"]),
    "--lr": small_number, "--seed": st.one_of(small_number, st.sampled_from([str(2**32), str(2**64), "-5"])),
    "--loader-workers": st.sampled_from(["0", "-1", "x"]), "--memory-cap": st.one_of(odd_text, st.just("64MiB")),
    "--checkpoint-every": small_number, "--devices": st.sampled_from(["0", "-1", "1", "x"]),
    "--model": st.sampled_from(["gpt-tiny", "cnn", "nonexistent", "hf:NoSuchModel", "os:path", "json:loads",
                                "trainfit:nothing", ":", "hf:"]),
}
COMMAND_FLAGS = {
    "train": {"--resume": None, "--json": None, "--max-restarts": small_number, "--run-dir": path},
    "memory": {"--estimate": None, "--json": None, "--budget": small_number, "--batch": small_number,
               "--plot": path, "--force": None, "--devices": st.sampled_from(["0", "-2", "1", "x"])},
    "profile": {"--json": None, "--warmup": small_number, "--overlap": small_number, "--plot": path,
                "--trace": path, "--force": None, "--bandwidth": st.sampled_from(["1GB/s", "0GB/s", "fast", "-1GB/s"])},
    "verify": {"--json": None, "--report": None, "--run-dir": path},
}


@st.composite
def flags(draw, command: str, max_flags: int = 3):
    pool = {**RUN_FLAG_VALUES, **COMMAND_FLAGS[command]}
    out = []
    for name in draw(st.lists(st.sampled_from(sorted(pool)), max_size=max_flags, unique=True)):
        values = pool[name]
        out += [name] if values is None else [name, draw(values)]
    return out


BASE = {
    "train": ["train", *TINY, "--steps", "1", "--run-dir", "new"],
    "memory": ["memory", *TINY],
    "profile": ["profile", *TINY, "--steps", "1", "--warmup", "0", "--no-batch-probe", "--bandwidth", "1GB/s"],
    "verify": ["verify", *TINY, "--run-dir", "new"],
}


@pytest.mark.parametrize("command, n", [("train", 45), ("memory", 12), ("profile", 12), ("verify", 15)])
def test_flags_of_the_run_commands(command, n):
    @_settings(n)
    @given(extra=flags(command))
    def check(extra):
        _run([*BASE[command], *extra])  # later flags win over BASE's

    check()


plan_flag_values = {
    "--global-batch": huge_number, "--device-memory": st.one_of(odd_text, st.just("80GiB"), huge_number),
    "--devices": huge_number, "--nodes": small_number, "--seq": huge_number, "--headroom": small_number,
    "--top": small_number, "--device": st.sampled_from(["h100", "a100", "cpu", "tpu", "H100", ""]),
    "--precisions": st.sampled_from(["fp32", "bf16-mixed,fp32", "fp8", ",", ""]),
    "--checkpointings": st.sampled_from(["none", "full", "every:2", "every:0", "every:x", "x"]),
    "--strategies": st.sampled_from(["ddp", "zero3,ddp", "zero9", ""]),
    "--bandwidth-intra": st.sampled_from(["450GB/s", "0GB/s", "-5GB/s", "fast", "1e400GB/s"]),
    "--optimizer": st.sampled_from(["adamw", "sgd", "lion"]), "--basis": st.sampled_from(["auto", "analytic", "x"]),
    "--write": path, "--json": None, "--force": None, "--report": None, "--run-dir": path,
    "--model": st.sampled_from(["gpt-tiny", "gpt2-small", "llama-7b", "llama-70b", "hf:LlamaForCausalLM", "cnn",
                                "nonexistent"]),
    "--model-config": st.sampled_from(["", "n_layer=1", "num_hidden_layers=1", "bogus=1", "n_head=3",
                                       "hidden_size=30", "num_hidden_layers=2.5", "n_layer=-1", "x", "=", ",,"]),
}


@_settings(70)
@given(extra=st.lists(st.sampled_from(sorted(plan_flag_values)), max_size=4, unique=True).flatmap(
    lambda names: st.tuples(*[st.just([n]) if plan_flag_values[n] is None else
                              st.tuples(st.just(n), plan_flag_values[n]).map(list) for n in names])))
def test_flags_of_plan(extra):
    flat = [x for pair in extra for x in pair]
    _run(["plan", "--global-batch", "64", "--device-memory", "80GiB", "--devices", "8", "--model", "llama-7b", *flat])


# -- TOML configs -------------------------------------------------------------------------------------------------------
toml_value = st.one_of(st.integers(-3, 40), st.floats(allow_nan=True), st.booleans(),
                       st.text(max_size=10), st.sampled_from(SPECIAL), st.lists(st.integers(0, 3), max_size=2),
                       st.dictionaries(st.sampled_from("ab"), st.integers(0, 3), max_size=1))
TOML_KEYS = [k for k in FIELDS if k not in ("steps", "dataset_size", "devices", "model", "model_config", "seq_len",
                                            "micro_batch")] + ["bogus_key", "nproc", "train"]


@_settings(40)
@given(values=st.dictionaries(st.sampled_from(TOML_KEYS), toml_value, max_size=3),
       raw=st.one_of(st.none(), st.binary(max_size=40), st.text(max_size=40)),
       command=st.sampled_from(["train", "memory", "verify"]))
def test_toml_configs(values, raw, command):
    def setup(root: Path):
        if raw is not None:
            (root / "c.toml").write_bytes(raw if isinstance(raw, bytes) else raw.encode())
        else:
            (root / "c.toml").write_text(tomli_w.dumps({k: v for k, v in values.items()}))

    _run([BASE[command][0], "c.toml", *BASE[command][1:]], setup)


@_settings(200)
@given(run_dir=st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=20),
       model_config=st.text(max_size=20), lr=st.floats(1e-6, 10.0), seed=st.integers(0, 2**32 - 1))
def test_config_toml_round_trips_every_string(run_dir, model_config, lr, seed):
    import tomllib

    if not run_dir.strip():
        return
    cfg = make_config({"run_dir": run_dir, "model_config": model_config, "lr": lr, "seed": seed})
    assert make_config(tomllib.loads(dump_toml(cfg))) == cfg


@_settings(40)
@given(run_dir=st.text(min_size=1, max_size=12).filter(
    lambda s: any(ord(c) < 0x20 or ord(c) == 0x7F or 0xD800 <= ord(c) <= 0xDFFF for c in s)))
def test_paths_that_cannot_round_trip_are_refused(run_dir):
    from trainfit.errors import ConfigError

    with pytest.raises(ConfigError, match="run_dir="):
        make_config({"run_dir": run_dir})


# -- --model-config keys and values ---------------------------------------------------------------------------------------
GPT_KEYS = [f.name for f in dataclasses.fields(GPTConfig)]
HF_TINY = {
    "hf:LlamaForCausalLM": "hidden_size=16,num_hidden_layers=1,num_attention_heads=2,intermediate_size=32,"
                           "vocab_size=64",
    "hf:GPT2LMHeadModel": "n_embd=16,n_layer=1,n_head=2,vocab_size=64",
    "hf:BertForSequenceClassification": "hidden_size=16,num_hidden_layers=1,num_attention_heads=2,"
                                        "intermediate_size=32,vocab_size=64",
}


def _config_keys(model: str) -> list[str]:
    if model == "gpt-tiny":
        return GPT_KEYS
    if model == "cnn":
        return ["channels", "n_classes"]
    import transformers

    cls = getattr(transformers, model.removeprefix("hf:")).config_class
    return sorted(k for k in cls().to_dict() if not k.startswith("_"))[:60]


model_value = st.one_of(st.integers(-2, 70).map(str), st.sampled_from(["abc", "2.5", "true", "0.5", "1e400", "-0.1",
                                                                       "", "none", "[1]"]))


@pytest.mark.hf
@_settings(60)
@given(data=st.data())
def test_model_config_keys_and_values(data):
    model = data.draw(st.sampled_from(["gpt-tiny", "cnn", *HF_TINY]))
    base = {"gpt-tiny": "n_layer=1,d_model=16,n_head=2", "cnn": ""}.get(model, HF_TINY.get(model))
    key = data.draw(st.one_of(st.sampled_from(_config_keys(model)), st.sampled_from(["bogus", "", "n_heads"])))
    value = data.draw(model_value)
    command = data.draw(st.sampled_from(["train", "memory-estimate", "verify"]))
    override = ",".join(x for x in (base, f"{key}={value}") if x)
    common = ["--model", model, "--model-config", override, "--seq", "8", "--micro-batch", "2", "--accumulation", "1"]
    if command == "train":
        _run(["train", *common, "--steps", "1", "--run-dir", "new"])
    elif command == "verify":
        _run(["verify", *common])
    else:
        _run(["memory", "--estimate", *common])


# -- checkpoints with missing or extra keys --------------------------------------------------------------------------------
_CHECKPOINT: dict = {}


def _a_checkpoint() -> dict:
    if not _CHECKPOINT:
        root = Path(tempfile.mkdtemp(prefix="tf-ck-"))
        r = cli(["train", *TINY, "--steps", "1", "--run-dir", "r"], cwd=root)
        assert r.rc == 0, r.err
        _CHECKPOINT["state"] = torch.load(root / "r" / "checkpoints" / "step-00000001.pt", weights_only=True)
        shutil.rmtree(root, ignore_errors=True)
    return _CHECKPOINT["state"]


@_settings(15)
@given(drop=st.lists(st.sampled_from(["step", "config", "model", "optimizer", "precision", "rng", "data"]),
                     max_size=2, unique=True),
       extra=st.dictionaries(st.sampled_from(["surprise", "format2"]), st.integers(0, 3), max_size=1),
       damage_config=st.sampled_from([None, "seed", "dataset_size", "not-a-dict"]))
def test_checkpoints_with_missing_or_extra_keys(drop, extra, damage_config):
    import hashlib

    state = {k: v for k, v in _a_checkpoint().items() if k not in drop} | extra
    if damage_config == "not-a-dict" and "config" in state:
        state["config"] = [1, 2]
    elif damage_config and "config" in state:
        state["config"] = {**state["config"], damage_config: 12345}

    def setup(root: Path):
        d = root / "r" / "checkpoints"
        d.mkdir(parents=True)
        (root / "r" / MARKER).write_text("")
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        (d / "step-00000001.pt").write_bytes(data)
        (d / "step-00000001.json").write_text(json.dumps({"format": state.get("format"), "step": 1, "bytes": len(data),
                                                          "sha256": hashlib.sha256(data).hexdigest()}))

    _run(["train", *TINY, "--steps", "2", "--resume", "--run-dir", "r"], setup)


# -- report inputs --------------------------------------------------------------------------------------------------------
json_value = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(10**30), 10**30), st.floats(),
                                    st.text(max_size=6)),
                          lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                  st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                          max_leaves=8)
REPORT_FILES = ["metrics.jsonl", "memory.json", "profile.json", "plan.json", "verify.json", "config.toml"]


@_settings(60)
@given(files=st.dictionaries(st.sampled_from(REPORT_FILES),
                             st.one_of(st.binary(max_size=60), json_value.map(lambda v: json.dumps(v).encode()),
                                       st.lists(json_value, max_size=3).map(
                                           lambda vs: "\n".join(json.dumps(v) for v in vs).encode())),
                             min_size=1, max_size=3),
       out=st.one_of(st.none(), path), as_json=st.booleans())
def test_report_inputs(files, out, as_json):
    def setup(root: Path):
        for name, data in files.items():
            (root / "owned" / name).write_bytes(data)

    _run(["report", "owned", *(["--out", out] if out is not None else []), *(["--json"] if as_json else [])], setup)


# -- data, tokenizers, prepared directories, --from: a refusal is exactly one stderr line ---------------------------
DATA_FILES = {
    "t.txt": b"the quick brown fox jumps over the lazy dog\n" * 8,
    "docs/a.txt": b"one document of plain text, long enough to pack\n" * 4, "docs/b.md": b"# another\n" * 20,
    "d.jsonl": b'{"text": "a document of json lines long enough"}\n' * 6 + b'{"body": "x"}\n',
    "ok.jsonl": b'{"text": "a document of json lines long enough", "body": "another field"}\n' * 6,
    "bom.jsonl": b'\xef\xbb\xbf{"text": "a document"}\n', "bom.txt": b"\xef\xbb\xbfhello there, text\n" * 4,
    "junk.jsonl": b'{"text": 1}\nnot json\n', "t.csv": b"text,n\nhello there from a csv row,1\n" * 6,
    "empty.txt": b"", "latin1.txt": b"caf\xe9 au lait\n" * 8, "t.bin": b"\x00\x01",
    "tok/garbage/tokenizer.json": b"{not a tokenizer", "tok/none/readme.txt": b"no tokenizer here",
}
DATA_PATHS = ["t.txt", "docs", "docs/*.txt", "d.jsonl", "ok.jsonl", "bom.jsonl", "bom.txt", "junk.jsonl", "t.csv",
              "empty.txt", "latin1.txt", "t.bin", "missing.txt", "emptydir", "*.nothing", "prep", "prep_vocab",
              "prep_ids", "prep_trunc", "afile", "notes.txt"]
_PREPARED: dict = {}


def _prepared_once() -> Path:
    """One ``trainfit prepare`` output for the whole module (copied into each example's workspace)."""
    if not _PREPARED:
        root = Path(tempfile.mkdtemp(prefix="tf-prep-"))
        (root / "t.txt").write_bytes(DATA_FILES["t.txt"] * 4)
        r = cli(["prepare", "--data", "t.txt", "--out", "prep"], cwd=root)
        assert r.rc == 0, r.err
        _PREPARED["dir"] = root / "prep"
    return _PREPARED["dir"]


def _data_workspace(root: Path) -> None:
    for rel, data in DATA_FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    for name in ("prep", "prep_vocab", "prep_ids", "prep_trunc"):
        shutil.copytree(_prepared_once(), root / name)
    side = json.loads((root / "prep_vocab" / "prepared.json").read_text())
    (root / "prep_vocab" / "prepared.json").write_text(json.dumps({**side, "vocab_size": 7}))
    tokens = root / "prep_ids" / "tokens.bin"
    tokens.write_bytes(b"\xff" * tokens.stat().st_size)  # ids past the vocabulary (the checksum now differs)
    trunc = root / "prep_trunc" / "tokens.bin"
    trunc.write_bytes(trunc.read_bytes()[:-3])


DATA_FLAG_VALUES = {
    "--tokenizer": st.sampled_from(["byte", "tok/garbage", "tok/none", "tok", "notes.txt", "nowhere", ""]),
    "--text-field": st.sampled_from(["text", "body", "missing", "", " "]),
    "--packing": st.sampled_from(["on", "off", "maybe"]),
    "--val-fraction": st.sampled_from(["0", "0.5", "0.99", "1", "-0.1", "x"]),
    "--val-data": st.sampled_from(DATA_PATHS), "--text-errors": st.sampled_from(["strict", "replace", "ignore"]),
    "--eval-every": st.sampled_from(["0", "1"]), "--seq": st.sampled_from(["8", "4096", "1"]),
    "--model": st.sampled_from(["gpt-tiny", "cnn"]),
}


@_settings(16)
@given(data=st.sampled_from(DATA_PATHS),
       extra=st.lists(st.sampled_from(sorted(DATA_FLAG_VALUES)), max_size=3, unique=True).flatmap(
           lambda names: st.tuples(*[st.tuples(st.just(n), DATA_FLAG_VALUES[n]).map(list) for n in names])))
def test_data_tokenizer_and_prepared_directories(data, extra):
    flat = [x for pair in extra for x in pair]
    args = ["train", *TINY, "--steps", "1", "--run-dir", "new", "--data", data, *flat]
    root = _workspace()
    try:
        _data_workspace(root)
        before = snapshot(root)
        r = cli(args, cwd=root)
        check_promise(r, root, before)
        check_one_line(r)
    finally:
        shutil.rmtree(root, ignore_errors=True)


FROM_KEYS = ["per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16", "gradient_checkpointing",
             "deepspeed", "distributed_type", "mixed_precision", "num_processes", "num_machines",
             "accumulate_grad_batches", "precision", "devices", "strategy", "trainer", "bogus"]
from_value = st.one_of(st.integers(-2, 9), st.booleans(), st.none(), st.sampled_from(
    ["bf16", "16-mixed", "MULTI_GPU", "FSDP", "ddp", "auto", "", "x" * 300]), st.lists(st.integers(0, 3), max_size=2))
ALIASES = ("a: &a [x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\n"
           "c: &c [*b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c]\nnum_processes: [*d, *d]\n")
"""YAML of nested aliases: 8,192 strings once expanded (under the reader's bound), echoed in a refusal."""


@_settings(12)
@given(values=st.dictionaries(st.sampled_from(FROM_KEYS), from_value, max_size=4),
       form=st.sampled_from(["json", "yaml", "yaml+aliases", "bytes", "deep"]), raw=st.binary(max_size=30))
def test_from_files(values, form, raw):
    def setup(root: Path):
        if form == "json":
            text = json.dumps(values).encode()
        elif form == "bytes":
            text = raw
        elif form == "deep":
            text = b"[" * 5000 + b"]" * 5000
        else:
            lines = "".join(f"{k}: {json.dumps(v)}\n" for k, v in values.items())
            text = ((ALIASES if form == "yaml+aliases" else "") + lines).encode()
        (root / "job.cfg").write_bytes(text)

    root = _workspace()
    try:
        setup(root)
        before = snapshot(root)
        r = cli(["memory", "--estimate", *TINY, "--from", "job.cfg"], cwd=root)
        check_promise(r, root, before)
        check_one_line(r)
        assert len(r.err) < 2000, r.err[:300]  # an echoed value is cut (a YAML alias bomb expands to megabytes)
    finally:
        shutil.rmtree(root, ignore_errors=True)
