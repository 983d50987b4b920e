"""module:callable: the small protocol (a spec or a full Task) and its errors."""

import sys
from pathlib import Path

import pytest
import torch

from trainfit.errors import ModelError
from trainfit.tasks.base import GenericTask
from trainfit.tasks.make import make_task

HERE = Path(__file__).resolve().parent.parent / "probes"


@pytest.fixture(autouse=True)
def _path(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


def test_spec_becomes_a_task_that_trains_one_step():
    task = make_task("trainfit_linear_stack:make", seed=2)
    model = task.build_model()
    batch = task.collate(list(range(5)))
    assert task.count(batch) == 5
    loss_sum, count = task.loss(model, batch)
    assert count == 5 and loss_sum.dim() == 0
    ref = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction="sum")
    torch.testing.assert_close(loss_sum, ref)


def test_a_full_task_is_used_as_is(tmp_path, monkeypatch):
    (tmp_path / "trainfit_full_task.py").write_text(
        "from trainfit.tasks.builtin import gpt_task\n"
        "def make(seq_len=16, seed=0):\n"
        "    return gpt_task('gpt-tiny', seq_len=seq_len, seed=seed, dataset_size=8, overrides='n_layer=1,d_model=32,n_head=2')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    task = make_task("trainfit_full_task:make", seq_len=16)
    assert isinstance(task, GenericTask) and task.block_classes == ("Block",)


@pytest.mark.parametrize("spec, needle", [
    ("trainfit_no_such_mod:make", "cannot import module"),
    ("trainfit_linear_stack:not_a_task", "returned int"),
    ("trainfit_linear_stack:D_IN", "is a int, not a callable"),
    ("trainfit_linear_stack:broken", "the user's factory failed"),
])
def test_errors_say_what_to_do(spec, needle):
    with pytest.raises(ModelError) as e:
        make_task(spec)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert "trainfit_no_such_mod" not in sys.modules
