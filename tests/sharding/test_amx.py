"""The AMX build (x86-64-v4-amx): no CPU here has AMX, so what is tested is the kernels' loop order on emulated tiles
(sharding/cpu/csrc/tests/amx_emulation.cpp: exact for int8 / int4 against the VNNI kernels' arithmetic written plainly,
to float32 rounding for bf16), that the same templates compile to tile instructions for AMX CPUs, and that the build
is chosen only where Linux grants the tiles."""

import os
import platform
import shutil
import subprocess

import pytest

from sharding.cpu import variants as cv

CSRC = os.path.join(os.path.dirname(cv.__file__), "csrc")
HARNESS = os.path.join(CSRC, "tests", "amx_emulation.cpp")
CXX = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
pytestmark = pytest.mark.skipif(CXX is None, reason="needs a C++ compiler")
COMMON = ["-std=c++20", *[f for f in cv.COMMON_CFLAGS if f != "-fopenmp"], "-fopenmp-simd"]


def test_the_amx_kernels_loop_order_on_emulated_tiles(tmp_path):
    exe = tmp_path / "amx_emulation"
    build = subprocess.run([CXX, *COMMON, HARNESS, "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ALL PASSED"), run.stdout[-3000:]
    lines = run.stdout.splitlines()
    # ragged tiles of activation rows, partial blocks of output rows, every int4 group size, bf16
    assert sum(line.startswith("int8 ") and line.endswith("exact") for line in lines) == 48
    assert sum(line.startswith("int4 ") and line.endswith("exact") for line in lines) == 80
    assert sum(line.startswith("bf16 ") and line.endswith("ok") for line in lines) == 48
    assert any("M=131 K=256 rows=7 G=128: exact" in line for line in lines)


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("objdump") is None,
                    reason="needs an x86-64 compiler and objdump")
def test_the_amx_build_compiles_the_same_templates_to_tile_instructions(tmp_path):
    obj = tmp_path / "amx.o"
    march = cv.BY_NAME["x86-64-v4-amx"].march
    build = subprocess.run([CXX, *COMMON, *march, "-c", HARNESS, "-o", str(obj)], capture_output=True, text=True,
                           timeout=300)
    if build.returncode != 0 and "amx" in build.stderr and "unrecognized" in build.stderr:
        pytest.skip(f"this compiler has no AMX: {build.stderr.strip()[:200]}")
    assert build.returncode == 0, build.stderr[-3000:]
    text = subprocess.run(["objdump", "-d", str(obj)], capture_output=True, text=True, timeout=120).stdout
    for insn in ("ldtilecfg", "tileloadd", "tdpbssd", "tdpbf16ps", "tilestored", "tilerelease"):
        assert insn in text, insn


SAPPHIRE_RAPIDS = set(cv._V4) | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}


@pytest.mark.parametrize("granted, expected", [(True, "x86-64-v4-amx"), (False, "x86-64-v4-vnni-bf16")])
def test_the_amx_build_is_chosen_only_where_the_tiles_are_granted(monkeypatch, granted, expected):
    """cpu_flags() keeps the AMX flags only when Linux grants this process tile data (arch_prctl): without the grant
    the first AMX instruction would fault, so the VNNI-BF16 build is chosen instead. (No CPU here has AMX: the grant
    is what is stood in for.)"""
    monkeypatch.setattr(cv, "amx_granted", lambda: granted)
    assert cv.choose(cv.without_ungranted_amx(set(SAPPHIRE_RAPIDS)), "x86_64").name == expected


def test_linux_refuses_tile_data_where_the_cpu_has_none():
    """The real request (arch_prctl ARCH_REQ_XCOMP_PERM): on a CPU without AMX, Linux refuses it."""
    with open("/proc/cpuinfo") as f:
        if "amx_tile" in f.read():
            pytest.skip("this CPU has AMX")
    assert cv.amx_granted() is False
