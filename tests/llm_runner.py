"""Run tests/helpers/run_llm.py in a fresh process (its ranks spawned from there), bounded in time."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

HELPER = Path(__file__).parent / "helpers" / "run_llm.py"


def run_llm(tp: int, jobs: list[dict], timeout: float = 300, env: dict | None = None) -> list[dict]:
    """Every job's LLM is created and closed in turn in one process, at tensor parallel size `tp`."""
    import os

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        spec = {"tp": tp, "out": str(out), "jobs": jobs}
        proc = subprocess.run([sys.executable, str(HELPER)], input=json.dumps(spec), text=True, timeout=timeout,
                              capture_output=True, env=dict(os.environ, **(env or {})))
        assert proc.returncode == 0, f"run_llm failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
        return json.loads(out.read_text())
