"""The chat templates today's model families ship, as llama.cpp keeps them (models/templates/*.jinja), taken at test
time from the llama-cpp-python sdist on PyPI (the same release scripts/build_llama_cpp.sh builds) and cached in
$TPSERVE_HOME/chat-templates-<version>/ (default ~/.cache/tpserve): not copied into this repository.

    from templates import template, tokenizer_with
    text = template("Qwen-Qwen3-0.6B")            # the .jinja text
    tok = tokenizer_with(folder, "Qwen-Qwen3-0.6B")  # a saved tokenizer folder given that template

The first use downloads the sdist (~75 MB, once per cache) under a file lock, so parallel test workers share it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")
INNER = "vendor/llama.cpp/models/templates/"


def cache_dir() -> Path:
    home = Path(os.environ.get("TPSERVE_HOME", Path.home() / ".cache" / "tpserve"))
    return home / f"chat-templates-{VERSION}"


def _fetch(dest: Path) -> None:
    with tempfile.TemporaryDirectory() as work:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-q", "-d",
                        work, f"llama-cpp-python=={VERSION}"], check=True, timeout=600)
        (sdist,) = Path(work).glob("llama_cpp_python-*.tar.gz")
        part = dest.with_name(dest.name + ".part")
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                name = member.name.split("/", 1)[-1]
                if member.isfile() and name.startswith(INNER) and name.endswith(".jinja"):
                    data = tar.extractfile(member).read()
                    (part / Path(name).name).write_bytes(data)
        part.rename(dest)


def templates_dir() -> Path:
    dest = cache_dir()
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / (dest.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not dest.is_dir():
                _fetch(dest)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return dest


def template(name: str) -> str:
    """The text of models/templates/<name>.jinja."""
    path = templates_dir() / f"{name}.jinja"
    if not path.exists():
        raise FileNotFoundError(f"no chat template {name!r} in llama-cpp-python {VERSION}: "
                                f"{sorted(p.stem for p in templates_dir().glob('*.jinja'))}")
    return path.read_text()
