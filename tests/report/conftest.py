import json

import pytest

MIB = 2**20
GIB = 2**30


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


# The stored JSON of each command, as `trainfit <command> --report` writes it (the keys of --json).

def memory_doc(*, precision: str, checkpointing: str, parts: dict[str, int], peak_phase: str,
               peak_parts: dict[str, int], master: int = 0, notes: tuple[str, ...] = ()) -> dict:
    peak = sum(peak_parts.values())
    dominant = max(peak_parts, key=peak_parts.get)
    levers = {"activations": "activation checkpointing (--checkpointing full) or a smaller micro-batch with "
                             "accumulation",
              "optimizer": "shard optimizer state (--strategy zero1/zero2/zero3) or use a stateless optimizer (sgd)"}
    return {
        "method": "measured", "model": "gpt-tiny", "precision": precision, "checkpointing": checkpointing,
        "optimizer": "adamw", "batch": 8, "seq_len": 64, "accumulation": 1, "n_params": 12 * MIB // 4,
        **{f"{k}_bytes": v for k, v in parts.items()}, "master_weights_bytes": master,
        "peak_bytes": peak, "peak_phase": peak_phase, "peak_parts": peak_parts,
        "phases": {"forward": {"peak": peak - 1 * MIB, **peak_parts},
                   "backward": {"peak": peak if peak_phase == "backward" else peak - 2 * MIB, **peak_parts},
                   "optimizer": {"peak": peak if peak_phase == "optimizer" else peak - 3 * MIB, **peak_parts}},
        "top_modules": [{"module": "blocks.*.mlp", "activations_bytes": parts["activations"] // 2},
                        {"module": "blocks.*.attn", "activations_bytes": parts["activations"] // 3}],
        "notes": list(notes), "device_max_allocated_bytes": None, "device_max_reserved_bytes": None,
        "wall_s": 1.5, "details": {}, "dominant_part": dominant, "lever": levers[dominant],
    }


MEMORY = [
    memory_doc(precision="fp32", checkpointing="none", peak_phase="backward",
               parts={"params": 12 * MIB, "grads": 12 * MIB, "optimizer": 24 * MIB, "activations": 30 * MIB,
                      "temporaries": 5 * MIB},
               peak_parts={"params": 12 * MIB, "grads": 6 * MIB, "optimizer": 24 * MIB, "activations": 25 * MIB,
                           "temporaries": 3 * MIB}),
    memory_doc(precision="bf16-true", checkpointing="full", peak_phase="optimizer", master=12 * MIB,
               parts={"params": 6 * MIB, "grads": 6 * MIB, "optimizer": 36 * MIB, "activations": 4 * MIB,
                      "temporaries": 3 * MIB},
               peak_parts={"params": 6 * MIB, "grads": 6 * MIB, "optimizer": 36 * MIB, "activations": 0,
                           "temporaries": 2 * MIB},
               notes=("bf16-true: the fp32 master copy adds 12 MiB to optimizer state",)),
]


def _spread(m: float) -> dict:
    return {"median": m, "p25": 0.9 * m, "p75": 1.1 * m, "min": 0.8 * m, "max": 1.2 * m}


_MEDIANS = {"data_wait_s": 0.04, "h2d_s": 0.0, "forward_s": 0.02, "backward_s": 0.05, "optimizer_s": 0.01,
            "comm_exposed_s": 0.0, "rest_s": 0.002, "step_s": 0.122}
PROFILE = {
    "data_wait_frac": 0.33, **_MEDIANS, "busy_frac": 0.66, "tokens_per_s": 4200.0, "samples_per_s": 65.6,
    "mfu": 0.012, "hfu": 0.012, "bottleneck": "input",
    "advice": [{"kind": "input", "text": "raise loader_workers from 0 to 2; data wait is 33% of the step",
                "data_wait_frac": 0.33},
               {"kind": "scale-out", "text": "after the fixes above: scale out with ddp: predicted speed-up "
                                             "(efficiency) on 2: 1.85x (92%)"}],
    "unit": "tokens", "per_device": True,
    "parts": {**{k: _spread(v) for k, v in _MEDIANS.items()}, "comm_explicit_s": _spread(0.0),
              "grad_sync_exposed_s": _spread(0.0)},
    "fractions": {k: v / 0.122 for k, v in _MEDIANS.items()},
    "model_flops_per_step": 6390528.0, "hardware_flops_per_step": 6390528.0, "flops_counted_on": "meta",
    "flops_steps": 20, "peak_flops": 1.0e11, "peak_dtype": "fp32",
    "peak_source": "measured: best of repeated one-thread square matmuls on this CPU",
    "batch_probe": {"micro_batch": 8, "gain": 0.02, "rates_per_s": [4100.0, 4182.0],
                    "note": "alternating steps at micro_batch=8 and 16", "suggested_micro_batch": None, "fit": ""},
    "scaling": {"strategy": "ddp", "grad_bytes": 124800, "small_all_reduces": 2, "bandwidth_bytes_per_s": 1e9,
                "latency_s": 0.0, "bandwidth_source": "given (--bandwidth)", "overlap": 0.0, "compute_s": 0.08,
                "curves": {"ddp": {"formula": "2(n-1)/n x G", "source": "ring all-reduce", "points": [
                    {"n": 1, "comm_bytes": 0.0, "comm_s": 0.0, "exposed_comm_s": 0.0, "straggler_s": 0.0,
                     "step_s": 0.08, "speedup": 1.0, "efficiency": 1.0},
                    {"n": 2, "comm_bytes": 124800.0, "comm_s": 1.2e-4, "exposed_comm_s": 1.2e-4, "straggler_s": 0.0,
                     "step_s": 0.0865, "speedup": 1.85, "efficiency": 0.92}]}},
                "comm_dominates_beyond": None, "calls_per_step": {"ddp": 3}},
    "grad_sync_separable": True, "device": "cpu", "world_size": 1, "rank": 0, "strategy": "single",
    "steps": 20, "warmup": 3, "trace": None, "threads": 2,
    "model": "gpt-tiny", "precision": "bf16-mixed", "checkpointing": "none", "accumulation": 4,
}


def plan_row(strategy: str, peak_gib: float, fits: bool, reasons: list[str]) -> dict:
    return {"precision": "bf16-mixed", "micro_batch": 4, "accumulation": 2, "checkpointing": "full",
            "strategy": strategy, "peak_bytes_per_device": int(peak_gib * GIB), "step_s": 1.25,
            "scaling_efficiency": 0.93, "fits": fits, "reasons": reasons, "grad_sync": "deferred",
            "parts": {"params": 14 * GIB, "grads": 7 * GIB, "optimizer": 28 * GIB, "activations": 10 * GIB,
                      "temporaries": 2 * GIB},
            "compute_s": 1.1, "exposed_comm_s": 0.15}


PLAN = {"model": "llama-7b", "global_batch": 64, "devices": 8, "device_memory_bytes": 80 * GIB, "basis": "analytic",
        "candidates": 240, "excluded": {"fp16-true needs a loss scaler per shard": 12},
        "notes": ["step times assume 40% of the device's peak FLOP/s"],
        "plans": [plan_row("zero2", 61.0, True, ["fits 80 GiB with 19 GiB to spare",
                                                 "zero2 halves gradient memory per rank"]),
                  plan_row("ddp", 95.0, False, ["does not fit: 95 GiB > 80 GiB"])]}

VERIFY = {"precision": "bf16-mixed", "strategy": "single", "micro_batch": 4, "accumulation": 3, "world_size": 1,
          "global_batch": 12, "grad_cosine": 0.99998, "grad_rel_error": 6.1e-3, "grad_norm_ratio": 1.0004,
          "update_max_rel_error": 2.0e-2, "skipped_steps": 0, "fp16_underflow_frac": 0.031, "loss_scale": 1.0,
          "tolerance": {"min_cosine": 0.9999, "max_grad_rel_error": 0.02, "max_update_rel_error": 0.05},
          "passed": True, "causes": []}


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in fp16_rows()) + '{"step": 11, "lo')
    (d / "memory.json").write_text(json.dumps(MEMORY))
    (d / "profile.json").write_text(json.dumps(PROFILE))
    (d / "plan.json").write_text(json.dumps(PLAN))
    (d / "verify.json").write_text(json.dumps(VERIFY))
    return d
