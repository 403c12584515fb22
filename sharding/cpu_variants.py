"""Which build of the compiled CPU kernels (sharding/csrc/) a process runs, and how each build is made.

The kernels are compiled once per CPU level ("variant"), each from the same sources with its own `-march`, the way
llama.cpp's GGML_CPU_ALL_VARIANTS builds its CPU backend: the `#if __AVX512F__` / `__AVX512VNNI__` /
`__AVX512BF16__` branches of the sources decide what a level runs. A wheel (`setup.py`) and the Docker image carry
the variants prebuilt under `sharding/prebuilt/`; at start the best one this CPU can run is chosen from its flags
(`choose`). Every source registers its ops into one `TORCH_LIBRARY_FRAGMENT(tpserve)`, so a process loads one
variant, before any op is used.

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

CSRC = os.path.join(os.path.dirname(__file__), "csrc")
SOURCES = ("paged_attention.cpp", "quant_linear.cpp", "rms_norm.cpp", "rotary.cpp", "decode_glue.cpp",
           "f32_linear.cpp")
HEADERS = ("tpserve_kernels.h",)  # shared by the sources: part of a build's hash
PREBUILT = os.path.join(os.path.dirname(__file__), "prebuilt")  # manifest.json + <variant>/tpserve_kernels.so
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
# section 14), and any AVX-512 core's tuning (icelake-server, sapphirerapids, znver3) gave it back.
VARIANTS = (
    # Zen 4 / Zen 5, Sapphire Rapids and later: int8/int4 activations in int8 (vpdpbusd), bf16 ones in bfloat16
    Variant("x86-64-v4-vnni-bf16", "x86_64", _V4 + ("avx512_vnni", "avx512_bf16"),
            ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mtune=icelake-server")),
    # AVX-512 without VNNI/BF16 (Skylake-X, Cascade Lake): the AVX-512 float32 paths, float32 activations for
    # int8/int4/bf16
    Variant("x86-64-v4", "x86_64", _V4, ("-march=x86-64-v4", "-mtune=skylake-avx512")),
    # AVX2 + FMA (Haswell and later, Zen 1-3): the portable loops, vectorized by the compiler
    Variant("x86-64-v3", "x86_64", _V3, ("-march=x86-64-v3",)),
    # every 64-bit ARM CPU has NEON (the portable loops, vectorized by the compiler)
    Variant("armv8-a", "aarch64", ("asimd",), ("-march=armv8-a",)),
)
BY_NAME = {v.name: v for v in VARIANTS}


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (x86 `flags`, ARM `Features`); empty elsewhere. Linux drops the
    AVX-512 flags when the OS does not save their registers, so a flag listed here is usable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


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
    """A key for a build: the sources, the torch it links and the flags (a cached build is reused only if all match)."""
    import torch

    key = hashlib.sha256("\0".join((torch.__version__, platform.machine()) + extra).encode())
    for name in SOURCES + HEADERS:
        with open(os.path.join(CSRC, name), "rb") as f:
            key.update(f.read())
    return key.hexdigest()[:16]


def compile_and_load(build_dir: str, march: tuple[str, ...], verbose: bool = False) -> None:
    """Compile the sources with these -march flags into build_dir (ninja, one job per core; a finished build is
    reused) and load the library into this process. Every rank may call it at once: torch's build lock lets one
    compile while the others wait for it."""
    from torch.utils.cpp_extension import load

    os.makedirs(build_dir, exist_ok=True)
    load(name="tpserve_kernels", sources=[os.path.join(CSRC, s) for s in SOURCES],
         extra_cflags=list(COMMON_CFLAGS + march), extra_ldflags=["-fopenmp"], build_directory=build_dir,
         is_python_module=False, verbose=verbose)


def cache_dir(label: str, march: tuple[str, ...]) -> str:
    """$TPSERVE_HOME/kernels/tpserve_kernels-<label>-<hash>: the JIT build of one set of flags. A -march=native
    build is only valid on the CPU it was made for, so its key holds the CPU's flags too."""
    extra = COMMON_CFLAGS + march + ((" ".join(sorted(cpu_flags())),) if "-march=native" in march else ())
    home = os.environ.get("TPSERVE_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "tpserve")
    return os.path.join(home, "kernels", f"tpserve_kernels-{label}-{source_hash(*extra)}")


def build_variant(name: str, out_dir: str, verbose: bool = False) -> str:
    """Compile one variant in a child process (a process can load only one: the ops register once) and copy its
    library to out_dir/<name>/tpserve_kernels.so. Returns that path."""
    v = BY_NAME[name]
    with tempfile.TemporaryDirectory(prefix=f"tpserve-{name}-") as tmp:
        code = ("import sys; from sharding.cpu_variants import compile_and_load; "
                "compile_and_load(sys.argv[1], tuple(sys.argv[3:]), verbose=sys.argv[2] == '1')")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))] + os.environ.get("PYTHONPATH", "").split(
                os.pathsep)).rstrip(os.pathsep))
        subprocess.run([sys.executable, "-c", code, tmp, "1" if verbose else "0", *v.march],
                       check=True, env=env)
        dest = os.path.join(out_dir, name)
        os.makedirs(dest, exist_ok=True)
        shutil.copy2(os.path.join(tmp, LIBRARY), os.path.join(dest, LIBRARY))
    return os.path.join(dest, LIBRARY)


def build_prebuilt(out_dir: str, names: list[str], verbose: bool = False) -> dict:
    """Compile `names` into out_dir and write its manifest.json (what `prebuilt_manifest` reads back)."""
    import torch

    shutil.rmtree(out_dir, ignore_errors=True)  # an earlier build's variants must not ride along
    os.makedirs(out_dir)
    for name in names:
        build_variant(name, out_dir, verbose)
    manifest = {"torch": torch.__version__, "machine": platform.machine(), "variants": names,
                "sources": source_hash()}
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
    """`python -m sharding.cpu_variants [--out DIR] [VARIANTS]`: build variants (default: all of this architecture)
    into DIR (default: the package's prebuilt/ folder); `--show` prints what this CPU would run."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m sharding.cpu_variants", description=main.__doc__)
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
