"""The chat templates today's model families ship, as llama.cpp keeps them (models/templates/*.jinja), taken at test
time from the llama-cpp-python sdist on PyPI (the same release scripts/build_llama_cpp.sh builds) and cached in
$TPSERVE_HOME/chat-templates-<version>/ (default ~/.cache/tpserve): not copied into this repository.

    from templates import template, tokenizer_with
    text = template("Qwen-Qwen3-0.6B")            # the .jinja text
    tok = tokenizer_with(folder, "Qwen-Qwen3-0.6B")  # a saved tokenizer folder given that template

The first use downloads the sdist (~75 MB, once per cache) under a file lock, so parallel test workers share it.
"""

from __future__ import annotations

import os
from pathlib import Path

from helpers import sdist

VERSION = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")
INNER = "vendor/llama.cpp/models/templates/"


def cache_dir() -> Path:
    return sdist.home() / f"chat-templates-{VERSION}"


def templates_dir() -> Path:
    return sdist.cached_files(cache_dir(), "llama-cpp-python", VERSION, lambda name: Path(name).name if (
        name.startswith(INNER) and name.endswith(".jinja")) else None)


def template(name: str) -> str:
    """The text of models/templates/<name>.jinja."""
    path = templates_dir() / f"{name}.jinja"
    if not path.exists():
        raise FileNotFoundError(f"no chat template {name!r} in llama-cpp-python {VERSION}: "
                                f"{sorted(p.stem for p in templates_dir().glob('*.jinja'))}")
    return path.read_text()
