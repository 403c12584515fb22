"""The wheel carries the compiled CPU kernels, prebuilt for every CPU level of its architecture (sharding/cpu/variants.py),
so a host without a compiler runs them. The metadata lives in pyproject.toml; this file only adds that build step.

The kernels link the torch they are compiled against, so the build must see the torch that will run them:

    pip install torch==2.13.0                      # the torch of the target environment
    pip wheel --no-build-isolation --no-deps .     # or: python -m build --wheel --no-isolation

TPSERVE_BUILD_VARIANTS chooses what goes in: all (default), host (the variant this CPU runs), none, or names separated
by commas. An isolated build (no torch in it) and an editable install (`pip install -e`, `make install`) make a wheel
without kernels: those compile a build for their own CPU at first start instead, if a compiler is there.
"""

import os
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


HAS_TORCH = _has_torch()
WANTED = os.environ.get("TPSERVE_BUILD_VARIANTS", "all").strip() != "none" and HAS_TORCH


class BuildPyWithKernels(build_py):
    """build_py, then the kernel variants compiled into the build's sharding/cpu/prebuilt/."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        if not WANTED:
            if not HAS_TORCH:
                print("tpserve: torch is not importable in this build environment, so the wheel carries no prebuilt "
                      "CPU kernels (build with --no-build-isolation beside the torch that will run them)",
                      file=sys.stderr)
            return
        out = os.path.join(os.path.abspath(self.build_lib), "sharding", "cpu", "prebuilt")
        subprocess.run([sys.executable, "-m", "sharding.cpu.variants",
                        os.environ.get("TPSERVE_BUILD_VARIANTS", "all"), "--out", out], cwd=HERE, check=True)


class PlatformDistribution(Distribution):
    def has_ext_modules(self) -> bool:
        return WANTED  # compiled libraries inside: a wheel for this platform and Python, not a pure one


setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=PlatformDistribution)
