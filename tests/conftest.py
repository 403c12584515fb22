import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # `import tiny` from any test folder

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Lazily made tiny random checkpoints, one per architecture name in tiny.ARCHS, shared by the session."""
    from tiny import make_checkpoint

    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_checkpoint(tmp_path_factory.mktemp(arch), arch)
        return made[arch]

    return get


@pytest.fixture(scope="session")
def tool_checkpoint(tmp_path_factory):
    """The tiny checkpoint trained to make one Hermes tool call (tests/tool_model.py), made once per session."""
    import tool_model

    return tool_model.make_tool_checkpoint(tmp_path_factory.mktemp("toolmodel"))
