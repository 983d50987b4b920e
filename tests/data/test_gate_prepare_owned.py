"""Issue 35, row 2: prepare deletes only what it made and marked; SIGTERM and SIGINT both clean up.

Before, ``prepare --out prep/mine`` deleted any ``prep/mine.tmp-<digits>`` whose number was not a running pid (the
user's ``mine.tmp-2024/notes.txt`` with it). Now a temporary directory holds a marker (pid, process start time,
boot id) and a later prepare removes one only when that marker is valid, its process has ended (a reused pid is
told apart by its start time) and it holds nothing prepare does not write. The property test draws names beside
``--out`` and their contents and checks that every one of them is left byte for byte.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.data.conftest import STDLIB_JSON
from tests.data.test_prepare_bounded import _as_from_a_shell, _document
from tests.reliability.cli_harness import cli

from trainfit.tasks.prepared import open_prepared

MARKER = ".trainfit-prepare"
DOC = STDLIB_JSON / "__init__.py"


def tree(root: Path) -> dict[str, str]:
    """Every file (its bytes, hex) and directory (``"dir"``) under ``root``: what "untouched" compares."""
    return {str(p.relative_to(root)): ("dir" if p.is_dir() else p.read_bytes().hex())
            for p in sorted(root.rglob("*"))}


def own_start() -> int:
    """This process's start time from /proc, read here independently of trainfit."""
    return int(Path(f"/proc/{os.getpid()}/stat").read_text().rpartition(")")[2].split()[19])


_FILE = st.from_regex(r"[a-z][a-z0-9_.]{0,8}", fullmatch=True)
_MARKERS = st.one_of(
    st.none(),
    st.binary(max_size=64),  # junk in the marker's place
    st.just(b'{"format": "trainfit-prepare-temporary"}'),  # the format alone, no owner
    st.builds(lambda: json.dumps({"format": "trainfit-prepare-temporary", "pid": os.getpid(), "start": own_start(),
                                  "boot": Path("/proc/sys/kernel/random/boot_id").read_text().strip()}).encode()),
)
"""What a directory beside --out may hold in the marker's place: nothing, junk, or a valid marker of a process
that still runs (this one): never a reason to remove it."""


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(names=st.lists(st.one_of(st.from_regex(r"out\.tmp-[0-9]{1,9}(-[0-9]{1,3})?", fullmatch=True),
                                st.just(f"out.tmp-{os.getpid()}"), st.just("out.tmp-2024"), st.just("out.tmp-")),
                      min_size=1, max_size=4, unique=True),
       files=st.dictionaries(_FILE, st.binary(max_size=256), max_size=3), marker=_MARKERS,
       as_file=st.booleans())
def test_names_beside_out_are_never_touched(names, files, marker, as_file):
    with tempfile.TemporaryDirectory() as root:
        root = Path(root)
        for i, name in enumerate(names):
            if as_file and i == 0:
                (root / name).write_bytes(b"a file named like a temporary directory")
                continue
            d = root / name
            d.mkdir()
            for rel, data in files.items():
                (d / rel).write_bytes(data)
            if marker is not None:
                (d / MARKER).write_bytes(marker)
        before = tree(root)
        r = cli(["prepare", "--data", str(DOC), "--out", str(root / "out")], traced=True)
        took = r.seconds
        assert r.rc == 0 and "removed" not in r.err, r.err
        after = tree(root)
        assert {k: v for k, v in after.items() if k != "out" and not k.startswith("out/")} == before
        assert sorted(p.name for p in (root / "out").iterdir()) == ["documents.bin", "prepared.json", "tokens.bin"]
        assert took < 10, took
        assert r.peak_bytes < 256 * 2**20, r.peak_bytes  # a small prepare, bounded whatever lies beside --out


def _prepare(*args: str, doc: Path, out: Path, tokenizer: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainfit", "prepare", "--data", str(doc), "--tokenizer",
                             str(tokenizer), "--out", str(out), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_as_from_a_shell)


def _signalled_while_writing(p: subprocess.Popen, tmp: Path, sig: int) -> tuple[int, str]:
    """Send ``sig`` to ``p`` once it is writing tokens into ``tmp``: (exit status, stderr)."""
    try:
        deadline = time.monotonic() + 60
        while not (tmp / "tokens.bin").is_file():
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1] if p.poll() else ""
            time.sleep(0.05)
        time.sleep(0.3)
        assert p.poll() is None
        p.send_signal(sig)
        rc = p.wait(timeout=30)
        return rc, p.communicate()[1]
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()


def test_sigterm_and_sigint_clean_up_and_answer_in_one_line(tmp_path, bpe_dir):
    doc = _document(tmp_path / "doc.txt", 8 * 10**6)
    for sig, said in ((signal.SIGTERM, "terminated (SIGTERM)"), (signal.SIGINT, "interrupted")):
        p = _prepare(doc=doc, out=tmp_path / "out", tokenizer=bpe_dir)
        rc, err = _signalled_while_writing(p, tmp_path / f"out.tmp-{p.pid}", sig)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("trainfit: error: ") and said in lines[0], err
        assert sorted(q.name for q in tmp_path.iterdir()) == ["doc.txt"]  # no out, no out.tmp-<pid>


def test_a_killed_prepares_marked_directory_is_removed_by_the_next_and_nothing_else(tmp_path, bpe_dir):
    (tmp_path / "data").mkdir()
    p = _prepare(doc=_document(tmp_path / "data" / "doc.txt", 4 * 10**6), out=tmp_path / "out", tokenizer=bpe_dir)
    killed = tmp_path / f"out.tmp-{p.pid}"
    _signalled_while_writing(p, killed, signal.SIGKILL)
    assert (killed / MARKER).is_file()  # left behind by SIGKILL, marked
    marker = json.loads((killed / MARKER).read_text())

    def copy(name: str, **changes) -> Path:
        d = tmp_path / name
        d.mkdir()
        for f in killed.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        (d / MARKER).write_text(json.dumps({**marker, **changes}))
        return d

    reused = copy("out.tmp-1", pid=os.getpid())  # this pid runs, but it is another process (other start time)
    live = copy("out.tmp-2", pid=os.getpid(), start=own_start())  # a running prepare's: kept
    extra = copy("out.tmp-3")
    (extra / "notes.txt").write_text("mine")  # holds something prepare never writes: kept
    unmarked = copy("out.tmp-4")
    (unmarked / MARKER).unlink()
    kept = {d.name: tree(d) for d in (live, extra, unmarked)}
    r = cli(["prepare", "--data", str(DOC), "--out", str(tmp_path / "out")])
    assert r.rc == 0, r.err
    assert not killed.exists() and not reused.exists()
    assert {d.name: tree(d) for d in (live, extra, unmarked)} == kept
    said = [ln for ln in r.err.splitlines() if ln.startswith("trainfit: removed")]
    assert len(said) == 1 and killed.name in said[0] and reused.name in said[0], r.err
    assert open_prepared(tmp_path / "out")[1]["n_documents"] == 1


def test_the_line_naming_removed_directories_is_cut(tmp_path):
    """Thirty killed prepares' directories: one line, eight names, then how many more."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    marker = json.dumps({"format": "trainfit-prepare-temporary", "pid": int(dead.stdout), "start": 1, "boot": ""})
    for i in range(30):
        (tmp_path / f"out.tmp-{i}").mkdir()
        (tmp_path / f"out.tmp-{i}" / MARKER).write_text(marker)
    r = cli(["prepare", "--data", str(DOC), "--out", str(tmp_path / "out")])
    said = [ln for ln in r.err.splitlines() if ln.startswith("trainfit: removed")]
    assert r.rc == 0 and len(said) == 1 and "(22 more)" in said[0] and len(said[0]) < 400, r.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
