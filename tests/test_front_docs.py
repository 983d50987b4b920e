"""docs/python.md: every ```python example runs as written (in a temporary directory, on its tiny job)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "python.md"
FUNCTIONS = ("estimate_memory", "measure_memory", "profile", "train", "prepare", "plan", "verify")


def _blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_the_page_shows_each_front_door_function():
    code = "\n".join(_blocks(DOC.read_text()))
    for name in FUNCTIONS:
        assert re.search(rf"\b{name}\(", code), name
    assert "trainfit.plan(" in code and "trainfit.verify(" in code and "trainfit.train(" in code  # the top-level names


@pytest.mark.slow  # about a minute here: the plan example traces its candidates
def test_the_python_examples_run(tmp_path, monkeypatch):
    text = DOC.read_text()
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "docs_python"}
    ran = 0
    for block in _blocks(text):
        exec(compile(block, f"{DOC.name} example {ran + 1}", "exec"), namespace)  # noqa: S102
        ran += 1
    assert ran == len(_blocks(text)) >= 7, ran
    assert namespace["summary"].steps == 3 and (tmp_path / "runs" / "from-python" / "metrics.jsonl").is_file()
    assert namespace["written"].n_tokens == len("the first document of a tiny corpus\n".encode()) + 1
