"""The CPU kernels' own correctness harness (sharding/cpu/csrc/tests/harness.cpp, no torch) for every kernel variant:
the torch-free kernels (csrc/core/*.cpp) compiled with the variant's flags from sharding/cpu/variants.py, linked with
the harness, and run against its plain scalar reference on random shapes with tails. Natively for the x86 variants
this CPU runs (and a baseline x86-64 build: the portable loops); for the ARM64 variants cross-compiled with Debian's
aarch64-linux-gnu-g++ (-static) and run under qemu-aarch64 as a CPU of that level (a Cortex-A72 for armv8-a, which has
no dot product instructions; a Neoverse N1 for armv8.2-a+dotprod). A test whose compiler, emulator or CPU is missing
is skipped with the reason.

Then across builds: every case the harness checks bit for bit must hash the same on every build of the same scheme,
so the ARM64 builds' int8/int4 outputs are the x86 int8-activation builds' bits, and the float32 linear's are every
FMA build's.

Each build compiles only the torch-free core/*.cpp (~5 s on two cores); the emulated ARM64 runs take longer. The fast
tier runs the builds an x86-64 CI host can run natively at its extremes (the best this CPU takes, AVX2 and the portable
loops) and compares their hashes; the AVX-512-without-VNNI build and the two ARM64 ones, and the comparison across all
six, are in the slow tier.
"""

import collections
import os
import platform
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sharding.cpu import variants as cv

CSRC = Path(cv.CSRC)
HOST = platform.machine()
CROSS = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
# the emulated CPU for each ARM64 variant: the plainest one that has the variant's flags (armv8-a on a core without
# dotprod proves the build needs none)
QEMU_CPU = {"armv8-a": "cortex-a72", "armv8.2-a+dotprod": "neoverse-n1"}
# what each build's kernels run (tpserve::kernels_isa())
ISA = {"x86-64-v4-vnni-bf16": "avx512-vnni-bf16", "x86-64-v4": "avx512", "x86-64-v3": "avx2", "x86-64": "portable",
       "armv8-a": "neon", "armv8.2-a+dotprod": "neon-dotprod"}
# the harness's builds: every variant, plus x86-64 without -march extensions (the portable loops)
TARGETS = [v.name for v in cv.VARIANTS] + ["x86-64"]
# the slow tier's builds (the rest run in the fast tier too)
SLOW_TARGETS = {"x86-64-v4", "armv8-a", "armv8.2-a+dotprod"}
PORTABLE = cv.Variant("x86-64", "x86_64", (), ("-march=x86-64",))
COMPILE_TIMEOUT = 600
RUN_TIMEOUT = 300


def _variant(name: str) -> cv.Variant:
    return PORTABLE if name == PORTABLE.name else cv.BY_NAME[name]


def _how(name: str) -> tuple[list[str], list[str], str | None]:
    """(compiler command, runner prefix, or None and the reason to skip) for target `name` on this host."""
    v = _variant(name)
    if v.machine == HOST:
        cxx = os.environ.get("CXX", "c++")
        if shutil.which(cxx) is None:
            return [], [], f"needs a C++ compiler ({cxx})"
        missing = cv.missing_flags(v, cv.cpu_flags())
        if missing:
            return [], [], f"this CPU lacks {', '.join(missing)}"
        return [cxx], [], None
    if v.machine == "aarch64" and HOST == "x86_64":
        if shutil.which(CROSS) is None:
            return [], [], f"needs {CROSS} (Debian's g++-aarch64-linux-gnu)"
        if shutil.which(QEMU) is None:
            return [], [], f"needs {QEMU} (Debian's qemu-user)"
        return [CROSS, "-static"], [QEMU, "-cpu", QEMU_CPU[name]], None
    return [], [], f"{name} is for {v.machine}: no way to run it on {HOST} here"


def build_harness(name: str, out: Path) -> Path:
    """Compile core/*.cpp as the variant's build does (variants.py's flags, less torch and -fPIC) and the harness
    (no -ffast-math, no contraction: its reference is plain arithmetic; OpenMP for its team of `shares` cases), then
    link them."""
    cmd, _, why = _how(name)
    assert why is None, why
    cxx, link_extra = cmd[0], cmd[1:]
    v = _variant(name)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [([cxx, "-std=c++20", *cv.COMMON_CFLAGS, *v.march, "-c", str(CSRC / s), "-o",
              str(out / (Path(s).stem + ".o"))]) for s in cv.CORE_SOURCES]
    jobs.append([cxx, "-std=c++20", "-O2", "-ffp-contract=off", "-fopenmp", *v.march, "-c", str(CSRC / cv.HARNESS),
                 "-o", str(out / "harness.o")])

    def run(c):
        return subprocess.run(c, capture_output=True, text=True, timeout=COMPILE_TIMEOUT)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for p in pool.map(run, jobs):
            assert p.returncode == 0, f"{' '.join(p.args)}\n{p.stderr[-3000:]}"
    exe = out / "harness"
    objects = [str(out / (Path(s).stem + ".o")) for s in cv.CORE_SOURCES]
    p = run([cxx, str(out / "harness.o"), *objects, "-fopenmp", *link_extra, "-o", str(exe)])
    assert p.returncode == 0, p.stderr[-3000:]
    return exe


_RESULTS: dict[str, subprocess.CompletedProcess] = {}


def harness_run(name: str, tmp_root: Path) -> subprocess.CompletedProcess:
    """Build and run the harness for `name` once per test session (the cross-build comparison reuses the runs)."""
    if name not in _RESULTS:
        exe = build_harness(name, tmp_root / name.replace("+", "_"))
        _, runner, _ = _how(name)
        _RESULTS[name] = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=RUN_TIMEOUT)
    return _RESULTS[name]


LINE = re.compile(r"^(ok  |FAIL) (.+?) \| scheme=(\S+)( exact)? err=\S+ hash=([0-9a-f]{16})")


def parse(stdout: str) -> dict[str, tuple[bool, str, bool, str]]:
    """case name -> (passed, scheme, exact, hash)"""
    cases = {}
    for line in stdout.splitlines():
        m = LINE.match(line)
        if m:
            cases[m.group(2)] = (m.group(1) == "ok  ", m.group(3), bool(m.group(4)), m.group(5))
    return cases


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("harness")


def _param(name: str):
    why = _how(name)[2]
    marks = [pytest.mark.skipif(why is not None, reason=why or "")]
    return pytest.param(name, id=name, marks=marks + ([pytest.mark.slow] if name in SLOW_TARGETS else []))


@pytest.mark.parametrize("name", [_param(n) for n in TARGETS])
def test_every_kernel_of_the_build_matches_the_reference(name, tmp_root):
    """The harness passes every case for this build, and the build runs the kernels its CPU level is for (int8/int4
    multiply int8 activations on VNNI, AVX2 and every ARM64 build; bfloat16 ones only with AVX-512 BF16)."""
    p = harness_run(name, tmp_root)
    failed = [ln for ln in p.stdout.splitlines() if ln.startswith("FAIL")]
    assert p.returncode == 0 and not failed, "\n".join(failed[:20]) + p.stderr[-2000:]
    head, summary = p.stdout.splitlines()[0], p.stdout.splitlines()[-1]
    assert head.startswith(f"harness: kernels {ISA[name]},"), head
    int8_act = name in ("x86-64-v4-vnni-bf16", "x86-64-v3", "armv8-a", "armv8.2-a+dotprod")
    assert f"rows per block {16 if int8_act else 4} (int8 activations: {'yes' if int8_act else 'no'})" in head
    assert f"bf16 rows {16 if name == 'x86-64-v4-vnni-bf16' else 4}" in head
    cases = parse(p.stdout)
    assert re.search(r": (\d+) cases, 0 failed$", summary) and len(cases) == int(summary.split()[-4]) > 400
    kernels = collections.Counter(c.split()[0] for c in cases)
    assert set(kernels) == {"quantize_rows", "int8", "int4", "bf16", "f32", "rms_norm", "rotary", "attention",
                            "attention_rows", "argmax", "kq", "shares"}
    # a late thread's share is taken by the others, and every output block is claimed once, on a team of 2-4
    assert all(c.startswith(("shares T=2", "shares T=3", "shares T=4")) and "smaller" not in c and cases[c][0]
               for c in cases if c.startswith("shares")) and kernels["shares"] == 36
    # the int8 / int4 linears over int8 activations, and the float32 one on builds with FMAs, are exact; so are the
    # GGUF block types' (int8 activations on every build), all eight of them (MXFP4 and Q4_Z included)
    exact = {c.split()[0] for c, (_, scheme, ex, _) in cases.items() if ex}
    assert ({"int8", "int4"} <= exact) == int8_act
    kq = [c for c, (_, scheme, ex, _) in cases.items() if c.startswith("kq ")]
    assert all(cases[c][1:3] == ("int8-act-kq", True) for c in kq)
    assert {re.search(r"type=(\S+)", c).group(1) for c in kq} == {"Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
                                                                  "MXFP4", "Q4_Z"}
    assert ("f32" in exact) == (name != "x86-64")


@pytest.mark.parametrize("tier", ["fast", pytest.param("all", marks=pytest.mark.slow)])
def test_exact_cases_hash_the_same_on_every_build(tier, tmp_root):
    """Each exact case (same inputs on every build: a fixed-seed integer generator) gives the same bits on every
    build that computes it by the same scheme: ARM64's int8/int4 linears equal the VNNI and AVX2 builds', every FMA
    build's float32 linear equals the others', Q8_0's quantized activations are the same everywhere, and so are the
    GGUF block types' linears (VNNI, AVX2 and the portable kernel of every other build)."""
    names = [n for n in TARGETS if _how(n)[2] is None and (tier == "all" or n not in SLOW_TARGETS)]
    runs = {n: parse(harness_run(n, tmp_root).stdout) for n in names}
    if len(runs) < 2:
        pytest.skip("fewer than two builds run here")
    by_case = collections.defaultdict(lambda: collections.defaultdict(dict))
    for name, cases in runs.items():
        for case, (ok, scheme, exact, h) in cases.items():
            assert ok, (name, case)
            if exact:
                by_case[case][scheme][name] = h
    differ = [(case, scheme, hashes) for case, schemes in by_case.items() for scheme, hashes in schemes.items()
              if len(set(hashes.values())) > 1]
    assert not differ, differ[:5]
    compared = {name for schemes in by_case.values() for hashes in schemes.values() if len(hashes) > 1
                for name in hashes}
    assert compared == set(runs), set(runs) - compared


def test_the_build_hashes_and_ships_every_kernel_source():
    """Every header under csrc/ is in variants.HEADERS (a build's hash, so a changed arch/ header rebuilds) and every
    .cpp outside tests/ is in SOURCES; pyproject.toml's package-data patterns cover them all (the wheel, and the
    cache builds of an installed package)."""
    headers = {str(p.relative_to(CSRC)) for p in CSRC.rglob("*.h")}
    sources = {str(p.relative_to(CSRC)) for p in CSRC.rglob("*.cpp") if p.parts[-2] != "tests"}
    assert headers == set(cv.HEADERS)
    assert sources == set(cv.SOURCES)
    assert all(not s.startswith("tests/") for s in cv.SOURCES) and (CSRC / cv.HARNESS).exists()
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    patterns = re.search(r'"sharding\.cpu" = \[(.*?)\]', text, re.S).group(1)
    globs = [g.removeprefix("csrc/") for g in re.findall(r'"([^"]+)"', patterns)]
    for f in headers | sources | {cv.HARNESS}:
        assert any(Path(f).match(g) and f.count("/") == g.count("/") for g in globs), f


def test_core_sources_include_no_torch():
    """The kernels in core/ and arch/ (and the harness) build without torch: no ATen, c10 or torch header."""
    for p in [*CSRC.glob("core/*"), *CSRC.glob("arch/*/*"), CSRC / cv.HARNESS]:
        includes = re.findall(r'#include [<"]([^>"]+)', p.read_text())
        assert not [i for i in includes if i.split("/")[0] in ("ATen", "c10", "torch")], (p, includes)


HWCAP_PROBE = r"""
#include <stdio.h>
#include <sys/auxv.h>
int main(void) { printf("%lu %lu\n", getauxval(AT_HWCAP), getauxval(AT_HWCAP2)); return 0; }
"""


@pytest.mark.skipif(HOST != "x86_64" or shutil.which(CROSS.replace("g++", "gcc")) is None or shutil.which(QEMU) is None,
                    reason=f"needs {CROSS.replace('g++', 'gcc')} and {QEMU} on an x86-64 host")
@pytest.mark.parametrize("cpu, expected", [("neoverse-n1", "armv8.2-a+dotprod"), ("cortex-a72", "armv8-a"),
                                           ("a64fx", "armv8-a"), ("max", "armv8.2-a+dotprod")])
def test_arm_flags_from_the_auxiliary_vector_choose_the_variant(cpu, expected, tmp_path):
    """What an ARM64 process's auxiliary vector says (here: qemu-aarch64 as that CPU) read as cpuinfo names by
    variants.arm_flags_from_hwcap, and the variant chosen from them: Neoverse N1 (Graviton 2) and qemu's `max` take
    the dotprod build; Cortex-A72 (ARMv8.0) and A64FX (SVE, but no NEON dot product) the plain one."""
    src = tmp_path / "hwcap.c"
    src.write_text(HWCAP_PROBE)
    exe = tmp_path / "hwcap"
    subprocess.run([CROSS.replace("g++", "gcc"), "-static", "-O1", str(src), "-o", str(exe)], check=True,
                   timeout=COMPILE_TIMEOUT)
    out = subprocess.run([QEMU, "-cpu", cpu, str(exe)], capture_output=True, text=True, timeout=RUN_TIMEOUT, check=True)
    hwcap, hwcap2 = map(int, out.stdout.split())
    flags = cv.arm_flags_from_hwcap(hwcap, hwcap2)
    assert {"fp", "asimd"} <= flags
    assert ("asimddp" in flags) == (expected != "armv8-a")
    if cpu == "a64fx":
        assert "sve" in flags
    assert cv.choose(flags, "aarch64").name == expected
