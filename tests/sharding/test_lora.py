"""LoRA adapters (sharding/layers/lora.py, loaders/adapters.py) against transformers + PEFT.

Random non-zero adapters (PEFT initialises lora_B to zero, so both matrices are randomised) on tiny random Llama and
Phi-3 (fused qkv_proj / gate_up_proj) checkpoints. Each TP degree starts its ranks once (tests/helpers/lora_ranks.py:
sharding.runner.start_rank on every rank, adapters loaded through LoraManager on every rank, rank 0 driving
Executor.run with hand-built steps) and runs every job: rows of the base model and of two adapters in the same steps,
then each prompt alone (batch 1: the decode fast path, the compiled one-call step at TP=1 for base rows). Greedy
tokens must equal PEFT's and log-probabilities agree within 1e-4 (fp32); under int8 weights, PEFT runs over the
quantize-dequantize round trip of the base weights (as tests/sharding/test_quant.py does).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loaders.checkpoint import Checkpoint
from loaders.adapters import LoraError, read_adapter
from server.engine.lora_registry import validate_adapter
from sharding.layers.lora import decode_load, encode_load
from sharding.layers.lora_rows import lora_rows
from sharding.wire import LOGITS_LAST, lora_slot, with_lora
import tiny
from tiny import config_variant, make_checkpoint

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "helpers" / "lora_ranks.py"
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(30, 47)), [100, 3, 250, 17]]
MAX_TOKENS = 8
LLAMA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, folder: Path, seed: int, std: float = 0.15, **lora_kw) -> Path:
    """A PEFT LoRA adapter of `base` with random A and B, saved with save_pretrained (safetensors)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    kw = dict(r=8, lora_alpha=16, lora_dropout=0.0)
    kw.update(lora_kw)
    peft_model = get_peft_model(model, LoraConfig(**kw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    peft_model.save_pretrained(str(folder))
    return folder


def reference(base: Path, adapter: Path | None, prompt: list[int], n: int, int8_tp: int | None = None,
              adapter_bf16: bool = False):
    """PEFT's greedy tokens and log-softmax rows; int8_tp: over int8-round-tripped base linears, as `tp` ranks
    quantize their shards (tests/sharding/test_quant.py); adapter_bf16: with the adapter's A and scaled B rounded to
    bfloat16, as tpserve holds an adapter over a quantized base (sharding/layers/lora.py)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model.generation_config.eos_token_id = None
    if int8_tp is not None:
        from sharding.layers import quant
        from test_quant import as_kernel_sees

        with torch.no_grad():
            for name, mod in model.named_modules():
                if isinstance(mod, torch.nn.Linear):
                    w = mod.weight
                    parts = w.chunk(int8_tp, dim=1) if name.endswith(("o_proj", "down_proj")) else [w]
                    mod.weight.copy_(torch.cat([quant.dequantize(quant.quantize(p, "int8", 32)) for p in parts], 1))
                    mod.register_forward_pre_hook(
                        lambda _m, args, k=len(parts): (torch.cat([as_kernel_sees(c.reshape(-1, c.shape[-1]), "int8")
                                                                   for c in args[0].chunk(k, dim=-1)], -1)
                                                        .reshape(args[0].shape),))
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
        if adapter_bf16:
            with torch.no_grad():
                for mod in model.modules():
                    if hasattr(mod, "lora_A") and "default" in mod.lora_A:
                        a, b, s = mod.lora_A["default"].weight, mod.lora_B["default"].weight, mod.scaling["default"]
                        a.copy_(a.to(torch.bfloat16).float())
                        b.copy_((b * s).to(torch.bfloat16).float() / s)
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.log_softmax(torch.stack(out.logits, 0)[:, 0].float(), dim=-1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tp: int, jobs: list[dict], tmp: Path, timeout: float = 240) -> tuple[dict, list[dict]]:
    """Start `tp` rank processes of the harness on `jobs`; rank 0's results and each rank's bytes read."""
    out = tmp / f"out_tp{tp}.json"
    spec = tmp / f"spec_tp{tp}.json"
    spec.write_text(json.dumps({"out": str(out), "jobs": jobs}))
    port = free_port()
    procs = []
    for r in range(tp):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(tp), LOCAL_WORLD_SIZE=str(tp),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TPSERVE_STORE_PORT=str(port),
                   TPSERVE_STORE_SECRET="hand-made-ranks-" + str(port), TPSERVE_THREADS="1",
                   TPSERVE_COLLECTIVE_TIMEOUT="60", PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen([sys.executable, str(HARNESS), str(spec)], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-6000:]
    reads = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(tp)]
    return json.loads(out.read_text()), reads


# ---- checkpoints and adapters, shared by the module ------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    # intermediate 128: every linear's shard at TP 2 has a multiple of 32 inputs, so int8 quantizes every one
    llama = make_checkpoint(tmp / "llama", "llama", intermediate_size=128)
    with pytest.MonkeyPatch.context() as mp:  # fused qkv_proj / gate_up_proj, GQA, half the head dim rotated
        mp.setitem(tiny.ARCHS, "phi3_lora", dict(cls="Phi3Config", num_attention_heads=8, num_key_value_heads=2,
                                                 partial_rotary_factor=0.5))
        phi3 = make_checkpoint(tmp / "phi3", "phi3_lora")
    m = {"llama": llama, "phi3": phi3, "tmp": tmp}
    # every linear, plain scaling
    m["a1"] = make_adapter(llama, tmp / "a1", seed=1, target_modules=LLAMA_ALL)
    # rsLoRA, per-module ranks and alphas, and only some pieces of the fused q/k/v and gate/up linears
    m["a2"] = make_adapter(llama, tmp / "a2", seed=2, r=4, lora_alpha=6, use_rslora=True,
                           target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                           rank_pattern={"q_proj": 8, "layers.1.mlp.down_proj": 2},
                           alpha_pattern={"v_proj": 3, "o_proj": 11})
    m["p1"] = make_adapter(phi3, tmp / "p1", seed=3, target_modules=["qkv_proj", "o_proj", "gate_up_proj",
                                                                     "down_proj"])
    m["p2"] = make_adapter(phi3, tmp / "p2", seed=4, r=4, lora_alpha=8, target_modules=["qkv_proj", "down_proj"])
    return m


@pytest.fixture(scope="module")
def references(models):
    """PEFT's (tokens, logprobs) per (model, adapter, prompt); the adapters' outputs differ from the base's."""
    refs = {}
    for base, adapters in (("llama", (None, "a1", "a2")), ("phi3", (None, "p1", "p2"))):
        for a in adapters:
            for i, p in enumerate(PROMPTS):
                refs[(base, a, i)] = reference(models[base], models[a] if a else None, p, MAX_TOKENS)
    for base, a1, a2 in (("llama", "a1", "a2"), ("phi3", "p1", "p2")):
        assert any(refs[(base, None, i)][0] != refs[(base, a1, i)][0] for i in range(len(PROMPTS)))
        assert any(refs[(base, a2, i)][0] != refs[(base, a1, i)][0] for i in range(len(PROMPTS)))
    return refs


SLOTS = {"llama": [None, "a1", "a2"], "phi3": [None, "p1", "p2"]}  # slot -> adapter


def jobs_for(models, tp: int) -> list[dict]:
    jobs = []
    for base in ("llama", "phi3"):
        ops = [["load", s, str(models[a])] for s, a in enumerate(SLOTS[base]) if a]
        runs = [{"prompts": PROMPTS, "slots": [0, 1, 2], "max_tokens": MAX_TOKENS, "together": True},
                {"prompts": PROMPTS, "slots": [0, 1, 2], "max_tokens": MAX_TOKENS, "together": False}]
        jobs.append({"model": str(models[base]), "ops": ops, "runs": runs})
    return jobs


def check_run(run: dict, base: str, refs, slot_names: list, tol: float = 1e-4) -> None:
    for i, (tokens, logprobs) in enumerate(zip(run["tokens"], run["logprobs"], strict=True)):
        ref_tokens, ref_lp = refs(base, slot_names[i], i)
        assert tokens == ref_tokens, (base, slot_names[i], i)
        worst = float((torch.tensor(logprobs) - ref_lp).abs().max())
        assert worst < tol, (base, slot_names[i], i, worst)


_RESULTS: dict = {}


def tp_results(models, tp: int):
    if tp not in _RESULTS:
        _RESULTS[tp] = run_ranks(tp, jobs_for(models, tp), models["tmp"])
    return _RESULTS[tp]


@pytest.mark.parametrize("tp", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_mixed_steps_and_batch_one_equal_peft(models, references, tp):
    """Base rows and rows of two adapters in one step, then each alone (batch 1), on Llama (every linear; rsLoRA with
    rank and alpha patterns on some pieces of the fused linears) and Phi-3 (fused qkv_proj / gate_up_proj), at TP
    1-3 (TP 3: uneven head split, KV heads replicated)."""
    result, reads = tp_results(models, tp)
    for job, base in zip(result["jobs"], ("llama", "phi3")):
        together, alone = job["runs"]
        # every step of the mixed run held base rows and both adapters' rows, and the linears saw them
        assert all(s == [0, 1, 2] for s in together["step_slots"]), together["step_slots"]
        check_run(together, base, lambda b, a, i: references[(b, a, i)], SLOTS[base])
        for slot, steps in enumerate(alone["step_slots"]):
            assert all(s == [slot] for s in steps)
        check_run(alone, base, lambda b, a, i: references[(b, a, i)], SLOTS[base])
        if tp == 1 and base == "llama":  # (Phi-3's partial rotary keeps it off the fast path)
            assert job["compiled_decode"], "the compiled one-call decode step should still serve base-only steps"
    # each rank read only its blocks: at TP > 1 less than the whole adapter, and every rank the same amount or less
    # than TP 1 did
    for base_i, (base, names) in enumerate(SLOTS.items()):
        for slot, a in enumerate(names):
            if a is None:
                continue
            total = read_adapter(models[a]).nbytes
            per_rank = [r[str(slot)] for r in reads] if base_i == 0 else None
            if per_rank is None:
                continue
            assert all(b <= total for b in per_rank)
            if tp > 1:
                assert all(b < total for b in per_rank), (a, per_rank, total)


def test_int8_base(models, tmp_path):
    """int8 base weights (the adapter held in bfloat16), at TP 1 and 2, mixed and alone, against PEFT over the
    round-tripped weights and the rounded adapter."""
    for tp in (1, 2):
        ops = [["load", 1, str(models["a1"])], ["load", 2, str(models["a2"])]]
        runs = [{"prompts": PROMPTS[:2], "slots": [1, 2], "max_tokens": MAX_TOKENS, "together": True},
                {"prompts": PROMPTS[:1], "slots": [1], "max_tokens": MAX_TOKENS, "together": False}]
        result, _ = run_ranks(tp, [{"model": str(models["llama"]), "quantization": "int8", "ops": ops,
                                    "runs": runs}], tmp_path)
        together, alone = result["jobs"][0]["runs"]
        refs = {i: reference(models["llama"], models[a], PROMPTS[i], MAX_TOKENS, int8_tp=tp, adapter_bf16=True)
                for i, a in enumerate(("a1", "a2"))}
        for run, names in ((together, ["a1", "a2"]), (alone, ["a1"])):
            for i, (tokens, lp) in enumerate(zip(run["tokens"], run["logprobs"])):
                ref_tokens, ref_lp = refs[i]
                assert tokens == ref_tokens, (tp, names[i])
                # int8 activations (VNNI) can round one step differently (test_quant: within 2e-2)
                assert float((torch.tensor(lp) - ref_lp).abs().max()) < 2e-2


def test_prequantized_base(tmp_path, monkeypatch):
    """Adapters over a base stored quantized, served as stored: compressed-tensors W4A16 (int4 group 128, symmetric:
    tpserve's int4) and AWQ (zero points: Q4_Z), mixed and alone, against PEFT over the folders' exact values. On
    torch's paths (TPSERVE_KERNELS=none: float32 products) at TP 1 and 2, tokens and log-probabilities within 1e-4.
    (Through the compiled kernels the activations are rounded to int8, which moves this wide random model's
    log-probabilities by up to ~0.5 and flips its near-ties (one margin is 0.005): no exact reference there. The
    adapters' rows in the compiled step over every kernel layout are the same code as over int8 (test_int8_base).)"""
    from helpers import quantized as hq

    src = hq.make_source(tmp_path / "src" / "base")  # (each folder "base": the adapters' base model by name)
    adapters = {"b1": make_adapter(src, tmp_path / "b1", seed=5, target_modules=LLAMA_ALL),
                "b2": make_adapter(src, tmp_path / "b2", seed=6, r=4, target_modules=["q_proj", "down_proj"])}
    ops = [["load", 1, str(adapters["b1"])], ["load", 2, str(adapters["b2"])]]
    runs = [{"prompts": PROMPTS[:2], "slots": [1, 2], "max_tokens": MAX_TOKENS, "together": True},
            {"prompts": PROMPTS[:2], "slots": [1, 2], "max_tokens": MAX_TOKENS, "together": False}]
    for name, folder in (("W4A16", hq.make_compressed_tensors(src, tmp_path / "w4a16" / "base", "W4A16")),
                         ("AWQ", hq.make_awq(src, tmp_path / "awq" / "base"))):
        values = hq.reference_float(folder, tmp_path / f"{name}-values")
        refs = {i: reference(values, adapters[a], PROMPTS[i], MAX_TOKENS, adapter_bf16=True)
                for i, a in enumerate(("b1", "b2"))}
        assert any(reference(values, None, PROMPTS[i], MAX_TOKENS)[0] != refs[i][0] for i in refs), name
        monkeypatch.setenv("TPSERVE_KERNELS", "none")
        for tp in (1, 2):
            result, _ = run_ranks(tp, [{"model": str(folder), "ops": ops, "runs": runs}], tmp_path)
            for run in result["jobs"][0]["runs"]:
                for i, (tokens, lp) in enumerate(zip(run["tokens"], run["logprobs"], strict=True)):
                    assert tokens == refs[i][0], (name, tp, i)
                    assert float((torch.tensor(lp) - refs[i][1]).abs().max()) < 1e-4, (name, tp, i)


def test_unload_and_replace(models, tmp_path):
    """Unloading frees a slot; loading into an occupied slot replaces its adapter."""
    a1, a2 = str(models["a1"]), str(models["a2"])
    ops = [["load", 1, a1], ["load", 2, a2], ["unload", 2], ["load", 2, a2], ["load", 2, a1]]
    runs = [{"prompts": PROMPTS[:2], "slots": [1, 2], "max_tokens": 4, "together": True}]
    result, reads = run_ranks(2, [{"model": str(models["llama"]), "ops": ops, "runs": runs}], tmp_path)
    run = result["jobs"][0]["runs"][0]
    for i in range(2):
        ref_tokens, _ = reference(models["llama"], models["a1"], PROMPTS[i], 4)
        assert run["tokens"][i] == ref_tokens
    assert all(r["held"]["1"] == r["held"]["2"] > 0 for r in reads)


# ---- the step encoding -----------------------------------------------------------------------------------------


def test_flags_carry_the_slot():
    f = with_lora(LOGITS_LAST, 5)
    assert lora_slot(f) == 5 and f & 0xFFFF == LOGITS_LAST
    assert with_lora(LOGITS_LAST, 0) == LOGITS_LAST  # base rows: the flags of before
    flags = torch.tensor([with_lora(1, 2), 1, with_lora(1, 2), with_lora(0, 1)])
    rows = lora_rows(flags, torch.tensor([2, 1, 1, 3]))
    assert rows.token_slots.tolist() == [2, 2, 0, 2, 1, 1, 1]
    assert [(s, i.tolist()) for s, i in rows.groups] == [(1, [4, 5, 6]), (2, [0, 1, 3])]
    assert lora_rows(torch.tensor([1, 1]), None) is None
    one = lora_rows(torch.tensor([with_lora(1, 3)] * 2), None)
    assert one.groups == [(3, None)]  # every token: no gather
    assert decode_load(encode_load(7, "/tmp/ä dir/x", 123456789)) == (7, "/tmp/ä dir/x", 123456789)


# ---- validation ------------------------------------------------------------------------------------------------


def _rewrite_config(src: Path, dst: Path, **fields) -> Path:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(fields)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_validation_errors(models, tmp_path):
    llama = Checkpoint(models["llama"])
    ok = validate_adapter(str(models["a2"]), llama, max_rank=8)
    assert ok.modules["model.layers.0.self_attn.q_proj"].rank == 8
    assert ok.modules["model.layers.1.mlp.down_proj"].rank == 2
    assert ok.modules["model.layers.0.mlp.down_proj"].rank == 4
    assert ok.modules["model.layers.0.self_attn.v_proj"].scale == pytest.approx(3 / 2)  # rsLoRA: alpha / sqrt(r)
    assert ok.modules["model.layers.0.self_attn.o_proj"].scale == pytest.approx(11 / 2)

    def refused(path, match, base=llama, **kw):
        with pytest.raises(LoraError, match=match):
            validate_adapter(str(path), base, max_rank=kw.pop("max_rank", 64), **kw)

    refused(tmp_path / "nowhere", "not a folder")
    refused(models["llama"], "not a PEFT adapter folder: it has no adapter_config.json")
    bin_only = tmp_path / "bin"
    bin_only.mkdir()
    (bin_only / "adapter_config.json").write_text((models["a1"] / "adapter_config.json").read_text())
    (bin_only / "adapter_model.bin").write_bytes(b"\x80\x02pickle")
    refused(bin_only, r"pickled adapter weights \(adapter_model.bin\)")
    refused(models["a1"], r"rank above the maximum LoRA rank 4: .*r=8", max_rank=4)
    refused(models["p1"], "targets modules the model does not have: model.layers.0.mlp.gate_up_proj")
    refused(_rewrite_config(models["a1"], tmp_path / "dora", use_dora=True), "DoRA")
    refused(_rewrite_config(models["a1"], tmp_path / "mts", modules_to_save=["lm_head"]), "modules_to_save")
    refused(_rewrite_config(models["a1"], tmp_path / "other", base_model_name_or_path="meta-llama/Llama-3.1-8B"),
            "was trained on base model 'meta-llama/Llama-3.1-8B'")
    # a renamed copy: its name given, or the name check off
    validate_adapter(str(tmp_path / "other"), llama, 64, base_names=["Llama-3.1-8B"])
    validate_adapter(str(tmp_path / "other"), llama, 64, check_name=False)
    refused(_rewrite_config(models["a1"], tmp_path / "pattern", rank_pattern={"k_proj": 4}),
            "has rank 8 in adapter_model.safetensors but 4")
    # a base of other shapes (same module names)
    wider = Checkpoint(make_checkpoint(tmp_path / "wider", "llama", intermediate_size=96))
    refused(models["a1"], r"does not fit this base model \(shapes differ\).*mlp.down_proj", base=wider,
            check_name=False)
    # MoE experts, LM head
    for name, match in (("model.layers.0.mlp.experts.0.gate_proj", "MoE experts are not LoRA targets yet"),
                        ("lm_head", "cannot adapt: lm_head")):
        fake = tmp_path / name.replace(".", "_")
        fake.mkdir()
        (fake / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2}))
        save_file({f"base_model.model.{name}.lora_A.weight": torch.zeros(2, 64),
                   f"base_model.model.{name}.lora_B.weight": torch.zeros(64, 2)}, str(fake / "adapter_model.safetensors"))
        refused(fake, match)
    # DoRA saved by PEFT itself (magnitude vectors in the file too)
    dora = make_adapter(models["llama"], tmp_path / "dora_peft", seed=5, target_modules=["q_proj"], use_dora=True)
    refused(dora, "DoRA")
    gpt2 = Checkpoint(config_variant(models["llama"], tmp_path / "gpt2", architectures=["GPT2LMHeadModel"]))
    refused(models["a1"], "not supported for GPT2LMHeadModel yet", base=gpt2)
