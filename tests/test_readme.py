"""Every ```python block of README.md runs as pasted: each is written to a file of its own and
run by a fresh interpreter in an empty directory. The blocks that start worker processes or
build Hugging Face models are slow."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text("utf-8"), re.M | re.S)

BLOCK_TIMEOUT_S = 900
"""A block's own limit, below the test's: generous, for a machine whose cores are shared."""

PRINTS = {
    'pipetrain.schedules.build("1f1b", ranks=4, microbatches=8)': "33.0 0.273 [4, 3, 2, 1]",
    "lifo = pipetrain.schedules.Schedule.from_text(text)": "9.0",
    "print(pipetrain.launch(train, 2))  # [None, accuracy]": "[None, ",
}
"""Output a block must print, for the blocks whose comments state it (found by a line of
the block)."""


def heavy(code: str) -> bool:
    """Whether a block starts workers, builds a Hugging Face model or profiles one."""
    return any(sign in code for sign in ("pipetrain.launch(", "transformers", "pipetrain.profile("))


def label(code: str) -> str:
    """The block's first line that is neither an import nor blank, to name it in reports."""
    lines = [line for line in code.splitlines() if line and not line.startswith(("import", "from"))]
    return lines[0][:40] if lines else "imports"


def test_the_readme_has_blocks_of_both_kinds() -> None:
    assert len(BLOCKS) >= 8 and any(heavy(code) for code in BLOCKS)
    assert not any(heavy(code) for code in BLOCKS[:2])  # the quick start runs in the default suite


@pytest.mark.timeout(BLOCK_TIMEOUT_S + 60)
@pytest.mark.parametrize(
    "code",
    [
        pytest.param(
            code, marks=[pytest.mark.slow] if heavy(code) else [], id=f"{index}-{label(code)}"
        )
        for index, code in enumerate(BLOCKS)
    ],
)
def test_readme_block_runs_as_pasted(code: str, tmp_path: Path) -> None:
    if "transformers" in code:
        pytest.importorskip("transformers")
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)  # never mistake the test run for a torchrun worker
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=BLOCK_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    for line, printed in PRINTS.items():
        if line in code:
            assert printed in done.stdout
