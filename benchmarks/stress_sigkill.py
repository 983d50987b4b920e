"""SIGKILL stress: kill ``trainfit train --checkpoint-every 1`` at random moments, resume, compare.

Each trial starts the tiny GPT job in a fresh run directory, SIGKILLs it at a moment drawn
uniformly over the reference run's wall time (startup included), checks what is on disk,
and repeats that 1-2 times before letting the job finish (``--resume`` when a complete
checkpoint exists, a fresh start otherwise -- what a user or a restart loop would do).
The final checkpoint must equal an uninterrupted run's bitwise.

Per kill it records: the newest complete checkpoint verifies (no fallback needed), how
many steps were redone (work lost), whether the kill landed inside a checkpoint write
(a temporary file or a ``.pt`` without its sidecar on disk).

"Bytes lost" = bytes of complete checkpoints that no longer verify after a kill, plus
bytes of the final state (model, optimizer, scaler, RNG) that differ from the reference.
It must be zero.

Usage::

    python benchmarks/stress_sigkill.py --trials 24 --steps 200      # writes benchmarks/results/
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model-config", "n_layer=1,d_model=32,n_head=2", "--seq", "16", "--micro-batch", "2", "--accumulation", "2"]
STATE_KEYS = ("step", "model", "optimizer", "precision", "rng", "data")


def _argv(run_dir: Path, steps: int, resume: bool, extra: list[str]) -> list[str]:
    given = {a for a in extra if a.startswith("--")}  # each flag once (trainfit refuses a repeat): extra wins
    tiny = [x for i, x in enumerate(TINY) if not ({x, TINY[i - 1] if i else ""} & given)]
    argv = ["train", *tiny, *extra, "--steps", str(steps), "--checkpoint-every", "1", "--run-dir", str(run_dir)]
    return argv + (["--resume"] if resume else [])


class _Forked:
    """A job forked from a server that has trainfit imported (no interpreter start-up per run).

    ``subprocess`` runs ``python -m trainfit train`` (the real thing, ~2 s of imports each);
    ``forkserver`` runs the same ``trainfit.cli.main`` in a child forked from a preloaded
    server -- used by the CI test to keep its budget. Both die by SIGKILL the same way.
    """

    def __init__(self, argv: list[str]) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["trainfit.cli", "trainfit.train", "trainfit.commands.train"])
        self.proc = ctx.Process(target=_child_main, args=(argv,), daemon=False)
        self.proc.start()
        self.pid = self.proc.pid
        self.stderr = io.StringIO()

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired("forked trainfit", timeout)
        return self.proc.exitcode

    def poll(self) -> int | None:
        return self.proc.exitcode

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return "", ""

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode


def _child_main(argv: list[str]) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    import torch

    torch.set_num_threads(1)  # a tiny model: extra threads only spin on a loaded machine
    from trainfit.cli import main

    sys.exit(main(argv))


def _launch(run_dir: Path, steps: int, extra: list[str], launcher: str = "subprocess"):
    from trainfit.checkpoint import list_checkpoints

    argv = _argv(run_dir, steps, bool(list_checkpoints(run_dir)), extra)
    if launcher == "forkserver":
        return _Forked(argv)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # a tiny model: extra threads only spin on a loaded machine
    return subprocess.Popen([sys.executable, "-m", "trainfit", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)


def _kill(p) -> None:
    if isinstance(p, subprocess.Popen):
        os.killpg(p.pid, signal.SIGKILL)  # the whole session: no child may outlive it
    else:
        p.kill()
    p.wait()


def _finish(p: subprocess.Popen, timeout: float) -> None:
    _, err = p.communicate(timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"run failed with exit {p.returncode}: {err.strip().splitlines()[-1:]}")


def _diff_bytes(a, b) -> int:
    """Bytes of tensor data that differ between two nested states (bitwise)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return max(a.nbytes, b.nbytes)
        x = a.detach().contiguous().reshape(-1).view(torch.uint8)
        y = b.detach().contiguous().reshape(-1).view(torch.uint8)
        return int((x != y).sum())
    if isinstance(a, dict) and isinstance(b, dict):
        extra = sum(_size(a[k]) for k in a.keys() - b.keys()) + sum(_size(b[k]) for k in b.keys() - a.keys())
        return extra + sum(_diff_bytes(a[k], b[k]) for k in a.keys() & b.keys())
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return sum(_diff_bytes(x, y) for x, y in zip(a, b))
    return 0 if a == b else max(_size(a), _size(b), 1)


def _size(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.nbytes
    if isinstance(x, dict):
        return sum(_size(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(_size(v) for v in x)
    return 8


def _final_state(run_dir: Path) -> dict:
    from trainfit.checkpoint import load_latest

    found = load_latest(run_dir)
    assert found is not None, f"no checkpoint in {run_dir}"
    return {k: found[1][k] for k in STATE_KEYS}


def _inspect_after_kill(run_dir: Path) -> dict:
    """What a SIGKILL left behind: does the newest complete checkpoint verify by itself?"""
    from trainfit.checkpoint import CheckpointError, checkpoint_dir, list_checkpoints, read_checkpoint

    d = checkpoint_dir(run_dir)
    complete = list_checkpoints(run_dir)
    names = [p.name for p in d.iterdir()] if d.is_dir() else []
    mid_write = any(".tmp-" in n for n in names) or any(
        n.endswith(".pt") and f"{n[:-3]}.json" not in names for n in names)
    out = {"complete": len(complete), "newest_step": None, "newest_ok": None, "bytes_lost": 0, "mid_write": mid_write,
           "metrics_step": 0}
    if complete:
        newest = complete[-1]
        out["newest_step"] = int(newest.stem.split("-")[1])
        try:
            read_checkpoint(newest)
            out["newest_ok"] = True
        except CheckpointError:
            out["newest_ok"] = False
            out["bytes_lost"] = json.loads(newest.with_suffix(".json").read_text()).get("bytes", newest.stat().st_size)
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                out["metrics_step"] = max(out["metrics_step"], json.loads(line)["step"])
            except (ValueError, KeyError):
                pass  # a line cut by the kill
    return out


def _wait_first_step(p: subprocess.Popen, metrics: Path, size_before: int, timeout: float) -> float:
    """Seconds until the run logs its first step (its metrics file grows), or until it exits."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout and p.poll() is None:
        if metrics.is_file() and metrics.stat().st_size > size_before:
            break
        time.sleep(0.005)
    return time.perf_counter() - t0


def reference(workdir: Path, steps: int, extra: list[str], launcher: str) -> tuple[dict, float, float]:
    """The uninterrupted run: final state, total wall time, wall time after its first step."""
    run_dir = workdir / "reference"
    if launcher == "forkserver":  # the first job of a fresh server is slower: keep it out of the timing
        _finish(_launch(workdir / "warm-up", 2, extra, launcher), timeout=600)
    t0 = time.perf_counter()
    p = _launch(run_dir, steps, extra, launcher)
    startup = _wait_first_step(p, run_dir / "metrics.jsonl", 0, timeout=600)
    _finish(p, timeout=600)
    wall = time.perf_counter() - t0
    return _final_state(run_dir), wall, max(wall - startup, 0.05)


def trial(i: int, rng: random.Random, workdir: Path, steps: int, ref: dict, ref_wall_s: float, ref_train_s: float,
          extra: list[str], phases: tuple[str, ...] = ("any", "training"), kill_counts: tuple[int, ...] = (1, 2),
          launcher: str = "subprocess") -> dict:
    """Kill the job 1-2 times, then let it finish; compare with the reference.

    A kill moment is drawn uniformly over the whole run ("any": startup and imports
    included) or over its training phase ("training": after the first logged step).
    """
    run_dir = workdir / f"trial-{i:03d}"
    metrics = run_dir / "metrics.jsonl"
    kills = []
    resumed = 0  # launches that continued from a checkpoint (--resume)
    from trainfit.checkpoint import list_checkpoints

    for _ in range(rng.choice(kill_counts)):
        phase = rng.choice(phases)
        before = metrics.stat().st_size if metrics.is_file() else 0
        resumed += bool(list_checkpoints(run_dir))
        p = _launch(run_dir, steps, extra, launcher)
        if phase == "training":
            _wait_first_step(p, metrics, before, timeout=600)
            delay = rng.uniform(0.0, ref_train_s)
        else:
            delay = rng.uniform(0.0, ref_wall_s)
        try:
            p.wait(timeout=delay)
            finished_first = True
        except subprocess.TimeoutExpired:
            finished_first = False
            _kill(p)
        p.stderr.close()
        if finished_first:
            break
        info = _inspect_after_kill(run_dir)
        info.update(phase=phase, delay_s=round(delay, 3))
        kills.append(info)
    while not list_checkpoints(run_dir) or int(list_checkpoints(run_dir)[-1].stem.split("-")[1]) < steps:
        resumed += bool(list_checkpoints(run_dir))
        _finish(_launch(run_dir, steps, extra, launcher), timeout=600)
    final = _final_state(run_dir)
    diff = _diff_bytes(final, ref)
    leftovers = [n.name for n in (run_dir / "checkpoints").iterdir() if ".tmp-" in n.name]
    try:  # the log after kills and resumes: each step once, in order, no line cut by a kill
        logged = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    except (ValueError, KeyError):
        logged = None
    return {"trial": i, "kills": kills, "resumed_runs": resumed, "final_diff_bytes": diff,
            "bytes_lost": diff + sum(k["bytes_lost"] for k in kills), "tmp_leftovers": len(leftovers),
            "metrics_log_exact": logged == list(range(1, steps + 1))}


def summarize(results: list[dict], *, steps: int, ref_wall_s: float, seed: int) -> dict:
    kills = [k for r in results for k in r["kills"]]
    with_ckpt = [k for k in kills if k["complete"]]
    return {
        "trials": len(results),
        "steps_per_run": steps,
        "seed": seed,
        "reference_wall_s": round(ref_wall_s, 2),
        "faults_injected": len(kills),
        "kills_during_training": sum(k["phase"] == "training" for k in kills),
        "kills_mid_checkpoint_write": sum(k["mid_write"] for k in kills),
        "kills_before_first_checkpoint": sum(not k["complete"] for k in kills),
        "newest_checkpoint_verified": sum(bool(k["newest_ok"]) for k in with_ckpt),
        "newest_checkpoint_checked": len(with_ckpt),
        "runs_resumed": sum(r["resumed_runs"] for r in results),
        "max_steps_redone": max((k["metrics_step"] - (k["newest_step"] or 0) for k in kills), default=0),
        "final_state_bitwise_equal": sum(r["final_diff_bytes"] == 0 for r in results),
        "bytes_lost": sum(r["bytes_lost"] for r in results),
        "tmp_files_left": sum(r["tmp_leftovers"] for r in results),
        "metrics_log_exact": sum(r["metrics_log_exact"] for r in results),
    }


def run(trials: int, steps: int, seed: int, workdir: Path, extra: list[str] | None = None, **kw) -> tuple[dict, list]:
    extra = extra or []
    ref, ref_wall, ref_train = reference(workdir, steps, extra, kw.get("launcher", "subprocess"))
    rng = random.Random(seed)
    results = [trial(i, rng, workdir, steps, ref, ref_wall, ref_train, extra, **kw) for i in range(trials)]
    return summarize(results, steps=steps, ref_wall_s=ref_wall, seed=seed), results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--dropout", type=float, default=0.1, help="> 0 makes the resumed RNG stream matter")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="trainfit-sigkill-") as tmp:
        t0 = time.perf_counter()
        summary, results = run(a.trials, a.steps, a.seed, Path(tmp), ["--precision", a.precision, "--model-config",
                                                               f"n_layer=1,d_model=32,n_head=2,dropout={a.dropout}"])
        summary["precision"] = a.precision
        summary["dropout"] = a.dropout
        summary["wall_s"] = round(time.perf_counter() - t0, 1)
    summary["command"] = " ".join(["python", "benchmarks/stress_sigkill.py", *sys.argv[1:]])
    a.out.mkdir(parents=True, exist_ok=True)
    name = f"stress_sigkill_{a.precision}"
    (a.out / f"{name}.json").write_text(json.dumps({"summary": summary, "trials": results}, indent=1) + "\n")
    rows = "\n".join(f"| {k} | {v} |" for k, v in summary.items())
    (a.out / f"{name}.md").write_text(f"# SIGKILL stress ({a.precision})\n\n| measure | value |\n|---|---|\n{rows}\n")
    print(json.dumps(summary, indent=1))
    ok = summary["bytes_lost"] == 0 and summary["final_state_bitwise_equal"] == summary["trials"] == \
        summary["metrics_log_exact"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
