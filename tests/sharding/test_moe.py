"""Mixture-of-experts models (sharding/layers/moe.py): greedy tokens equal transformers' and log-probabilities within 1e-4
(fp32) at TP 1-4, with the experts split tensor-parallel (every expert's intermediate dimension over the ranks) and
expert-parallel (whole experts per rank), both expert layouts a checkpoint may use, and dense and MoE layers mixed.

TP 3 divides neither the expert counts (5, 6), the heads (8) nor the expert intermediate size (40). Each TP degree
and split runs every checkpoint in one fresh process (llm_runner.run_llm).
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import tiny
from llm_runner import run_llm
from test_more_architectures import randomize_vectors
from tiny import check_greedy, config_variant, hf_greedy, make_checkpoint

PROMPTS = [list(range(5, 25)), [7, 3, 90, 14, 200, 31, 6, 55]]
MAX_TOKENS = 24

SPECS: dict[str, dict] = {
    # dense layer 1 between sparse layers 0 and 2 (mlp_only_layers), renormalised top-k, per-head q/k norms
    "qwen3_moe": dict(cls="Qwen3MoeConfig", num_attention_heads=8, num_key_value_heads=4, head_dim=16, num_experts=6,
                      num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True, mlp_only_layers=[1],
                      num_hidden_layers=3),
    # a shared expert with its sigmoid gate, top-3 without renormalisation, every second layer sparse
    "qwen2_moe": dict(cls="Qwen2MoeConfig", num_attention_heads=8, num_key_value_heads=2, num_experts=6,
                      num_experts_per_tok=3, moe_intermediate_size=40, shared_expert_intermediate_size=48,
                      decoder_sparse_step=2, norm_topk_prob=False, num_hidden_layers=4),
    # 5 experts named w1/w3/w2 under block_sparse_moe
    "mixtral": dict(cls="MixtralConfig", num_attention_heads=8, num_key_value_heads=2, num_local_experts=5,
                    num_experts_per_tok=2, intermediate_size=40),
    # q/k norms over the whole projection (a cross-rank mean), KV heads held by several ranks at TP 3 and 4
    "olmoe": dict(cls="OlmoeConfig", num_attention_heads=8, num_key_value_heads=2, num_experts=6,
                  num_experts_per_tok=2, intermediate_size=40, clip_qkv=3.0),
}
LAYOUTS = [*SPECS, "qwen3_moe_fused"]


def fuse_experts(src, dst) -> None:
    """The same model saved with the experts as transformers holds them in memory: 3-D gate_up_proj [E, 2I, H] and
    down_proj [E, H, I] per layer, as some checkpoints store them."""
    shutil.copytree(src, dst)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    (dst / "model.safetensors").unlink()
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref = {}
    for arch, spec in SPECS.items():
        folder = tmp_path_factory.mktemp(arch)
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(tiny.ARCHS, arch, spec)
            make_checkpoint(folder, arch)
        randomize_vectors(folder)
        ref[arch] = (folder, [hf_greedy(folder, p, MAX_TOKENS) for p in PROMPTS])
    fused = tmp_path_factory.mktemp("fused") / "qwen3_moe_fused"
    fuse_experts(ref["qwen3_moe"][0], fused)
    ref["qwen3_moe_fused"] = (fused, ref["qwen3_moe"][1])
    return ref


# (tp, expert parallel): the checkpoints each launch serves. Every architecture runs at TP 1, at TP 2 both ways, and
# at TP 3 and TP 4 one way each (the other way for the next architecture), to keep the suite's launches few; the
# fused layout runs where its expert slices are read (TP 1) and where whole experts are (EP 2, EP 3).
MATRIX = {
    (1, False): LAYOUTS,
    (2, False): list(SPECS),
    (2, True): LAYOUTS,
    (3, False): ["qwen3_moe", "olmoe"],
    (3, True): ["qwen2_moe", "mixtral", "qwen3_moe_fused"],
    (4, False): ["qwen2_moe", "mixtral"],
    (4, True): ["qwen3_moe", "olmoe"],
}


# the fast tier: TP 1 with and without expert parallelism, TP 2 with it; the rest of TP 2, 3 and 4 is the slow tier's
FAST_MOE = {(1, False), (1, True)}  # TP 2 with expert parallelism: test_serving_features_with_experts (fast)


@pytest.mark.parametrize("tp,ep", [pytest.param(*k, marks=[] if k in FAST_MOE else pytest.mark.slow) for k in MATRIX])
def test_greedy_equals_transformers(reference, tp, ep):
    archs = MATRIX[tp, ep]
    jobs = [{"model": str(reference[a][0]), "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "logprobs": 5,
             "llm": {"enable_expert_parallel": ep}} for a in archs]
    results = run_llm(tp, jobs, timeout=600)
    for arch, result in zip(archs, results, strict=True):
        check_greedy(arch, result, reference)
        share = result["bytes_read"] / result["checkpoint_bytes"]
        assert share == 1.0 if tp == 1 else share < 1 / tp + 0.1, (arch, tp, ep, share)


def test_expert_parallel_reads_only_its_experts(reference):
    """Under expert parallelism a rank reads exactly its own experts' tensors, whole (EP 4 over 6 experts: 2, 2,
    1, 1), and without it a slice of every expert; counted from the checkpoint's own reads, on every rank."""
    from loaders.checkpoint import Checkpoint
    from sharding.dist import Dist
    from sharding.runner import EngineConfig, build_model

    folder = reference["qwen3_moe"][0]
    owned = {0: range(0, 2), 1: range(2, 4), 2: range(4, 5), 3: range(5, 6)}
    for ep in (True, False):
        for rank in range(4):
            with Checkpoint(folder) as ckpt:
                reads: dict[str, int] = {}
                original = ckpt.read

                def read(name, *args, _orig=original, **kw):
                    t = _orig(name, *args, **kw)
                    reads[name] = reads.get(name, 0) + t.numel() * t.element_size()
                    return t

                ckpt.read = read
                model, _, _ = build_model(EngineConfig(str(folder), enable_expert_parallel=ep),
                                          Dist(rank=rank, world_size=4, device=torch.device("cpu")), ckpt)
                for m in model.modules():
                    if hasattr(m, "expected"):
                        m.load(ckpt)
                expert_reads = {n: b for n, b in reads.items() if ".experts." in n}
                got = sorted({int(n.split(".experts.")[1].split(".")[0]) for n in expert_reads})
                if ep:
                    assert got == list(owned[rank]), (rank, got)
                    for n, b in expert_reads.items():  # whole tensors
                        assert b == ckpt.tensors[n].nbytes, n
                else:
                    assert got == list(range(6)), (rank, got)
                    assert sum(expert_reads.values()) < sum(ckpt.tensors[n].nbytes for n in expert_reads) / 4 + 4096


def test_quantized_experts_agree_with_float32(tmp_path):
    """int8 and int4 experts (and attention): the most likely next token agrees with float32's at most positions
    of a teacher-forced sequence (the float32 model's own greedy continuation); a wrong expert, scale or layout
    would agree at random (~1/400)."""
    folder = tmp_path / "moe_quant"
    with pytest.MonkeyPatch.context() as mp:  # input sizes 64: every expert linear is quantized
        mp.setitem(tiny.ARCHS, "qwen3_moe_q", dict(SPECS["qwen3_moe"], moe_intermediate_size=64))
        make_checkpoint(folder, "qwen3_moe_q", hidden_size=64)
    base = run_llm(1, [{"model": str(folder), "prompts": PROMPTS[:1], "max_tokens": 96}])[0]
    sequence = PROMPTS[0] + base["outputs"][0]["token_ids"]
    jobs = [{"model": str(folder), "prompts": [sequence], "max_tokens": 1, "prompt_logprobs": 1,
             "llm": {"quantization": q}} for q in (None, "int8", "int4")]
    f32, int8, int4 = run_llm(1, jobs)
    # the same without the compiled grouped experts (decode_glue.cpp's moe_experts): the per-expert loop over the
    # linear kernels, which devices without the compiled kernels and custom activations (gpt-oss) run
    loop = run_llm(1, jobs, env={"TPSERVE_MOE_KERNEL": "0"})

    def agreement(result, base=f32):
        pairs = [(a[0][0], b[0][0]) for a, b in zip(base["outputs"][0]["prompt_top"], result["outputs"][0]["prompt_top"])]
        return sum(x == y for x, y in pairs) / len(pairs)

    assert agreement(int8) >= 0.9, agreement(int8)
    assert agreement(int4) >= 0.6, agreement(int4)
    # The two paths: the same products, their sums ordered apart (float32 logprobs within ~2e-6). Where the kernels
    # quantize activations to int8 (VNNI, AVX2), such a difference may move one activation across a rounding boundary,
    # and every later position's logprobs by up to a few hundredths (tests/sharding/test_perf_paths.py).
    from sharding.cpu import kernels
    from sharding.layers import quant

    rounded = kernels.build_kernels() and quant.int8_activations()  # (what the runs' processes loaded)
    for q, compiled, looped in zip((None, "int8", "int4"), (f32, int8, int4), loop):
        assert agreement(looped, compiled) >= 0.98
        worst = max(abs(a[0][1] - b[0][1]) for a, b in zip(compiled["outputs"][0]["prompt_top"],
                                                            looped["outputs"][0]["prompt_top"]))
        assert worst < (0.05 if q is not None and rounded else 1e-3), (q, worst)


def test_refused_configs(reference, tmp_path):
    def variant(arch: str, name: str, **config) -> str:
        return config_variant(reference[arch][0], tmp_path / name, **config)

    dense = make_checkpoint(tmp_path / "dense", "llama")
    cases = [
        ({"model": str(dense), "llm": {"enable_expert_parallel": True}}, "dense model, it has no experts to split"),
        ({"model": variant("qwen3_moe", "grouped", n_group=2, topk_group=1)}, "n_group=2 (grouped top-k routing)"),
        ({"model": variant("qwen3_moe", "bias", topk_method="noaux_tc")}, "topk_method='noaux_tc'"),
        ({"model": variant("mixtral", "k", num_experts_per_tok=9)}, "num_experts_per_tok (9)"),
        ({"model": variant("qwen3_moe", "deepseek", architectures=["DeepseekV3ForCausalLM"])},
         "multi-head latent attention"),
    ]
    results = run_llm(1, [job for job, _ in cases])
    for (job, message), result in zip(cases, results, strict=True):
        assert "error" in result and message in result["error"], (job, result)


def test_expert_token_counts(reference):
    """tpserve_moe_expert_tokens_total: every token of every sparse layer is routed to k experts, counted once."""
    from server.llm import LLM
    from server.api.metrics import ExpertTokens
    from server.engine.sampler import SamplingParams

    with LLM(str(reference["qwen3_moe"][0]), max_num_seqs=4) as llm:
        llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        (family,) = list(ExpertTokens(llm.executor.model).collect())
    by_layer: dict[str, float] = {}
    for sample in family.samples:
        by_layer[sample.labels["layer"]] = by_layer.get(sample.labels["layer"], 0) + sample.value
    # layers 0 and 2 are sparse; every prompt token and every generated token but the last pass each once
    tokens = sum(len(p) for p in PROMPTS) + len(PROMPTS) * 7
    assert by_layer == {"0": 2 * tokens, "2": 2 * tokens}


@pytest.mark.parametrize("layouts", ["pp 2", pytest.param("dp 2", marks=pytest.mark.slow)])
def test_serving_features_with_experts(reference, layouts):
    """At TP 2 with expert parallelism: two pipeline stages of MoE layers (fast tier) or two data-parallel replicas,
    each its own expert group (slow tier); and one replica with prefix caching, 8-token prefill chunks and a pool so
    small that sequences are preempted and recomputed: every output equals transformers', in the first round and
    when the same prompts come again (from the prefix cache)."""
    folder, expected = reference["qwen3_moe"]
    prompts = PROMPTS * 2
    want = [t for t, _ in expected] * 2
    # bytes of one block per rank: 3 layers x K,V x 2 of 4 KV heads x 16 tokens x head_dim 16 x 4 bytes
    per_block = 3 * 2 * 2 * 16 * 16 * 4
    base = {"model": str(folder), "prompts": prompts, "max_tokens": MAX_TOKENS, "max_num_seqs": 4}
    layout = {"pipeline_parallel_size": 2} if layouts == "pp 2" else {"data_parallel_size": 2}
    jobs = [dict(base, llm={"enable_expert_parallel": True, **layout})]
    if layouts == "pp 2":
        jobs.append(dict(base, repeat=2, llm={"enable_expert_parallel": True, "max_num_batched_tokens": 8,
                                              "kv_cache_memory": 8 * per_block}))
    results = run_llm(2, jobs, timeout=600)
    for name, res in zip((layouts, "chunked, tiny pool, cached"), results):
        assert "error" not in res, (name, res)
        assert [o["token_ids"] for o in res["outputs"]] == want, name
    if layouts == "pp 2":
        assert results[1]["repeats"][0] == want
        assert results[1]["preemptions"] > 0 and results[1]["prefix_hit_tokens"] > 0


def test_structured_output_with_experts(reference):
    """A JSON schema constrains a MoE model's answer as a dense model's (the grammar masks the logits; the experts
    are not involved): the text parses and has the schema's shape."""
    from server.llm import LLM
    from server.engine.sampler import SamplingParams

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    with LLM(str(reference["mixtral"][0]), max_num_seqs=2) as llm:
        (out,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=40, temperature=0), json_schema=schema)
    value = json.loads(out.text)
    assert set(value) == {"n"} and isinstance(value["n"], int)


@pytest.mark.parametrize("arch", ["olmoe", "mixtral", "qwen2_moe"])
def test_decode_plan_paths(reference, arch):
    """OLMoE (norms over the whole q and k projections, clip_qkv), Mixtral and Qwen 2-MoE (a shared expert with its
    sigmoid gate; dense and sparse layers mixed) as one compiled decode call, router and experts included: equal to
    the plan's Python loop bit for bit and to the modules to rounding (tests/sharding/test_perf_paths.py)."""
    from test_perf_paths import three_decode_paths

    three_decode_paths(reference[arch][0], None, moe=True)
