"""A run knows its data (issue 27, rows 1 and 10): a resume with other data is refused before anything is written.

The property: for each field of the data's identity (:data:`trainfit.tasks.identity.FIELDS`), resuming a run with
that field changed exits 2 with one stderr line naming the field, and every file of the run directory is
byte-identical afterwards. One tiny run is trained once per module; each case resumes a copy of it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
from pathlib import Path

import pytest

from trainfit.cli import main
from trainfit.tasks.files import clear_cache

BASE = """model = "gpt-tiny"
model_config = "n_layer=1,d_model=16,n_head=2"
seq_len = 8
micro_batch = 2
accumulation = 1
steps = 2
lr = 0.01
val_fraction = 0.25
"""


def cli(*args: str) -> tuple[int, str]:
    """``trainfit train ARGS`` in this process: (exit status, stderr)."""
    clear_cache()  # a fresh process's data cache
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            rc = main(["train", *args])
        except SystemExit as e:
            rc = e.code
    return int(rc or 0), err.getvalue()


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t, "body": t.upper()[::-1]}) + "\n" for t in texts))
    return path


DOCS = [f"document {i}: the quick brown fox jumps over the lazy dog {i} times." for i in range(8)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, bpe_dir) -> dict:
    """One trained run (.pt checkpoint) on data.jsonl with a 25% validation split, and the inputs to vary."""
    root = tmp_path_factory.mktemp("identity")
    files = {"root": root, "toml": root / "base.toml", "run": root / "run", "bpe": bpe_dir,
             "data": write_jsonl(root / "data.jsonl", DOCS),
             "other": write_jsonl(root / "other.jsonl", [d.replace("fox", "cat") for d in DOCS]),
             "val": write_jsonl(root / "val.jsonl", DOCS[:3])}
    files["toml"].write_text(BASE + f'data = "{files["data"]}"\n')
    rc, err = cli(str(files["toml"]), "--run-dir", str(files["run"]))
    assert rc == 0, err
    return files


CHANGES = {
    "data": lambda f: ["--data", str(f["other"])],
    "val_data": lambda f: ["--val-fraction", "0", "--val-data", str(f["val"])],
    "tokenizer": lambda f: ["--tokenizer", str(f["bpe"])],
    "packing": lambda f: ["--packing", "off"],
    "text_field": lambda f: ["--text-field", "body"],
    "seq_len": lambda f: ["--seq-len", "12"],
    "val_fraction": lambda f: ["--val-fraction", "0.5"],
}


def test_every_identity_field_is_covered():
    from trainfit.tasks.identity import FIELDS  # (imported here: the module is new, the other tests run without it)

    assert set(CHANGES) == set(FIELDS)


def resume_refused(run: Path, args: list[str], field: str) -> str:
    """Resume ``run`` with ``args``: exit 2, one stderr line naming ``field``, the run directory unchanged."""
    before = snapshot(run)
    rc, err = cli(*args, "--run-dir", str(run), "--resume", "--steps", "3")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("trainfit: error: checkpoint ") and f"with {field}=" in lines[0], lines[0]
    assert snapshot(run) == before
    return lines[0]


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_resume_with_a_field_changed_is_refused_and_changes_nothing(trained, field, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    resume_refused(run, [str(trained["toml"]), *CHANGES[field](trained)], field)


def test_resume_with_the_same_data_continues(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    rc, err = cli(str(trained["toml"]), "--run-dir", str(run), "--resume", "--steps", "3")
    assert rc == 0, err
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_row1_resume_with_another_file_format_is_refused(trained, tmp_path):
    """Row 1: the run trained on a .jsonl; a .txt of the same text resumed on it was accepted and rewrote the run."""
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    text = tmp_path / "data.txt"
    text.write_text("\n".join(DOCS))
    line = resume_refused(run, [str(trained["toml"]), "--data", str(text)], "data")
    assert str(trained["data"]) in line and str(text) in line


def test_row1_data_changed_in_place_is_refused(tmp_path):
    """Row 1: the same path holding other content (a corpus regenerated in place) is other data."""
    data = write_jsonl(tmp_path / "data.jsonl", DOCS)
    toml = tmp_path / "base.toml"
    toml.write_text(BASE + f'data = "{data}"\n')
    rc, err = cli(str(toml), "--run-dir", str(tmp_path / "run"))
    assert rc == 0, err
    size = data.stat().st_size
    write_jsonl(data, [d.replace("dog", "owl") for d in DOCS])  # same size, other bytes
    assert data.stat().st_size == size
    line = resume_refused(tmp_path / "run", [str(toml)], "data")
    assert "fingerprint" in line


def test_row1_a_prepared_directory_prepared_again_from_other_text_is_refused(tmp_path):
    """Row 1 for a prepared directory: its identity is the sidecar's checksums, so the same directory
    re-prepared from other text is other data."""
    data, prep = write_jsonl(tmp_path / "data.jsonl", DOCS), tmp_path / "prep"
    assert cli_prepare("--data", str(data), "--out", str(prep)) == 0
    toml = tmp_path / "base.toml"
    toml.write_text(BASE.replace("val_fraction = 0.25\n", "") + f'data = "{prep}"\n')
    run = tmp_path / "run"
    assert cli(str(toml), "--run-dir", str(run))[0] == 0
    write_jsonl(data, [d.replace("dog", "owl") for d in DOCS])
    assert cli_prepare("--data", str(data), "--out", str(prep), "--force") == 0
    assert "a prepared directory" in resume_refused(run, [str(toml)], "data")


def cli_prepare(*args: str) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(["prepare", *args])


def test_row10_resume_with_another_tokenizer_names_the_tokenizer(trained, tmp_path):
    """Row 10: another tokenizer ended at "Error(s) in loading state_dict", naming nothing."""
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    line = resume_refused(run, [str(trained["toml"]), "--tokenizer", str(trained["bpe"])], "tokenizer")
    assert "state_dict" not in line and "'byte'" in line and "tokenizer.json sha256" in line


def test_row10_a_checkpoint_without_identity_names_the_tensor_that_does_not_fit(trained, tmp_path):
    """Row 10, for a checkpoint written before the identity was recorded: the load error names the tensor and
    both shapes, not only torch's header line "Error(s) in loading state_dict for GPT:"."""
    from trainfit.checkpoint import list_checkpoints, read_checkpoint, save_checkpoint

    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    path = list_checkpoints(run)[-1]
    state = read_checkpoint(path)
    state["config"].pop("data_identity", None)
    del state["format"]
    save_checkpoint(run, state["step"], state)  # as an older trainfit wrote it (re-checksummed)
    rc, err = cli(str(trained["toml"]), "--tokenizer", str(trained["bpe"]), "--run-dir", str(run), "--resume",
                  "--steps", "3")
    assert rc == 2 and "size mismatch for" in err.strip().splitlines()[-1] and "[257, 16]" in err, err


@pytest.mark.distributed
def test_sharded_checkpoint_resume_is_refused_under_two_ranks_and_in_one_process(trained, tmp_path):
    """The same rule for sharded (DCP) checkpoints: a 2-rank ddp run, resumed with other data under
    ``--devices 2`` (refused once by the launcher, before launch.toml or a worker) and with another tokenizer
    in one process."""
    run = tmp_path / "run"
    two_ranks = [str(trained["toml"]), "--run-dir", str(run), "--devices", "2", "--strategy", "ddp"]
    rc, err = cli(*two_ranks)  # (in this process: the launcher starts the two ranks either way)
    assert rc == 0, err
    assert list((run / "checkpoints").glob("step-*.dcp"))
    resumed = [a for a in two_ranks if a not in ("--run-dir", str(run))]  # resume_refused names --run-dir itself
    line = resume_refused(run, [*resumed, "--data", str(trained["other"])], "data")
    assert ".dcp" in line
    resume_refused(run, [str(trained["toml"]), "--tokenizer", str(trained["bpe"])], "tokenizer")
