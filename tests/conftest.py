import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # `import tiny` from any test folder

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def quantized_cache():
    """The quantized-weights cache (sharding/quant_cache.py) of the suite's -q servers in a folder of this session's,
    removed after it, not the developer's ~/.cache/tpserve/quantized (every tiny checkpoint is an entry); the
    compiled kernels stay under TPSERVE_HOME."""
    if os.environ.get("TPSERVE_QUANTIZED_CACHE"):
        yield
        return
    folder = tempfile.mkdtemp(prefix="tpserve-quantized-")
    os.environ["TPSERVE_QUANTIZED_CACHE"] = folder
    yield
    del os.environ["TPSERVE_QUANTIZED_CACHE"]
    shutil.rmtree(folder, ignore_errors=True)


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
