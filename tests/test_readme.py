"""A fresh clone's README quick start names exactly the Makefile's `serve` and `test`, and CI runs `make test` (the fast
tier) and then `make test-slow`."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_fresh_clone_quick_start_matches_makefile(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=60)
    readme = (clone / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("##", 1)[0]
    block = re.search(r"```sh\n(.*?)```", quick, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["make serve", "make test"]
    for target, must_run in (("serve", "tpserve serve"), ("test", "pytest"), ("test-slow", "pytest")):
        dry = subprocess.run(["make", "-n", "-B", target], cwd=clone, capture_output=True, text=True, timeout=60)
        assert dry.returncode == 0, dry.stderr
        assert "pip install torch==2.13.0" in dry.stdout  # the pinned CPU torch comes first
        assert must_run in dry.stdout
        if target.startswith("test"):  # the two tiers split the suite by the `slow` marker
            assert ('-m "not slow"' if target == "test" else "-m slow") in dry.stdout
    ci = [line for line in (clone / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert ci == ["make test", "make test-slow"]
