"""Bad checkpoints give an error that names the problem, and nothing hangs: every rank exits."""

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from llm_runner import run_llm


@pytest.fixture(scope="module")
def bad(checkpoints, tmp_path_factory):
    good = checkpoints("llama")
    root = tmp_path_factory.mktemp("bad")
    cases = {}

    def copy(name):
        dst = root / name
        shutil.copytree(good, dst)
        return dst

    cases["missing folder"] = (root / "does-not-exist", "does not exist")
    binonly = root / "bin-only"
    binonly.mkdir()
    shutil.copy(good / "config.json", binonly)
    (binonly / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    cases["bin only"] = (binonly, "safetensors only")
    missing = copy("missing-tensor")
    t = load_file(str(missing / "model.safetensors"))
    del t["model.layers.1.mlp.up_proj.weight"]
    save_file(t, str(missing / "model.safetensors"))
    cases["missing tensor"] = (missing, "missing tensor.*model.layers.1.mlp.up_proj.weight")
    wrong = copy("wrong-shape")
    t = load_file(str(wrong / "model.safetensors"))
    t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:-1].contiguous()
    save_file(t, str(wrong / "model.safetensors"))
    cases["wrong shape"] = (wrong, "shape mismatch.*k_proj")
    arch = copy("unsupported-arch")
    cfg = json.loads((arch / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (arch / "config.json").write_text(json.dumps(cfg))
    cases["unsupported architecture"] = (arch, "not supported; supported: .*LlamaForCausalLM")
    cases["tp above heads"] = (good, "tensor parallel size 9 must be between 1 and the number of attention heads")
    return cases


def test_bad_checkpoints_fail_clearly_at_tp2(bad):
    import re

    names = list(bad)
    jobs = [{"model": str(bad[n][0])} for n in names]
    results = run_llm(2, jobs[:-1], timeout=120) + run_llm(9, jobs[-1:], timeout=120)
    for name, result in zip(names, results):
        assert "error" in result, name
        assert re.search(bad[name][1], result["error"]), (name, result["error"])
