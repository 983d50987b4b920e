"""The README's first commands and its library example are the real ones."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_opens_with_the_two_commands_and_ci_runs_the_second():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2
    assert "torch==2.13.0" in commands[0] and commands[0].endswith("trainfit train")
    assert "requirements-dev.txt" in commands[1] and "pytest" in commands[1]
    assert "torch==2.13.0" in (ROOT / "requirements-dev.txt").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1].split("&& ", 1)[1] in ci  # the same install + test command


def test_readme_library_example_runs(tmp_path):
    text = (ROOT / "README.md").read_text()
    section = text.split("## Use it from your own loop", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    first, last = map(float, re.search(r"loss ([0-9.]+) -> ([0-9.]+)", r.stdout).groups())
    assert last < first / 2
