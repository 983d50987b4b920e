import json

import pytest

MIB = 2**20


def fp16_rows() -> list[dict]:
    """An fp16 run as train writes it: overflow at steps 3 and 4 halves the scale twice; step 5 is
    written twice (a resume repeats the step after the last checkpoint: the last line counts)."""
    rows, scale = [], 65536.0
    for step in range(1, 11):
        skipped = step in (3, 4)
        rows.append({"step": step, "loss": float("nan") if step == 4 else 5.0 - 0.1 * step, "stepped": not skipped,
                     "loss_scale": scale, "count": 256, "step_s": 0.1})
        if skipped:
            scale /= 2
    rows.insert(4, {**rows[4], "loss": 99.0})  # the first (overwritten) attempt at step 5
    return rows


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in fp16_rows()) + '{"step": 11, "lo')
    memory = [
        {"precision": "fp32", "checkpointing": "none", "params_bytes": 12 * MIB, "grads_bytes": 12 * MIB,
         "optimizer_bytes": 24 * MIB, "activations_bytes": 30 * MIB, "temporaries_bytes": 5 * MIB,
         "peak_bytes": 70 * MIB, "peak_phase": "backward", "method": "measured", "dominant_part": "activations",
         "lever": "activation checkpointing (--checkpointing full)", "notes": []},
        {"precision": "bf16-true", "checkpointing": "full", "params_bytes": 6 * MIB, "grads_bytes": 6 * MIB,
         "optimizer_bytes": 36 * MIB, "activations_bytes": 4 * MIB, "temporaries_bytes": 3 * MIB,
         "peak_bytes": 50 * MIB, "peak_phase": "optimizer", "method": "measured",
         "notes": ["bf16-true: the fp32 master copy adds 12 MiB to optimizer state"]},
    ]
    (d / "memory.json").write_text(json.dumps(memory))
    profile = {"precision": "fp32", "bottleneck": "input",
               "breakdown": {"data_wait_s": {"median": 0.04}, "forward_s": {"median": 0.02},
                             "backward_s": {"median": 0.05}, "optimizer_s": {"median": 0.01}, "rest_s": {"median": 0.002}},
               "advice": [{"kind": "input", "text": "raise loader_workers from 0 to 2; data wait is 35% of the step"}]}
    (d / "profile.json").write_text(json.dumps(profile))
    plan = {"plans": [
        {"rank": 1, "strategy": "zero2", "precision": "bf16-mixed", "memory_GiB": 61.0,
         "reasons": ["fits 80 GiB with 19 GiB to spare", "zero2 halves gradient memory per rank"]},
        {"rank": 2, "strategy": "ddp", "precision": "bf16-mixed", "memory_GiB": 95.0,
         "reasons": ["does not fit: 95 GiB > 80 GiB"]}]}
    (d / "plan.json").write_text(json.dumps(plan))
    return d
