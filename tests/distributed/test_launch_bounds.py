"""Issue 35 row 11, the launch: every count that starts processes is capped by what this machine runs, node 0's
address is resolved once with a timeout, a node waiting for its peers says so and stops after ``--join-timeout``,
and a launch setting that would change nothing is refused. Each refusal: exit 2, one stderr line naming the field,
no file created, no process started (``launch.launch`` is replaced by a recorder: a call is a failure), in bounded
time and memory.

The limits are the tool's own (``gate.max_processes``, ``launch.MAX_NODES``), read here, not hard-coded; the
property tests draw counts above them and host names under ``.invalid`` (RFC 2606: never resolves)."""

from __future__ import annotations

import contextlib
import io
import os
import socket
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainfit import gate
from trainfit.cli import main
from trainfit.errors import ConfigError
from trainfit.strategies import launch

BASE = ["train", "--model-config", "n_layer=1,d_model=16,n_head=2", "--seq", "8", "--micro-batch", "2",
        "--accumulation", "1", "--steps", "1"]
JOB = [*BASE, "--strategy", "ddp"]
PEAK_BYTES = 64 * 2**20
"""The most Python memory one refusal may allocate (tracemalloc's peak)."""
SECONDS = 8.0
"""The longest one refusal may take on a loaded 2-core machine (idle: well under a second)."""


def _settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _refused(args: list[str]) -> tuple[str, float, int]:
    """``trainfit ARGS`` in this process, in a fresh directory, with ``launch.launch`` recording instead of
    launching: asserts exit 2, exactly one stderr line, no file created, nothing launched; returns that line, the
    seconds it took and tracemalloc's peak."""
    started = []
    with tempfile.TemporaryDirectory(prefix="tf-launch-") as d:
        root = Path(d)
        (root / "notes.txt").write_text("mine\n")
        before = _files(root)
        out, err = io.StringIO(), io.StringIO()
        with (mock.patch.object(launch, "launch", lambda *a, **k: started.append((a, k))),
              contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), contextlib.chdir(root)):
            tracemalloc.start()
            t0 = time.perf_counter()
            try:
                rc = main([*args, "--run-dir", "run"])
            except SystemExit as e:
                rc = e.code
            seconds = time.perf_counter() - t0
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        assert not started, f"processes were launched: {started}"
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("trainfit: error: "), (rc, err.getvalue())
        assert _files(root) == before and not out.getvalue()
        return lines[0], seconds, peak


def test_warm_up_imports():
    """The first refusal imports torch's launcher and the like: the property tests below time the ones after."""
    _refused([*JOB, "--devices", str(gate.max_processes() + 1)])


# -- counts that start processes -----------------------------------------------------------------------------------
def _count_flags(field: str, n: int) -> tuple[list[str], str]:
    if field == "devices":
        return ["--devices", str(n)], "devices="
    if field == "nproc":
        return ["--nproc", str(n)], "devices="
    if field == "nodes":
        return ["--devices", "1", "--nodes", str(n)], "nodes="
    return ["--devices", "2", "--loader-workers", str(n)], "loader_workers="


def _above_cap(field: str):
    if field == "nodes":
        return st.integers(launch.MAX_NODES + 1, 10**18)
    if field == "loader_workers":  # 2 workers x (1 + n) above the cap
        return st.integers(gate.max_processes() // 2, 10**18)
    return st.integers(gate.max_processes() + 1, 10**18)


@_settings(40)
@given(data=st.data(), field=st.sampled_from(["devices", "nproc", "nodes", "loader_workers"]))
def test_counts_above_what_this_machine_runs_are_refused_before_anything(data, field):
    n = data.draw(_above_cap(field), label="count")
    flags, named = _count_flags(field, n)
    line, seconds, peak = _refused([*JOB, *flags])
    assert named in line, line
    assert seconds < SECONDS and peak < PEAK_BYTES, (seconds, peak)


@pytest.mark.parametrize("fields, named", [
    ({"devices": 10**6}, "devices"),
    ({"devices": 2, "loader_workers": 10**4}, "loader_workers"),
    ({"nodes": 2**20, "devices": 1}, "nodes"),
])
def test_the_front_door_refuses_the_same_counts(tmp_path, fields, named):
    from trainfit.front.train import train

    with mock.patch.object(launch, "launch", side_effect=AssertionError("launched")):
        with pytest.raises(ConfigError) as e:
            train(model_config="n_layer=1,d_model=16,n_head=2", seq_len=8, micro_batch=2, strategy="ddp", steps=1,
                  run_dir=str(tmp_path / "run"), **fields)
    assert e.value.field == named and not (tmp_path / "run").exists()


def test_the_launchers_themselves_refuse_more_processes_than_this_machine_runs(tmp_path):
    """The backstop below the front door: torch's launcher and spawn_local are never asked for more."""
    too_many = gate.max_processes() + 1
    with pytest.raises(ConfigError, match="devices="):
        launch.launch(too_many, ["train"])
    with pytest.raises(ConfigError, match="world_size="):
        launch.spawn_local(print, tmp_path, world_size=too_many)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("flag, text, named", [
    ("--devices", "\u0663", "devices="), ("--nproc", "1_0", "devices="), ("--nodes", "\u00b2", "nodes="),
    ("--node-rank", "1e0", "node_rank="), ("--master-port", "0x10", "master_port="),
    ("--join-timeout", "9" * 5000, "join_timeout_s="), ("--max-restarts", "+-1", "max_restarts="),
])
def test_launch_integers_are_read_by_the_one_parser(flag, text, named):
    """``int()`` takes ``"\u0663"`` (Arabic-Indic 3) and ``"1_0"``: the launch options go through gate.parse_int."""
    nodes = [] if flag in ("--devices", "--nproc", "--nodes") else ["--nodes", "2"]
    devices = [] if flag in ("--devices", "--nproc") else ["--devices", "2"]
    line, _, _ = _refused([*JOB, *devices, *nodes, flag, text])
    assert named in line and len(line) < 1200, line


# -- node 0's address ------------------------------------------------------------------------------------------------
LABEL = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True)
INVALID_HOST = st.lists(LABEL, min_size=1, max_size=3).map(lambda labels: ".".join([*labels, "invalid"]))


@_settings(25)
@given(host=INVALID_HOST, port=st.integers(1024, 65535))
def test_an_address_that_does_not_resolve_is_refused_within_the_timeout(host, port):
    line, seconds, peak = _refused([*JOB, "--devices", "1", "--nodes", "2", "--master-addr", host,
                                    "--master-port", str(port)])
    assert "master_addr=" in line and host in line and "does not resolve" in line, line
    assert seconds < launch.RESOLVE_TIMEOUT_S + SECONDS and peak < PEAK_BYTES, (seconds, peak)


def test_a_resolver_that_never_answers_is_refused_after_the_timeout():
    def hang(*args, **kwargs):
        time.sleep(30)

    t0 = time.perf_counter()
    with mock.patch.object(socket, "getaddrinfo", hang), pytest.raises(ConfigError, match="did not answer"):
        launch.resolve_host("master_addr", "slow.example", port=29500, timeout_s=0.5)
    assert time.perf_counter() - t0 < 3


def test_a_name_that_resolves_gives_its_address():
    assert launch.resolve_host("master_addr", "localhost", port=29500) in ("127.0.0.1", "::1")
    assert launch.resolve_host("master_addr", "127.0.0.1", port=29500) == "127.0.0.1"


# -- settings that change nothing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, named", [
    (["--strategy", "ddp", "--devices", "2", "--master-addr", "10.0.0.1"], "master"),
    (["--strategy", "ddp", "--devices", "2", "--master-port", "29511"], "master"),
    (["--strategy", "single", "--devices", "1", "--max-restarts", "2"], "max_restarts="),
    (["--strategy", "ddp", "--devices", "2", "--nodes", "1", "--join-timeout", "30"], "join"),
])
def test_launch_settings_on_one_node_that_change_nothing_are_refused(flags, named):
    line, _, _ = _refused([*BASE, *flags])
    assert named in line, line


@pytest.mark.parametrize("fields, named", [
    ({"master_addr": "10.0.0.1"}, "master_addr"),
    ({"master_port": 29511}, "master_port"),
    ({"join_timeout_s": 30.0}, "join_timeout_s"),
    ({"max_restarts": 1, "devices": 1, "strategy": "single"}, "max_restarts"),
    ({"nodes": 2, "join_timeout_s": 0.0}, "join_timeout_s"),
    ({"nodes": 2, "join_timeout_s": 10**9}, "join_timeout_s"),
    ({"nodes": 2, "master_addr": " "}, "master_addr"),
])
def test_the_front_door_refuses_them_too(tmp_path, fields, named):
    from trainfit.front.train import train

    with mock.patch.object(launch, "launch", side_effect=AssertionError("launched")), \
            pytest.raises(ConfigError) as e:
        train(model_config="n_layer=1,d_model=16,n_head=2", seq_len=8, micro_batch=2, steps=1,
              run_dir=str(tmp_path / "run"), **{"devices": 2, "strategy": "ddp", **fields})
    assert e.value.field == named and not (tmp_path / "run").exists()


def test_under_torchrun_trainfits_own_node_settings_are_refused(tmp_path, monkeypatch):
    """torchrun placed the process (its --nnodes, --node-rank): trainfit's own would be ignored."""
    from trainfit.front.train import train

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    for fields, named in (({"nodes": 2}, "nodes"), ({"max_restarts": 3}, "max_restarts")):
        with pytest.raises(ConfigError) as e:
            train(model_config="n_layer=1,d_model=16,n_head=2", seq_len=8, micro_batch=2, steps=1,
                  run_dir=str(tmp_path / "run"), **fields)
        assert e.value.field == named and not (tmp_path / "run").exists()


# -- a node waiting for its peers (real processes) -------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainfit(tmp_path: Path, *flags: str, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "trainfit", *JOB, *flags, "--run-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    return p, time.perf_counter() - t0


@pytest.mark.cli
@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_a_lone_node_says_it_waits_then_stops_in_one_line_and_leaves_nothing(tmp_path, rank):
    """Node 1 without node 0 (nothing listens), node 0 without node 1 (nobody joins): each says once what it
    waits for, stops after --join-timeout, in one line, exit 2; node 0 removes the run directory it created."""
    port, timeout_s = _free_port(), 3
    p, seconds = _trainfit(tmp_path, "--devices", "1", "--nodes", "2", "--node-rank", str(rank),
                           "--master-addr", "127.0.0.1", "--master-port", str(port),
                           "--join-timeout", str(timeout_s), timeout=120)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    waits = [ln for ln in lines if "waiting up to 3 s" in ln]
    assert p.returncode == 2 and len(lines) == 2 and len(waits) == 1, p.stderr[-3000:]
    assert f"127.0.0.1:{port}" in waits[0] and ("node 0 to listen" if rank else "other 1 node to join") in waits[0]
    assert lines[1].startswith("trainfit: error: ") and f"node {rank}" in lines[1], lines[1]
    assert timeout_s <= seconds < timeout_s + 60
    assert _files(tmp_path) == [], _files(tmp_path)


@pytest.mark.cli
@pytest.mark.slow
def test_an_unresolvable_master_addr_is_one_line_in_a_real_process(tmp_path):
    """No c10d retry lines, no run directory: refused before torch's launcher is asked."""
    p, seconds = _trainfit(tmp_path, "--devices", "1", "--nodes", "2", "--master-addr", "node0.trainfit.invalid",
                           timeout=120)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "master_addr='node0.trainfit.invalid'" in lines[0], p.stderr
    assert seconds < launch.RESOLVE_TIMEOUT_S + 60 and _files(tmp_path) == []
