"""Input-bound advice for data read from files: `trainfit prepare` first, then workers, then pinned memory."""

import pytest

from trainfit.config import MAX_WORKERS
from trainfit.probes.advice import Findings, advise, suggested_workers

BASE = dict(comm_exposed_frac=0.0, h2d_frac=0.01, device_type="cpu", world_size=1, strategy="single",
            micro_batch=4, scaling_note="scale out with ddp: 2: 1.9x", batch_gain=0.01)


def _input(adv):
    return [a for a in adv if a["kind"] == "input"]


@pytest.mark.parametrize("source", ["raw-on-the-fly", "raw-packed"])
def test_raw_text_names_prepare_first_then_workers_then_pinned_memory(source):
    f = Findings(data_wait_frac=0.63, loader_workers=0, data_source=source, data="/tmp/docs.jsonl", cpu_count=16,
                 **BASE)
    b, adv = advise(f)
    assert b == "input"
    items = _input(adv)
    assert [a["fix"] for a in items] == ["prepare", "workers", "pin_memory"]
    assert "`trainfit prepare --data /tmp/docs.jsonl --out DIR`" in items[0]["text"]
    assert source in items[0]["text"] and "63%" in items[0]["text"]
    # 16 CPUs: one per CPU left after the training process, at most 8
    assert items[1]["loader_workers"] == 8 and "`--loader-workers 8`" in items[1]["text"]
    assert "pin_memory" in items[2]["text"] and "applies on CUDA" in items[2]["text"]
    assert adv[-1]["kind"] == "scale-out" and adv[-1]["text"].startswith("after the fixes above")


def test_generated_data_keeps_its_advice_without_prepare():
    b, adv = advise(Findings(data_wait_frac=0.42, loader_workers=0, cpu_count=16, **BASE))
    assert b == "input"
    texts = [a["text"] for a in _input(adv)]
    assert "prepare" not in " ".join(texts)
    assert texts[0].startswith("raise loader_workers from 0 to 2")


def test_a_prepared_file_is_not_told_to_store_samples_as_a_memmap():
    texts = [a["text"] for a in _input(advise(Findings(data_wait_frac=0.3, loader_workers=0,
                                                       data_source="prepared", **BASE))[1])]
    assert texts and not any("memory-mapped" in t or "trainfit prepare" in t for t in texts)


def test_below_the_threshold_no_input_advice_for_raw_text():
    b, adv = advise(Findings(data_wait_frac=0.04, loader_workers=0, data_source="raw-on-the-fly", **BASE))
    assert b == "compute" and not _input(adv)


@pytest.mark.parametrize(("current", "cpus", "expected"), [
    (0, 2, 1),        # a 2-core machine: one worker beside the training process
    (0, 16, 8),       # capped at 8
    (2, 16, 8),
    (8, 16, 16),      # already at the cap of spare CPUs: doubled
    (0, 0, 2),        # CPUs unknown: the old doubling rule (0 -> 2)
    (3, 0, 6),
])
def test_suggested_workers_by_hand(current, cpus, expected):
    assert suggested_workers(current, cpus) == min(expected, MAX_WORKERS)


def test_suggested_workers_never_exceed_what_a_run_may_start():
    assert suggested_workers(MAX_WORKERS, 1024) == MAX_WORKERS
