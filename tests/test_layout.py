"""The package layout keeps its promises: arrows point one way (server -> sharding -> loaders) and no module imports
itself back through others, at module level or inside a function."""

import ast
import re
from pathlib import Path

import pytest

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


# --- environment variables: every TPSERVE_* is read in loaders/envs.py, and README.md lists them ---

SETTINGS = "loaders.envs"
NAME = re.compile(r"TPSERVE_[A-Z0-9_]+")
NOT_ENV = {"TPSERVE_BUILD"}  # a C preprocessor define the kernel build passes (sharding/cpu/variants.py)


def _is_environ(node: ast.AST) -> bool:
    """os.environ (or `environ` imported from os)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (isinstance(node, ast.Name)
                                                                            and node.id == "environ")


def _env_keys(tree: ast.AST):
    """(line, key expression) of every read of the environment: os.environ.get/pop/setdefault(k), os.environ[k],
    k in os.environ, os.getenv(k)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault") and _is_environ(f.value)) \
                    or (isinstance(f, ast.Attribute) and f.attr == "getenv") \
                    or (isinstance(f, ast.Name) and f.id == "getenv"):
                yield node.lineno, node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            yield node.lineno, node.slice
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            yield node.lineno, node.left


def _mentions_tpserve(key: ast.AST) -> bool:
    """A key naming a TPSERVE_ variable: a literal, an f-string starting with it, or anything taken from envs."""
    for n in ast.walk(key):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("TPSERVE_"):
            return True
        if isinstance(n, ast.Name) and n.id == "envs":
            return True
    return False


def _strings(tree: ast.AST):
    """(line, text) of every string constant that is not a docstring."""
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
            yield n.lineno, n.value


def test_tpserve_environment_variables_are_read_in_one_module():
    from loaders import envs

    known = modules()
    reads, names, unknown = [], [], []
    for mod, path in sorted(known.items()):
        tree = ast.parse(path.read_text())
        if mod != SETTINGS:
            reads += [f"{path.relative_to(ROOT)}:{line}" for line, key in _env_keys(tree) if _mentions_tpserve(key)]
            names += [f"{path.relative_to(ROOT)}:{line}: {text!r}" for line, text in _strings(tree)
                      if NAME.fullmatch(text)]
        unknown += [f"{path.relative_to(ROOT)}: {n}" for n in sorted(set(NAME.findall(path.read_text())))
                    if n not in envs.VARIABLES and n not in NOT_ENV]
    assert not reads, f"read TPSERVE_* through loaders/envs.py, not os.environ: {reads}"
    assert not names, f"name TPSERVE_* variables by loaders.envs (`envs.X.name`), not a literal: {names}"
    assert not unknown, f"TPSERVE_* names loaders/envs.py does not define: {unknown}"


def test_the_readme_lists_every_environment_variable():
    from loaders import envs

    text = (ROOT / "README.md").read_text()
    start, end = "<!-- envs table: python -m loaders.envs -->\n", "<!-- /envs table -->"
    assert start in text and end in text, "README.md lost the markers around the environment variables' table"
    table = text.split(start, 1)[1].split(end, 1)[0]
    assert table == envs.markdown_table(), ("README.md's environment variables differ from loaders/envs.py; paste "
                                            "`python -m loaders.envs` between the markers:\n" + envs.markdown_table())


def test_settings_read_lazily_with_their_defaults(monkeypatch):
    from loaders import envs

    monkeypatch.delenv("TPSERVE_THREADS", raising=False)
    assert envs.THREADS.get() == 0
    monkeypatch.setenv("TPSERVE_THREADS", " 3 ")
    assert envs.THREADS.get() == 3
    monkeypatch.setenv("TPSERVE_PP_LAYER_PARTITION", "")
    assert envs.PP_LAYER_PARTITION.get() is None  # empty counts as unset
    monkeypatch.setenv("HOME", "/nowhere")
    monkeypatch.delenv("TPSERVE_HOME", raising=False)
    assert str(envs.HOME.get()) == "/nowhere/.cache/tpserve"  # "~" expands when read, not at import
    monkeypatch.setenv("TPSERVE_NORM_KERNEL", "0")
    assert envs.NORM_KERNEL.get() is False and envs.ROTARY_KERNEL.get() is True
    monkeypatch.setenv("TPSERVE_SHM_ALLREDUCE", "yes")
    with pytest.raises(ValueError, match="0 .off. or 1"):
        envs.SHM_ALLREDUCE.get()


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
    Llama's methods the plan replaces, or declares what its override changes (per-head q/k norms: plan_qk_norms; the
    norms around the feed-forward: plan_norms; the MLP's activation: plan_activation); one that overrides any of them
    otherwise must say False (the plan would run Llama's arithmetic in place of its own, silently)."""
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
            declared = {"norm_qk": (LlamaAttention, "plan_qk_norms"), "act": (LlamaMLP, "plan_activation")}
            if base is LlamaAttention and cls.plan_whole_qk_norms is not LlamaAttention.plan_whole_qk_norms:
                # whole-projection q/k norms and clip_qkv (OLMoE)
                declared.update(norm_qk=(LlamaAttention, "plan_whole_qk_norms"),
                                project_qkv=(LlamaAttention, "plan_whole_qk_norms"))
            if base is LlamaDecoderLayer:
                declared["forward"] = (LlamaDecoderLayer, "plan_norms")
            for method, (owner, declaration) in declared.items():
                if method in changed and getattr(cls, declaration) is not getattr(owner, declaration):
                    changed.remove(method)  # declared to the plan
            if cls.llama_shaped and changed:
                wrong.append(f"{arch}: {cls.__name__} overrides {changed} but declares llama_shaped")
    assert not wrong, wrong


def test_every_package_ships_in_the_wheel():
    """Each folder with an __init__.py under loaders/, sharding/ and server/ is in pyproject.toml's package list (a
    package left out installs without it: the Docker image's server then fails to start)."""
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"([a-z_.]+)"', re.search(r"\npackages = \[(.*?)\]", text, re.S).group(1)))
    found = {".".join(p.parent.relative_to(ROOT).parts) for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")}
    assert found == listed, (found - listed, listed - found)
