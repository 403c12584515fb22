"""Which build of the compiled CPU kernels (sharding/cpu/csrc/) a process runs, and how each build is made.

The kernels are compiled once per CPU level ("variant"), each from the same sources with its own `-march`, the way
llama.cpp's GGML_CPU_ALL_VARIANTS builds its CPU backend: the `#if __AVX512F__` / `__AVX512VNNI__` /
`__AVX512BF16__` / `__ARM_FEATURE_DOTPROD` branches of the sources decide what a level runs (the torch-free kernels
in csrc/core/, their ISA loops in csrc/arch/x86/ and csrc/arch/arm/; docs/cpu-kernels.md). A wheel (`setup.py`) and the Docker image carry
the variants prebuilt under `sharding/cpu/prebuilt/`; at start the best one this CPU can run is chosen from its flags
(`choose`). Every source registers its ops into one `TORCH_LIBRARY_FRAGMENT(tpserve)`, so a process loads one
variant, before any op is used.

A build never loads a variant the build host cannot run (an AVX-512 variant on an AVX2-only CPU would die of SIGILL):
each one is compiled without being loaded (`build_library`), then checked (`check_library`) by loading it in a child
process where this CPU runs it, and by its dynamic symbols elsewhere.

TPSERVE_KERNELS picks the build:
  auto (default)  the best prebuilt variant for this CPU and this torch; without one (a source checkout, another
                  torch), a build for this CPU (`-march=native`) compiled at first start and cached in
                  $TPSERVE_HOME/kernels; without a compiler, torch's own paths (the startup line says why)
  native          always the `-march=native` build
  <variant>       that variant: prebuilt, or compiled into the cache if not (for measuring one level against another)
  none            torch's own paths
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from loaders import envs

# (the real path: the build's key holds the sources' paths, and a package imported through "a/../sharding" would
# otherwise key, and compile, a build of its own)
HERE = os.path.dirname(os.path.realpath(__file__))
CSRC = os.path.join(HERE, "csrc")
# core/: the kernels without torch (what tests/harness.cpp compiles alone, for every variant); the rest: the torch ops
CORE_SOURCES = ("core/quant_linear.cpp", "core/f32_linear.cpp", "core/rms_norm.cpp", "core/rotary.cpp",
                "core/paged_attention.cpp", "core/argmax.cpp", "core/amx_linear.cpp", "core/kquant_linear.cpp",
                "core/kquant_pack.cpp")
SOURCES = CORE_SOURCES + ("paged_attention.cpp", "quant_linear.cpp", "rms_norm.cpp", "rotary.cpp", "decode_glue.cpp",
                          "f32_linear.cpp", "step_meta.cpp", "build_info.cpp")
# included by the sources (the arch/ ones by core/ for the build's ISA): part of a build's hash, and of the wheel
# (pyproject.toml's package-data); tests/sharding/test_kernel_harness.py checks that this lists every header
HEADERS = ("tpserve_kernels.h", "team_split.h", "core/kernels.h", "core/portable_quant.h", "core/portable_f32.h",
           "arch/x86/quant_avx512.h", "arch/x86/quant_avx2.h", "arch/x86/kquant_avx512.h", "arch/x86/kquant_avx2.h",
           "arch/x86/avx2_rows16.h", "arch/x86/vnni_bcst.h", "arch/x86/prefetch.h",
           "arch/x86/f32.h", "arch/x86/argmax.h", "arch/x86/amx_tiles.h",
           "arch/arm/quant_neon.h", "arch/arm/f32.h")
HARNESS = "tests/harness.cpp"  # the kernels' own correctness harness (no torch; not part of a build)
PREBUILT = os.path.join(HERE, "prebuilt")  # manifest.json + <variant>/tpserve_kernels.so
LIBRARY = "tpserve_kernels.so"
# -fopenmp: at::parallel_for is OpenMP in torch's CPU builds; without it the loop runs on one thread (the libgomp.so.1
# it links is the one torch has loaded already, matched by its soname: the runtime needs no libgomp of its own)
COMMON_CFLAGS = ("-O3", "-ffast-math", "-fopenmp")


@dataclass(frozen=True)
class Variant:
    name: str
    machine: str              # platform.machine() it runs on
    needs: tuple[str, ...]    # CPU flags (/proc/cpuinfo) it was compiled for
    march: tuple[str, ...]    # the compiler flags that make it


_V3 = ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe")
_V4 = _V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
# best first: `choose` takes the first one whose flags the CPU has. The AVX-512 levels are tuned for an AVX-512 core:
# GCC's -mtune=generic made the batched int8 kernel (int8_range, 8 rows) 0.6x as fast on Zen 4 (BENCHMARKS.md
# section 14), and any AVX-512 core's tuning (icelake-server, sapphirerapids, znver3) gave it back. Those tunings
# also have the compiler vectorize loops at 256 bits; the VNNI levels ask for 512 (the hand-written loops are 512-bit
# already): with 256, the loops the compiler vectorizes (quantize_rows, attention's softmax) left the variant at
# 0.91-0.94x native for int4 at 8 streams on Zen 5, 0.97-1.01x with 512 (sections 31, 32).
_AMX = ("amx_tile", "amx_int8", "amx_bf16")
VARIANTS = (
    # Sapphire Rapids and later Xeons: the VNNI-BF16 build, plus AMX tiles for prefill-sized batches of the int8, int4
    # and bf16 linears (core/amx_linear.cpp). NOT RUN ON AMX HARDWARE: built, and its loop order tested on emulated tiles.
    # Chosen only where Linux grants the process the tile registers (cpu_flags).
    Variant("x86-64-v4-amx", "x86_64", _V4 + ("avx512_vnni", "avx512_bf16") + _AMX,
            ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-int8", "-mamx-bf16",
             "-mtune=sapphirerapids", "-mprefer-vector-width=512")),
    # Zen 4 / Zen 5, Sapphire Rapids and later: int8/int4 activations in int8 (vpdpbusd), bf16 ones in bfloat16
    Variant("x86-64-v4-vnni-bf16", "x86_64", _V4 + ("avx512_vnni", "avx512_bf16"),
            ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mtune=icelake-server",
             "-mprefer-vector-width=512")),
    # AVX-512 without VNNI/BF16 (Skylake-X, Cascade Lake): the AVX-512 float32 paths, float32 activations for
    # int8/int4/bf16
    Variant("x86-64-v4", "x86_64", _V4, ("-march=x86-64-v4", "-mtune=skylake-avx512")),
    # AVX2 + FMA (Haswell and later, Zen 1-3): the portable loops, vectorized by the compiler
    Variant("x86-64-v3", "x86_64", _V3, ("-march=x86-64-v3",)),
    # ARM64 with the dot product extension (Neoverse N1 / Graviton 2 and every later server core, Ampere Altra, Apple
    # M1 and later): int8/int4 activations in int8 (sdot, arch/arm/quant_neon.h), float32 by NEON FMAs
    Variant("armv8.2-a+dotprod", "aarch64", ("asimd", "asimddp"), ("-march=armv8.2-a+dotprod",)),
    # every 64-bit ARM CPU has NEON (Cortex-A53/A72, Graviton 1): int8/int4 activations in int8 (smull + sadalp), float32
    # by NEON FMAs
    Variant("armv8-a", "aarch64", ("asimd",), ("-march=armv8-a",)),
)
BY_NAME = {v.name: v for v in VARIANTS}


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (x86 `flags`, ARM `Features`), less what the CPU itself (CPUID,
    through torch's cpuinfo) says it cannot run: an emulator (qemu-user) shows the host's /proc/cpuinfo but runs
    another CPU. Linux drops the AVX-512 flags when the OS does not save their registers. On ARM64 the flags come from
    the auxiliary vector (AT_HWCAP, AT_HWCAP2: what the kernel, or an emulator, says this process's CPU runs; the
    same names as /proc/cpuinfo's Features), which under qemu-user (an arm64 image built on an x86 host) is the
    emulated CPU's where /proc/cpuinfo is the host's. Empty off Linux."""
    flags: set[str] = set()
    key = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("flags", "Features"):
                    flags = set(value.split())
                    break
    except OSError:
        pass
    if platform.machine() == "aarch64":
        auxv = _arm_auxv_flags()
        if auxv:
            return auxv | (flags if key == "Features" else set())
    return without_ungranted_amx(flags - _denied_by_cpuid(flags))


def without_ungranted_amx(flags: set[str]) -> set[str]:
    """`flags` less the AMX ones when Linux does not grant this process tile data: the first tile instruction would
    fault, so the AMX build must not be chosen."""
    return flags - set(_AMX) if set(_AMX) & flags and not amx_granted() else flags


def amx_granted() -> bool:
    """Whether Linux lets this process use AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA: Linux
    5.16+ requires the request; it holds for the whole process). False off x86-64 Linux or when refused."""
    if platform.machine() != "x86_64" or not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        sys_arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18
        return libc.syscall(sys_arch_prctl, req_xcomp_perm, xtiledata) == 0
    except (OSError, AttributeError):
        return False


# Linux's arm64 hwcap bits (arch/arm64/include/uapi/asm/hwcap.h) with their /proc/cpuinfo names: the ones the variants
# or their documentation name
_ARM_HWCAP = {0: "fp", 1: "asimd", 9: "fphp", 10: "asimdhp", 20: "asimddp", 22: "sve", 23: "asimdfhm"}
_ARM_HWCAP2 = {1: "sve2", 9: "svei8mm", 12: "svebf16", 13: "i8mm", 14: "bf16"}
_AT_HWCAP, _AT_HWCAP2 = 16, 26


def arm_flags_from_hwcap(hwcap: int, hwcap2: int = 0) -> set[str]:
    """The cpuinfo names of the bits set in AT_HWCAP / AT_HWCAP2 (arm64)."""
    return ({name for bit, name in _ARM_HWCAP.items() if hwcap >> bit & 1}
            | {name for bit, name in _ARM_HWCAP2.items() if hwcap2 >> bit & 1})


def _arm_auxv_flags() -> set[str]:
    """This process's arm64 CPU features from the auxiliary vector (glibc's getauxval), or empty."""
    import ctypes

    try:
        getauxval = ctypes.CDLL(None).getauxval
    except (OSError, AttributeError):
        return set()
    getauxval.restype, getauxval.argtypes = ctypes.c_ulong, [ctypes.c_ulong]
    return arm_flags_from_hwcap(getauxval(_AT_HWCAP), getauxval(_AT_HWCAP2))


def _denied_by_cpuid(flags: set[str]) -> set[str]:
    """The x86 flags in `flags` that torch's CPUID probes deny (none if torch or the probes are missing)."""
    try:
        import torch.cpu as tc
    except ImportError:
        return set()
    probes = (("_is_avx2_supported", lambda f: f == "avx2"),
              ("_is_avx512_supported", lambda f: f.startswith("avx512")),
              ("_is_vnni_supported", lambda f: f == "avx512_vnni"),
              ("_is_avx512_bf16_supported", lambda f: f == "avx512_bf16"),
              ("_is_amx_tile_supported", lambda f: f.startswith("amx")))
    denied: set[str] = set()
    for probe, covers in probes:
        fn = getattr(tc, probe, None)
        if fn is not None and not fn():
            denied |= {f for f in flags if covers(f)}
    return denied


def choose(flags: set[str], machine: str | None = None, available=None) -> Variant | None:
    """The best variant this CPU can run (among `available` names, if given), or None."""
    machine = machine or platform.machine()
    for v in VARIANTS:
        if v.machine == machine and set(v.needs) <= flags and (available is None or v.name in available):
            return v
    return None


def missing_flags(v: Variant, flags: set[str]) -> list[str]:
    return [f for f in v.needs if f not in flags]


def prebuilt_manifest() -> dict | None:
    """What the installed package carries: {"torch": version, "variants": [names]}, or None (a source checkout)."""
    try:
        with open(os.path.join(PREBUILT, "manifest.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def prebuilt_library(name: str) -> str:
    return os.path.join(PREBUILT, name, LIBRARY)


def source_hash(*extra: str) -> str:
    """A key for a build: the sources, the torch it links and `extra` (for a cached build, its whole ninja file:
    flags and source folder, so two checkouts never rebuild one library in place under a process that loaded it)."""
    import torch

    key = hashlib.sha256("\0".join((torch.__version__, platform.machine()) + extra).encode())
    for name in SOURCES + HEADERS:
        with open(os.path.join(CSRC, name), "rb") as f:
            key.update(f.read())
    return key.hexdigest()[:16]


def _ninja() -> str:
    """The ninja binary (the `ninja` package puts one beside the venv's python)."""
    found = shutil.which("ninja") or shutil.which("ninja", path=os.path.dirname(sys.executable))
    if found is None:
        raise RuntimeError("ninja not found (pip install ninja)")
    return found


def _build_ninja(label: str, march: tuple[str, ...]) -> str:
    """The ninja file of one build: the flags torch's cpp_extension uses for a CPU extension, plus ours. Its text is
    part of a cached build's key (`cache_dir`): a build is never changed in place under a process that loaded it."""
    import sysconfig

    import torch
    from torch.utils import cpp_extension

    includes = cpp_extension.include_paths() + [sysconfig.get_paths()["include"]]
    cflags = (["-DTORCH_API_INCLUDE_EXTENSION_H", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               f'-DTPSERVE_BUILD=\\"{label}\\"']
              + [f"-isystem {p}" for p in includes] + ["-fPIC", "-std=c++20", *COMMON_CFLAGS, *march])
    ldflags = (["-shared", "-fopenmp"] + [f"-L{p}" for p in cpp_extension.library_paths()]
               + ["-lc10", "-ltorch_cpu", "-ltorch"])  # no libtorch_python: the ops register through TORCH_LIBRARY
    objects = [os.path.splitext(s)[0].replace("/", "_") + ".o" for s in SOURCES]  # core/x.cpp -> core_x.o
    lines = ["ninja_required_version = 1.3", f"cxx = {os.environ.get('CXX', 'c++')}",
             "cflags = " + " ".join(cflags), "ldflags = " + " ".join(ldflags),
             "rule compile", "  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out", "  depfile = $out.d",
             "  deps = gcc", "rule link", "  command = $cxx $in $ldflags -o $out"]
    lines += [f"build {o}: compile {os.path.join(CSRC, s)}" for o, s in zip(objects, SOURCES)]
    lines += [f"build {LIBRARY}: link {' '.join(objects)}", f"default {LIBRARY}"]
    return "\n".join(lines) + "\n"


def build_library(build_dir: str, label: str, march: tuple[str, ...], verbose: bool = False) -> str:
    """Compile the sources with these -march flags into build_dir/tpserve_kernels.so (ninja, a job per core; a
    finished build is reused) and return its path. Nothing is loaded: a build for a CPU level this host lacks must
    never run here. Ranks that call it at once take turns on a lock file: the first compiles, the others find the
    library built."""
    import fcntl

    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, "lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        text = _build_ninja(label, march)
        path = os.path.join(build_dir, "build.ninja")
        if not os.path.exists(path):  # (its text is in the folder's key: an existing one is this one)
            with open(path, "w") as f:
                f.write(text)
        p = subprocess.run([_ninja(), "-C", build_dir, "-j", str(os.cpu_count() or 1)]
                           + (["-v"] if verbose else []), capture_output=not verbose, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"building the CPU kernels ({' '.join(march)}) failed:\n"
                               + ((p.stdout or "") + (p.stderr or ""))[-4000:])
    return os.path.join(build_dir, LIBRARY)


def compile_and_load(build_dir: str, label: str, march: tuple[str, ...], verbose: bool = False) -> str:
    """`build_library`, then load it into this process (the caller made sure this CPU runs these flags); its path."""
    import torch

    path = build_library(build_dir, label, march, verbose)
    torch.ops.load_library(path)
    return path


def check_library(path: str, v: Variant, flags: set[str] | None = None) -> str:
    """Check a build of variant v: where this CPU runs it, load it in a child process, which must register the ops
    and name the variant ("loaded"); elsewhere, read its dynamic symbols without running any of it: it must define
    the entry point, and (where `ldd` exists) every symbol it needs must resolve against torch ("symbols").
    Raises RuntimeError with what was wrong."""
    flags = cpu_flags() if flags is None else flags
    if v.machine == platform.machine() and not missing_flags(v, flags):
        code = ("import sys, ctypes, torch; torch.ops.load_library(sys.argv[1]); "
                "assert hasattr(torch.ops.tpserve, 'paged_decode_attention'), 'no ops registered'; "
                "f = ctypes.CDLL(sys.argv[1]).tpserve_kernels_build; f.restype = ctypes.c_char_p; "
                "print(f().decode())")
        p = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=600)
        if p.returncode != 0 or p.stdout.strip() != v.name:
            raise RuntimeError(f"the {v.name} build does not load: {(p.stderr or p.stdout)[-2000:]}")
        return "loaded"
    nm = shutil.which("nm")
    if nm is None:
        raise RuntimeError(f"cannot check the {v.name} build: this CPU cannot run it and there is no `nm`")
    symbols = subprocess.run([nm, "-D", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    if " tpserve_kernels_build" not in symbols or "paged_decode_attention" not in symbols:
        raise RuntimeError(f"the {v.name} build lacks its entry points")
    ldd = shutil.which("ldd")
    if ldd is not None and v.machine == platform.machine():
        from torch.utils import cpp_extension

        env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(
            cpp_extension.library_paths() + [os.environ.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep))
        out = subprocess.run([ldd, "-r", path], capture_output=True, text=True, env=env)
        bad = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if "undefined symbol" in ln
               or "not found" in ln]
        if out.returncode != 0 or bad:
            raise RuntimeError(f"the {v.name} build does not link: {'; '.join(bad)[:2000] or out.stderr[-2000:]}")
    return "symbols"


def cache_dir(label: str, march: tuple[str, ...]) -> str:
    """$TPSERVE_HOME/kernels/tpserve_kernels-<label>-<hash>: the JIT build of one set of flags. A -march=native
    build is only valid on the CPU it was made for, so its key holds the CPU's flags too."""
    extra = (_build_ninja(label, march),) + ((" ".join(sorted(cpu_flags())),) if "-march=native" in march else ())
    return os.path.join(envs.HOME.get(), "kernels", f"tpserve_kernels-{label}-{source_hash(*extra)}")


def build_variant(name: str, out_dir: str, verbose: bool = False, flags: set[str] | None = None) -> tuple[str, str]:
    """Compile one variant and copy its library to out_dir/<name>/tpserve_kernels.so, checked (`check_library`).
    Returns (that path, how it was checked)."""
    v = BY_NAME[name]
    with tempfile.TemporaryDirectory(prefix=f"tpserve-{name}-") as tmp:
        built = build_library(tmp, name, v.march, verbose)
        how = check_library(built, v, flags)
        dest = os.path.join(out_dir, name)
        os.makedirs(dest, exist_ok=True)
        shutil.copy2(built, os.path.join(dest, LIBRARY))
    return os.path.join(dest, LIBRARY), how


def build_prebuilt(out_dir: str, names: list[str], verbose: bool = False, flags: set[str] | None = None) -> dict:
    """Compile `names` into out_dir and write its manifest.json (what `prebuilt_manifest` reads back), with how each
    build was checked."""
    import torch

    shutil.rmtree(out_dir, ignore_errors=True)  # an earlier build's variants must not ride along
    os.makedirs(out_dir)
    checked = {}
    for name in names:
        _, checked[name] = build_variant(name, out_dir, verbose, flags)
        print(f"tpserve: kernel variant {name} built, checked by " + (
            "loading it" if checked[name] == "loaded" else "its symbols (this CPU cannot run it)"), file=sys.stderr)
    manifest = {"torch": torch.__version__, "machine": platform.machine(), "variants": names,
                "sources": source_hash(), "checked": checked}
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def variants_to_build(spec: str, machine: str | None = None) -> list[str]:
    """TPSERVE_BUILD_VARIANTS for a wheel: "all" (every variant of this machine's architecture), "none", "host"
    (the one this CPU would choose) or a comma-separated list of names."""
    machine = machine or platform.machine()
    spec = spec.strip() or "all"
    if spec == "none":
        return []
    if spec == "all":
        return [v.name for v in VARIANTS if v.machine == machine]
    if spec == "host":
        v = choose(cpu_flags(), machine)
        if v is None:
            raise ValueError(f"TPSERVE_BUILD_VARIANTS=host: no kernel variant runs on this CPU ({machine})")
        return [v.name]
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(f"TPSERVE_BUILD_VARIANTS: unknown variant(s) {', '.join(unknown)}; known: "
                         f"{', '.join(BY_NAME)}, or all, host, none")
    return names


def main(argv: list[str] | None = None) -> int:
    """`python -m sharding.cpu.variants [--out DIR] [VARIANTS]`: build variants (default: all of this architecture)
    into DIR (default: the package's prebuilt/ folder); `--show` prints what this CPU would run."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m sharding.cpu.variants", description=main.__doc__)
    ap.add_argument("variants", nargs="?", default="all", help="all, host, none, or names separated by commas")
    ap.add_argument("--out", default=PREBUILT)
    ap.add_argument("--show", action="store_true", help="print the variant this CPU chooses and the prebuilt ones")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.show:
        v = choose(cpu_flags())
        print(json.dumps({"cpu_chooses": v and v.name, "prebuilt": prebuilt_manifest()}))
        return 0
    try:
        names = variants_to_build(args.variants)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(build_prebuilt(args.out, names, args.verbose)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
