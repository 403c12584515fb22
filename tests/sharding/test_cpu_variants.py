"""The CPU kernel variants: which one a CPU chooses, TPSERVE_KERNELS, and a wheel that carries them into a venv with
no compiler (sharding/cpu/variants.py, setup.py)."""

import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from sharding.cpu import variants as cv

ROOT = Path(__file__).resolve().parents[2]
ZEN4 = set(cv._V4) | {"avx512_vnni", "avx512_bf16", "sse4_2", "avx512vbmi"}
# ARM64 CPUs' /proc/cpuinfo Features
GRAVITON2 = set("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp "
                "ssbs".split())  # Neoverse N1
GRAVITON3 = GRAVITON2 | set("jscvt fcma sha3 sm3 sm4 sha512 sve asimdfhm dit uscat ilrcpc flagm paca pacg dcpodp "
                            "svei8mm svebf16 i8mm bf16 dgh rng".split())  # Neoverse V1
GRAVITON4 = GRAVITON3 | set("sve2 sveaes svepmull svebitperm svesha3 flagm2 frint".split())  # Neoverse V2
CORTEX_A72 = set("fp asimd evtstrm crc32 cpuid".split())  # Raspberry Pi 4: ARMv8.0, no dotprod


SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_int8", "amx_bf16", "avx512_fp16"}


@pytest.mark.parametrize("flags, machine, expected", [
    (SAPPHIRE_RAPIDS, "x86_64", "x86-64-v4-amx"),
    (SAPPHIRE_RAPIDS - {"amx_int8"}, "x86_64", "x86-64-v4-vnni-bf16"),  # tiles without int8 ones: no AMX build
    (ZEN4, "x86_64", "x86-64-v4-vnni-bf16"),
    (ZEN4 - {"avx512_bf16"}, "x86_64", "x86-64-v4"),           # Ice Lake server: VNNI without BF16
    (set(cv._V4), "x86_64", "x86-64-v4"),                      # Skylake-X
    (ZEN4 - {"avx512bw"}, "x86_64", "x86-64-v3"),              # AVX-512F alone is not x86-64-v4
    (set(cv._V3), "x86_64", "x86-64-v3"),                      # Haswell, Zen 1-3
    (set(cv._V3) - {"fma"}, "x86_64", None),                   # below x86-64-v3: torch's own paths
    ({"asimd", "fp"}, "aarch64", "armv8-a"),
    (CORTEX_A72, "aarch64", "armv8-a"),                        # ARMv8.0: no dot product instructions
    (GRAVITON2, "aarch64", "armv8.2-a+dotprod"),
    (GRAVITON3, "aarch64", "armv8.2-a+dotprod"),               # SVE and i8mm: no variant of their own (yet)
    (GRAVITON4, "aarch64", "armv8.2-a+dotprod"),
    ({"fp", "asimddp"}, "aarch64", None),                      # (no asimd: not a CPU Linux runs)
    (GRAVITON3, "x86_64", None),                               # ARM flags do not make an x86 variant
    (ZEN4, "aarch64", None),                                   # x86 flags do not make an ARM variant
])
def test_choose_the_best_variant_the_cpu_runs(flags, machine, expected):
    v = cv.choose(flags, machine)
    assert (v and v.name) == expected


def test_arm64_flags_come_from_the_auxiliary_vector(monkeypatch):
    """On ARM64 the flags are the auxiliary vector's (AT_HWCAP bits, named as /proc/cpuinfo names them): under
    qemu-user, building an arm64 image on an x86 host, /proc/cpuinfo is the host's x86 one and must not count."""
    bits = {name: bit for bit, name in cv._ARM_HWCAP.items()}
    hwcap = sum(1 << bits[f] for f in ("fp", "asimd", "asimddp", "sve"))
    assert cv.arm_flags_from_hwcap(hwcap, 1 << 13) == {"fp", "asimd", "asimddp", "sve", "i8mm"}
    assert cv.arm_flags_from_hwcap(0b11) == {"fp", "asimd"}
    host = platform.machine()
    monkeypatch.setattr(cv.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(cv, "_arm_auxv_flags", lambda: {"fp", "asimd", "asimddp"})
    if host == "x86_64":  # this host's /proc/cpuinfo has x86 `flags`: ignored
        assert cv.cpu_flags() == {"fp", "asimd", "asimddp"}
        assert cv.choose(cv.cpu_flags()).name == "armv8.2-a+dotprod"


def test_choose_among_what_is_prebuilt():
    assert cv.choose(ZEN4, "x86_64", available=["x86-64-v3", "x86-64-v4"]).name == "x86-64-v4"
    assert cv.choose(set(cv._V3), "x86_64", available=["x86-64-v4"]) is None


def test_variants_to_build():
    assert cv.variants_to_build("all", "x86_64") == ["x86-64-v4-amx", "x86-64-v4-vnni-bf16", "x86-64-v4", "x86-64-v3"]
    assert cv.variants_to_build("all", "aarch64") == ["armv8.2-a+dotprod", "armv8-a"]
    assert cv.variants_to_build("none") == []
    assert cv.variants_to_build("x86-64-v3, x86-64-v4") == ["x86-64-v3", "x86-64-v4"]
    with pytest.raises(ValueError, match="unknown variant.*avx9"):
        cv.variants_to_build("avx9")


def run_py(code: str, env: dict, python: str = sys.executable, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


def test_the_build_key_does_not_depend_on_how_the_package_path_is_spelled():
    """A process that imports the package through "tests/helpers/../../sharding" (as a helper script's sys.path
    may) must find the build this one uses, not key and compile one of its own (80 s of a fresh clone's suite)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from sharding.cpu import variants as cv; "
            "print(cv.cache_dir('native', ('-march=native',)))")
    spelled = str(ROOT / "tests" / "helpers" / ".." / "..")
    p = subprocess.run([sys.executable, "-c", code, spelled], capture_output=True, text=True, timeout=120, cwd="/")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == cv.cache_dir("native", ("-march=native",))


@pytest.mark.parametrize("value, rc, says", [
    ("none", 0, "torch paths, no compiled kernels: TPSERVE_KERNELS=none"),
    ("avx9", 1, "TPSERVE_KERNELS=avx9: not a kernel variant"),
])
def test_tpserve_kernels_is_honoured_or_refused(value, rc, says):
    p = run_py("from sharding.cpu import kernels\ntry:\n    kernels.build_kernels()\nexcept ValueError as e:\n"
               "    print(e); raise SystemExit(1)\nprint(kernels.describe())",
               dict(os.environ, TPSERVE_KERNELS=value))
    assert p.returncode == rc, p.stderr[-2000:]
    assert says in p.stdout


QUANT_OUTPUTS = """
import json, sys, torch
from sharding.cpu import kernels
from sharding.layers import quant
assert kernels.build_kernels()
g = torch.Generator().manual_seed(0)
out = {"variant": kernels.CHOICE["variant"], "int8_activations": quant.int8_activations()}
for mode, group, n, k in (("int8", 32, 40, 96), ("int4", 32, 48, 128), ("int4", 128, 20, 256)):
    w = torch.randn(n, k, generator=g)
    qw = quant.bind(quant.quantize(w, mode, group))
    for m in (1, 3, 9):
        x = torch.randn(m, k, generator=g)
        out[f"{mode}-{group}-{m}"] = quant.linear(x, qw).view(torch.int32).flatten().tolist()
f32 = kernels.f32_linear_op()
for n, k in ((64, 96), (45, 70)):  # a ragged last block of 32 outputs
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    for m in (1, 2, 3, 8, 11):
        x = torch.randn(m, k, generator=g)
        y = f32(x, kernels.block_f32(w), b, n)
        assert torch.allclose(y, torch.nn.functional.linear(x, w, b), atol=1e-4), (n, k, m)
        out[f"float32-{n}-{m}"] = y.view(torch.int32).flatten().tolist()
logits = torch.randn(5, 1000, generator=g)
logits[1, 7] = logits[1].max() + 1
logits[2, 999] = logits[2].max() + 1
logits[3, 10] = float("nan")
out["argmax"] = kernels.argmax_op()(logits).tolist()
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() != "x86_64" or not {"avx512_vnni", "avx2"} <= cv.cpu_flags(),
                    reason="needs an x86-64 CPU with AVX-512 VNNI, to run both builds")
def test_the_avx2_build_takes_int8_activations_and_equals_the_vnni_build():
    """On AVX2 alone (Zen 2/3) the int8 and int4 linears multiply int8 activations as with AVX-512 VNNI (vpmaddubsw
    instead of vpdpbusd): the same layout, exact int32 dot products, the same float steps after them, so the same
    outputs bit for bit, at one row and in prefill-sized batches, with a ragged last block of rows. The float32
    kernel's AVX2 tiles (3 rows, not 8) chain the same FMAs over k, so they agree bit for bit too, and so does the
    greedy argmax (first maximum; a NaN row answers its first NaN)."""
    got = {}
    for build in ("x86-64-v3", "x86-64-v4-vnni-bf16"):
        p = run_py(QUANT_OUTPUTS, dict(os.environ, TPSERVE_KERNELS=build))
        assert p.returncode == 0, p.stderr[-3000:]
        got[build] = json.loads(p.stdout.strip().splitlines()[-1])
        assert got[build]["variant"] == build and got[build]["int8_activations"] is True
    avx2, vnni = (dict(got[b], variant=None) for b in ("x86-64-v3", "x86-64-v4-vnni-bf16"))
    assert avx2 == vnni


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("c++") or cv.choose(cv.cpu_flags()) is None,
                    reason="needs a compiler and a CPU some variant runs on")
def test_wheel_carries_the_kernels_into_a_venv_without_a_compiler(tmp_path):
    """`pip wheel --no-build-isolation` compiles the variant this CPU runs into the wheel; installed into a new venv
    whose PATH has no compiler, the kernels load from it (no build at start) and compute what torch computes."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("loaders", "sharding", "server"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "prebuilt"))
    env = dict(os.environ, TPSERVE_BUILD_VARIANTS="host")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w",
                            str(tmp_path / "dist"), str(src)], capture_output=True, text=True, env=env, timeout=900)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("tpserve-*.whl"))
    assert "linux" in wheel.name and "-none-any" not in wheel.name  # a platform wheel: compiled code inside

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    vpy = venv / "bin" / "python"
    site = run_py("import sysconfig; print(sysconfig.get_paths()['purelib'])", {}, str(vpy)).stdout.strip()
    # the wheel unpacked into the venv (what pip install does for a wheel); torch and the rest from this environment,
    # appended after the venv's own site-packages, so `sharding` comes from the wheel
    import zipfile

    zipfile.ZipFile(wheel).extractall(site)
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    home = tmp_path / "home"
    clean = {"PATH": str(venv / "bin"), "HOME": str(home), "TPSERVE_HOME": str(home / "tpserve")}
    p = run_py("""
import json, shutil, torch
from sharding.cpu import kernels
from sharding.layers import quant
assert shutil.which("c++") is None and shutil.which("g++") is None and shutil.which("cc") is None
assert kernels.__file__.startswith(%r), kernels.__file__
ok = kernels.build_kernels()
x, w = torch.randn(5, 96), torch.randn(96)
ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
lin = torch.randn(64, 96)
qw = quant.quantize(lin, "int8", 32)
print(json.dumps({"ok": ok, "describe": kernels.describe(), "norm_err": float((kernels.rms_norm_op()(x, w, 1e-6) - ref).abs().max()),
                  "int8_kernel": qw.kernel is not None,
                  "int8_err": float((quant.linear(x, qw) - x @ lin.T).abs().max() / (x @ lin.T).abs().max())}))
""" % site, clean, str(vpy), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    host = cv.choose(cv.cpu_flags()).name
    assert got["ok"] and got["describe"] == f"kernels {host} (prebuilt)"
    assert got["norm_err"] < 1e-5
    assert got["int8_kernel"] and got["int8_err"] < 0.05  # 8-bit weights (and activations on VNNI CPUs)
    assert not (home / "tpserve" / "kernels").exists()  # nothing was compiled at start


def _host_library() -> str:
    """The kernel library this process loaded (a prebuilt variant, or the one compiled for this CPU)."""
    from sharding.cpu import kernels

    if not kernels.build_kernels() or "library" not in kernels.CHOICE:
        pytest.skip(f"no compiled kernels here: {kernels.describe()}")
    return kernels.CHOICE["library"]


def test_a_build_this_cpu_cannot_run_is_checked_by_its_symbols_only():
    """check_library loads a build only where the CPU has every flag its variant needs (a wheel or image built on an
    AVX2-only host must not load its AVX-512 variants: SIGILL); elsewhere it reads the symbols, and a library
    without the kernels' entry points fails either way."""
    import torch

    path = _host_library()
    host = cv.Variant("host", cv.platform.machine(), (), ())
    beyond = cv.Variant("host", cv.platform.machine(), ("avx9_imaginary",), ())
    assert cv.check_library(path, beyond) == "symbols"
    # a library without the entry points: torch's own
    other = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    with pytest.raises(RuntimeError, match="lacks its entry points"):
        cv.check_library(other, beyond)
    # where the CPU runs it, it is loaded (in a child) and must name its variant
    name = cv.subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True).stdout
    assert "tpserve_kernels_build" in name
    with pytest.raises(RuntimeError, match="does not load"):
        cv.check_library(path, host)  # built as another variant than "host": its name says so


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("qemu-x86_64") is None or cv.platform.machine() != "x86_64"
                    or "avx512f" not in cv.cpu_flags(),
                    reason="needs qemu-x86_64 (Debian's qemu-user) and an AVX-512 host to emulate an AVX2-only one")
def test_on_an_emulated_avx2_cpu_the_avx512_build_is_chosen_against_and_never_loaded():
    """Under qemu-user as an AMD EPYC Milan (Zen 3: AVX2, no AVX-512), which shows the host's /proc/cpuinfo but
    answers CPUID as Zen 3: the flags lose AVX-512, the choice is x86-64-v3, and this host's AVX-512 build is
    checked by its symbols, where loading it would die of SIGILL."""
    path = _host_library()
    from sharding.cpu import kernels

    if kernels.CHOICE["variant"] not in ("native", "x86-64-v4", "x86-64-v4-vnni-bf16"):
        pytest.skip(f"this process runs {kernels.CHOICE['variant']}, not an AVX-512 build")
    code = ("import json, sys; from sharding.cpu import variants as cv; f = cv.cpu_flags(); "
            "v = cv.BY_NAME['x86-64-v4']; "
            "print(json.dumps({'avx512': sorted(x for x in f if x.startswith('avx512')), 'avx2': 'avx2' in f, "
            "'chooses': cv.choose(f).name, 'check': cv.check_library(sys.argv[1], v)}))")
    p = subprocess.run(["qemu-x86_64", "-cpu", "EPYC-Milan", sys.executable, "-c", code, path], capture_output=True,
                       text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"avx512": [], "avx2": True, "chooses": "x86-64-v3", "check": "symbols"}
    # the reason for all this: the same build loaded on that CPU
    crash = subprocess.run(["qemu-x86_64", "-cpu", "EPYC-Milan", sys.executable, "-c",
                            "import sys, torch; torch.ops.load_library(sys.argv[1])", path],
                           capture_output=True, text=True, timeout=600)
    assert crash.returncode != 0 and "Illegal instruction" in crash.stderr, crash.stderr[-2000:]
