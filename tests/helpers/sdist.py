"""Files out of a project's source distribution on PyPI, downloaded at test time and cached under $TPSERVE_HOME
(default ~/.cache/tpserve): the chat templates llama.cpp keeps (templates.py), AutoAWQ's and GPTQModel's own packing
code (quantized.py). Nothing of them is copied into this repository."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("TPSERVE_HOME", Path.home() / ".cache" / "tpserve"))


def cached_files(dest: Path, project: str, version: str, select: Callable[[str], str | None]) -> Path:
    """`dest`, holding the files of `project`'s sdist for which `select(path inside the sdist)` gives a path to keep
    them under; made once, under a file lock (parallel test workers share one download), and renamed into place
    whole."""
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / (dest.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not dest.is_dir():
                with tempfile.TemporaryDirectory() as work:
                    subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-q",
                                    "-d", work, f"{project}=={version}"], check=True, timeout=600)
                    (archive,) = Path(work).glob("*.tar.gz")
                    part = dest.with_name(dest.name + ".part")
                    shutil.rmtree(part, ignore_errors=True)
                    part.mkdir(parents=True)
                    with tarfile.open(archive) as tar:
                        for member in tar.getmembers():
                            keep = select(member.name.split("/", 1)[-1]) if member.isfile() else None
                            if keep:
                                (part / keep).parent.mkdir(parents=True, exist_ok=True)
                                (part / keep).write_bytes(tar.extractfile(member).read())
                    part.rename(dest)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return dest
