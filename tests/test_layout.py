"""The package layout keeps its promises: arrows point one way (server -> sharding -> loaders) and no module imports
itself back through others, at module level or inside a function."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("loaders", "sharding", "server")
RANK = {"loaders": 0, "sharding": 1, "server": 2}


def modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules a file imports anywhere in it (`from a.b import c` counts a.b.c when that is a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in known:
                out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known}
    return out


def test_arrows_point_one_way_and_no_cycle_remains():
    known = modules()
    graph = {m: imports(p, known) - {m} for m, p in known.items()}
    upward = sorted(f"{m} -> {d}" for m, ds in graph.items() for d in ds
                    if RANK[d.split(".")[0]] > RANK[m.split(".")[0]])
    assert not upward, upward

    cycles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_every_model_declares_the_model_interface():
    """Every registered architecture is a CausalLM (sharding/models/interface.py) with nothing left abstract, and every
    layer class that reads checkpoint tensors or transforms its weight says so by its base (sharding/layers/interface.py):
    the runner finds what to load, quantize and pack by those declarations, so an undeclared one would be skipped."""
    import importlib
    import inspect

    from torch import nn

    from sharding.layers.interface import Loadable, Packable
    from sharding.models import MODELS
    from sharding.models.interface import CausalLM

    for arch, cls in MODELS.items():
        assert issubclass(cls, CausalLM), f"{arch}: {cls.__name__} does not derive from CausalLM"
        assert not inspect.isabstract(cls), f"{arch}: {cls.__name__} leaves {sorted(cls.__abstractmethods__)} abstract"
    undeclared = []
    for name in sorted(m for m in modules() if m.startswith("sharding.")):
        for _, cls in inspect.getmembers(importlib.import_module(name), inspect.isclass):
            if not issubclass(cls, nn.Module) or not cls.__module__.startswith("sharding."):
                continue
            if (hasattr(cls, "expected") or hasattr(cls, "load")) and not issubclass(cls, Loadable):
                undeclared.append(f"{cls.__module__}.{cls.__name__} (expected/load, not Loadable)")
            if (hasattr(cls, "quantize") or hasattr(cls, "prepack")) and not issubclass(cls, Packable):
                undeclared.append(f"{cls.__module__}.{cls.__name__} (quantize/prepack, not Packable)")
    assert not undeclared, undeclared


def test_decode_plan_declarations_match_the_overrides():
    """A layer class that declares the CPU decode plan's shape (`llama_shaped`, sharding/cpu/decode_plan.py) keeps
    Llama's methods the plan replaces; one that overrides any of them must say False (the plan would otherwise run
    Llama's arithmetic in place of its own, silently)."""
    from sharding.models import MODELS
    from sharding.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

    replaced = {LlamaDecoderLayer: ("forward",), LlamaAttention: ("forward", "project_qkv", "norm_qk"),
                LlamaMLP: ("forward", "act")}
    wrong = []
    for arch, model in MODELS.items():
        layer = getattr(model, "layer_cls", None)
        if layer is None:
            continue  # not Llama-shaped at all (GPT-2): never on the plan
        for cls, base in ((layer, LlamaDecoderLayer), (layer.attention_cls, LlamaAttention), (layer.mlp_cls, LlamaMLP)):
            changed = [m for m in replaced[base] if getattr(cls, m) is not getattr(base, m)]
            if cls.llama_shaped and changed:
                wrong.append(f"{arch}: {cls.__name__} overrides {changed} but declares llama_shaped")
    assert not wrong, wrong
