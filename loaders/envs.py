"""Every TPSERVE_* environment variable tpserve reads, in one place (as vLLM's envs.py): its name, type, default,
what it does and who sets it. Product code (server/, sharding/, loaders/) reads them only through this module
(tests/test_layout.py checks it), and the launcher names the ones it sets for its child ranks with `VAR.name`.

Why in loaders/, the lowest room: every room may import it without an arrow pointing up (tests/test_layout.py), and
loaders itself reads one of them (TPSERVE_HOME, the cache the default model is converted into). A settings module in
sharding/ would make loaders take the cache folder from every caller of `ensure_default_model()` (the CLI, the
Dockerfile, scripts and tests call it without arguments). It holds names, defaults and parsing only: no I/O.

Reading is lazy: `THREADS.get()` looks at os.environ when it is called, so a test's monkeypatch.setenv, or the
environment the launcher gives a child rank, works as if the call site read os.environ itself. When a value is read
stays the call site's choice, as before this module: TPSERVE_KERNELS and the kernel switches once, when a process
loads the kernels (`sharding/cpu/kernels.py`: the per-step path never reads the environment), the dist settings when
a rank joins (`sharding/dist.py`), TPSERVE_PORT when `tpserve serve`'s parser is built, TPSERVE_HOME each time a
cache path is made, TPSERVE_ALLOW_RUNTIME_LORA_UPDATING per request.

An empty value (or only spaces) counts as unset: the default applies.
`python -m loaders.envs` prints the table README.md holds (tests/test_layout.py keeps the two in sync).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")

USER = "user"  # a knob for whoever starts tpserve (ranks a launcher spawns inherit it)
LAUNCHER = "launcher"  # internal: tpserve's launcher sets it for the child ranks it spawns
BUILD = "build"  # read by setup.py while a wheel is built (it cannot import the package), never at run time


@dataclass(frozen=True)
class Var(Generic[T]):
    name: str
    type: str  # as the docs show it
    default: str | None  # the value when unset, parsed like a set one (at each read: "~" expands then); None: None
    shown_default: str  # the default as the docs show it
    set_by: str  # USER, LAUNCHER or BUILD
    doc: str
    parse: Callable[[str], T]  # the stripped, non-empty value -> T (raises ValueError on a bad one)

    def get(self) -> T | None:
        """The value now (os.environ as it is at this call)."""
        raw = os.environ.get(self.name, "").strip() or self.default
        return None if raw is None else self.parse(raw)


VARIABLES: dict[str, Var] = {}


def _var(name: str, type_: str, default: str | None, shown: str | None, set_by: str, doc: str,
         parse: Callable[[str], T]) -> Var[T]:
    """shown: the default as the docs show it (None: `default`)."""
    v = Var(name, type_, default, shown or f"`{default}`", set_by, doc, parse)
    VARIABLES[name] = v
    return v


def _off_if_zero(raw: str) -> bool:
    return raw != "0"


def _shm(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError(f"TPSERVE_SHM_ALLREDUCE must be 0 (off) or 1 (force on), not {raw!r}")
    return raw == "1"


def _numa(raw: str) -> str:
    if raw not in ("auto", "off", "distribute"):
        raise ValueError(f"TPSERVE_NUMA must be auto, off or distribute, not {raw!r}")
    return raw


def _kernel_switch(name: str, what: str) -> Var[bool]:
    return _var(f"TPSERVE_{name}_KERNEL", "0/1", "1", None, USER,
                f"`0`: torch's path instead of the compiled {what}; read once, when the kernels load",
                _off_if_zero)


# --- the server (rank 0) ---
PORT = _var("TPSERVE_PORT", "int", "8000", None, USER,
            "`tpserve serve`'s default `--port` (the Docker image sets it, and its healthcheck probes it)", int)
API_KEY = _var("TPSERVE_API_KEY", "str", None, "none", USER,
               "`tpserve serve`'s API key(s) when `--api-key` is not given", str)
ALLOW_RUNTIME_LORA_UPDATING = _var(
    "TPSERVE_ALLOW_RUNTIME_LORA_UPDATING", "bool (1/true/yes)", "0", "off", USER,
    "enables `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
    lambda raw: raw.lower() in ("1", "true", "yes"))

# --- every rank: the files it reads and writes ---
HOME = _var("TPSERVE_HOME", "path", "~/.cache/tpserve", None, USER,
            "the cache folder: the converted default model (`models/`), kernels compiled at start (`kernels/`) and "
            "quantized weights (`quantized/`)", lambda raw: Path(raw).expanduser())
QUANTIZED_CACHE = _var("TPSERVE_QUANTIZED_CACHE", "path", None, "`$TPSERVE_HOME/quantized`", USER,
                       "where each rank keeps its linears as `--quantization` made them, for later starts to read "
                       "instead of quantizing again (`--no-quantized-cache`: off; docs/quantization.md)",
                       lambda raw: Path(raw).expanduser())
PROGRESS_INTERVAL = _var("TPSERVE_PROGRESS_INTERVAL", "float (s)", "10", None, USER,
                         "seconds between the plain progress lines of a load when stderr is not a terminal", float)

# --- every rank: joining the others ---
THREADS = _var("TPSERVE_THREADS", "int", "0", "cores ÷ ranks on the host", USER,
               "torch threads per rank (0: the default; a rank bound to a NUMA node: the CPUs it got)", int)
NUMA = _var("TPSERVE_NUMA", "str", "auto", None, USER,
            "where a host's CPU ranks run: `auto` (one NUMA node each, or an equal share of one, when the host has "
            "several and the local ranks are a multiple of them), `off`, `distribute` (spread over the nodes "
            "whatever the counts); `tpserve serve --numa` sets it for its ranks (docs/numa.md)", _numa)
PP_LAYER_PARTITION = _var("TPSERVE_PP_LAYER_PARTITION", "str", None, "as even as possible", USER,
                          "decoder layers per pipeline stage, e.g. `3,2` (vLLM's VLLM_PP_LAYER_PARTITION); rank 0 "
                          "checks it before spawning, every rank reads it when it joins", str)
COLLECTIVE_TIMEOUT = _var("TPSERVE_COLLECTIVE_TIMEOUT", "float (s)", "600", None, USER,
                          "seconds the rendezvous and each collective between ranks may take", float)
STORE_SECRET = _var("TPSERVE_STORE_SECRET", "str", None, "made per server", USER,
                    "the secret every rank proves to the ranks' store on rank 0; `tpserve serve` makes one for the "
                    "ranks it spawns, under torchrun set the same on every node (docs/deployment.md)", str)
STORE_SECRET_FILE = _var("TPSERVE_STORE_SECRET_FILE", "path", None, "none", USER,
                         "a file holding that secret, read when `TPSERVE_STORE_SECRET` is not set",
                         lambda raw: Path(raw).expanduser())
STORE_PORT = _var("TPSERVE_STORE_PORT", "int", None, "`MASTER_PORT` + 1 under torchrun", USER,
                  "the port of the ranks' store on rank 0's host (torchrun's own store holds `MASTER_PORT`); "
                  "`tpserve serve` picks a free one for the ranks it spawns", int)
SHM_ALLREDUCE = _var("TPSERVE_SHM_ALLREDUCE", "0/1", None, "auto", USER,
                     "`0` forces gloo for the TP all-reduce, `1` forces shared memory (auto: gloo ranks all on one "
                     "x86-64 host, no more of them than its cores)", _shm)
GENERATION = _var("TPSERVE_GENERATION", "int", "0", None, LAUNCHER,
                  "the generation of a respawned replica's process groups, set by server/cli/launcher.py for its "
                  "ranks", int)

# --- every rank: the CPU kernels and weights ---
KERNELS = _var("TPSERVE_KERNELS", "str", "auto", None, USER,
               "which build of the compiled CPU kernels runs: `auto` (the best prebuilt variant for this CPU, else "
               "one compiled for it at the first start), `native`, a variant such as `x86-64-v3`, or `none` "
               "(torch's own paths); the startup line names what runs (sharding/cpu/variants.py)", str)
PREPACK = _var("TPSERVE_PREPACK", "0/1", "1", None, USER,
               "`0` keeps CPU linears that do not run through the compiled float32 kernel on `F.linear` instead "
               "of oneDNN with weights packed at load", _off_if_zero)
F32_KERNEL = _kernel_switch("F32", "float32 linear (oneDNN runs it then)")
PAGED_KERNEL = _kernel_switch("PAGED", "paged decode attention")
QUANT_KERNEL = _kernel_switch("QUANT", "int8/int4/bf16 linears")
NORM_KERNEL = _kernel_switch("NORM", "RMSNorm")
ROTARY_KERNEL = _kernel_switch("ROTARY", "rotary embedding")
GLUE_KERNEL = _kernel_switch("GLUE", "CPU decode step (every family's) and greedy argmax")
LAYERS_KERNEL = _kernel_switch("LAYERS", "one-call decoder layers (that fast path's form at TP=1)")
MOE_KERNEL = _kernel_switch("MOE", "MoE layer (router, top-k, experts, shared expert)")
HUGE_PAGES = _var("TPSERVE_HUGE_PAGES", "0/1", "1", None, USER,
                  "`0` leaves the weights, the KV cache and the LoRA adapters' copies in 4 KiB pages; by default "
                  "(Linux, transparent huge pages `madvise` or `always`) they move into memory advised for 2 MiB "
                  "pages after load",
                  _off_if_zero)
QUANTIZE_LM_HEAD = _var("TPSERVE_QUANTIZE_LM_HEAD", "str", "1", None, USER,
                        "`0` keeps the LM head unquantized, `same` quantizes it as `--quantization` says (default: "
                        "int8 under int8 and int4, bf16 under bf16)", str)

# --- building a wheel ---
BUILD_VARIANTS = _var("TPSERVE_BUILD_VARIANTS", "str", "all", None, BUILD,
                      "the CPU kernel variants compiled into a wheel: `all`, `host`, `none`, or names separated by "
                      "commas", str)


def markdown_table() -> str:
    """The table of every variable, as README.md holds it."""
    rows = ["| variable | type | default | set by | meaning |", "|---|---|---|---|---|"]
    for v in VARIABLES.values():
        rows.append(f"| `{v.name}` | {v.type} | {v.shown_default} | {v.set_by} | {v.doc} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
