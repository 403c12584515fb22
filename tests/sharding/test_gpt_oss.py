"""gpt-oss (sharding/models/gpt_oss.py): greedy tokens equal transformers' GptOssForCausalLM and log-probabilities
within 1e-4 (fp32) at TP 1-4, with the experts split tensor-parallel and expert-parallel, from a float32 and a
bfloat16 checkpoint; the bytes each rank reads; attention sinks in attend() on every path; refused configs.

The tiny model has what makes gpt-oss gpt-oss (removing any one of these changes most of transformers' greedy
tokens on these prompts, as checked when this test was written): attention sinks (per head, randomized to about
+-2), alternating sliding (window 8, which every sequence outgrows, the first already in its prefill) and full
layers, YaRN rotary with its attention scaling, q/k/v/o biases, the top-k-then-softmax router with its bias, fused
transposed gate/up (interleaved) and down experts with their biases, and a swiglu_limit small enough (1.5) to clamp. TP 3 divides neither the experts (5), the heads (8, 2 KV heads) nor the intermediate size
(40). One fresh process per (TP, expert parallel) pair runs every job (llm_runner.run_llm).
"""

import json
import math
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny
from llm_runner import run_llm
from tiny import check_greedy, config_variant, hf_greedy, make_checkpoint

PROMPTS = [list(range(5, 25)), [7, 3, 90, 14, 200, 31, 6, 55], [11, 12, 13]]
MAX_TOKENS = 24
SPEC = dict(cls="GptOssConfig", num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_local_experts=5,
            num_experts_per_tok=2, intermediate_size=40, sliding_window=8, num_hidden_layers=4, swiglu_limit=1.5,
            rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                 truncate=False, original_max_position_embeddings=64))


def randomize(folder, seed: int = 1) -> None:
    """Random values for what transformers initialises to constants or near zero: every 1-D tensor (norm weights,
    biases, router bias), the 2-D expert biases (zeros), and the sinks (scaled so that they matter)."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if name.endswith(".sinks"):
            tensors[name] = 2 * torch.randn(t.shape, generator=gen)
        elif t.dim() == 1 or name.endswith("_bias"):
            tensors[name] = t + 0.3 * torch.randn(t.shape, generator=gen)
    save_file(tensors, str(path), metadata={"format": "pt"})


def to_bfloat16(src, dst) -> None:
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    save_file({n: t.to(torch.bfloat16) for n, t in load_file(str(path)).items()}, str(path), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss") / "f32"
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(tiny.ARCHS, "gpt_oss", SPEC)
        make_checkpoint(folder, "gpt_oss")
    randomize(folder)
    bf16 = folder.parent / "bf16"
    to_bfloat16(folder, bf16)
    # transformers in float32 from each checkpoint's weights (the bf16 ones widened)
    return {name: (f, [hf_greedy(f, p, MAX_TOKENS) for p in PROMPTS]) for name, f in (("f32", folder), ("bf16", bf16))}


def check_teacher_forced(result, ref, tolerance: float):
    """A job scoring each prompt followed by transformers' greedy continuation (prompt_logprobs): the log-probability
    of every continuation token within `tolerance` of transformers', and the most likely token agreeing at 90 % of
    the positions at least (a near tie may flip)."""
    assert "error" not in result, result
    agree = total = 0
    for prompt, out, (tokens, logprobs) in zip(PROMPTS, result["outputs"], ref, strict=True):
        at = len(prompt) - 1  # prompt_logprobs[j]: of token j + 1
        for i, t in enumerate(tokens):
            assert abs(out["prompt_logprobs"][at + i] - float(logprobs[i, t])) < tolerance, (i, t)
            agree += out["prompt_top"][at + i][0][0] == t
            total += 1
    assert agree >= 0.9 * total, (agree, total)


def job(ref, name, ep, **kw):
    return {"model": str(ref[name][0]), "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "logprobs": 5,
            "llm": {"enable_expert_parallel": ep, **kw.pop("llm", {})}, **kw}


# (TP, expert parallel): the experts' intermediate dimension split evenly (TP 2: 20 each) and not (TP 3: 13/13/14);
# whole experts split unevenly (EP 3: 2, 2, 1; EP 4: 2, 1, 1, 1); KV heads replicated over ranks at TP 3 and 4
@pytest.mark.parametrize("tp,ep", [(1, False), pytest.param(2, False, marks=pytest.mark.slow),
                                   pytest.param(3, False, marks=pytest.mark.slow),
                                   pytest.param(3, True, marks=pytest.mark.slow), pytest.param(4, True, marks=pytest.mark.slow)])
def test_greedy_equals_transformers(reference, tp, ep):
    jobs = [job(reference, "f32", ep, repeat=2)]  # the repeat prefills after a cached prefix (a masked, windowed chunk)
    names = ["f32"]
    if tp in (1, 3) and not ep:  # bf16 weights, float32 compute: exact (TP 3: uneven slices of 2-byte rows)
        jobs.append(job(reference, "bf16", ep, dtype="float32"))
        names.append("bf16")
    if tp == 2:
        # Megatron sequence parallelism, with small blocks and a small step budget: chunked prefills after cached
        # blocks, the window cutting inside a chunk, the chunks' tokens split over the ranks
        jobs.append(job(reference, "f32", ep, llm={"sequence_parallel": True, "block_size": 4,
                                                   "max_num_batched_tokens": 8}, repeat=2))
        names.append("f32")
    auto = None
    if tp == 1:
        # the default for a bf16 checkpoint on CPU: bf16 weight-only linears (whose kernel rounds the activations to
        # bfloat16 on CPUs with AVX-512 BF16), float32 elsewhere; teacher-forced on transformers' continuation
        auto = {"model": str(reference["bf16"][0]), "max_tokens": 1, "prompt_logprobs": 1,
                "prompts": [p + tokens for p, (tokens, _) in zip(PROMPTS, reference["bf16"][1])]}
    results = run_llm(tp, jobs + ([auto] if auto else []), timeout=600)
    for spec, name, result in zip(jobs, names, results):
        check_greedy(name, result, reference)
        if spec.get("repeat"):
            assert result["prefix_hit_tokens"] > 0
            assert result["repeats"] == [[o["token_ids"] for o in result["outputs"]]]
        if spec["llm"].get("sequence_parallel"):
            assert result["seq_parallel_steps"] > 0
        share = result["bytes_read"] / result["checkpoint_bytes"]  # rank 0's: under EP, the most experts
        most = -(-SPEC["num_local_experts"] // tp) / SPEC["num_local_experts"] if ep else 1 / tp
        assert share == 1.0 if tp == 1 else share < most + 0.1, (name, tp, ep, share)
    if auto:
        check_teacher_forced(results[-1], reference["bf16"][1], tolerance=0.2)


def expert_reads(folder, world: int, ep: bool) -> list[dict[str, int]]:
    """Per rank of a TP group of `world`: the bytes it reads of each expert tensor (built and loaded in process)."""
    from loaders.checkpoint import Checkpoint
    from sharding.dist import Dist
    from sharding.runner import EngineConfig, build_model

    per_rank = []
    for rank in range(world):
        with Checkpoint(folder) as ckpt:
            reads: dict[str, int] = {}
            original = ckpt.read

            def read(name, *args, _orig=original, **kw):
                t = _orig(name, *args, **kw)
                if ".experts." in name:
                    key = f"{name}[{kw.get('index')}]"
                    reads[key] = reads.get(key, 0) + t.numel() * t.element_size()
                return t

            ckpt.read = read
            model, _, _ = build_model(EngineConfig(str(folder), dtype="float32", enable_expert_parallel=ep),
                                      Dist(rank=rank, world_size=world, device=torch.device("cpu")), ckpt)
            for m in model.modules():
                if hasattr(m, "expected"):
                    m.load(ckpt)
            per_rank.append(reads)
    return per_rank


def test_each_expert_byte_is_read_once_over_the_group(reference):
    """Tensor parallel (TP 3): every rank reads a slice of every expert, the down bias only on rank 0; expert
    parallel (EP 4 over 5 experts: 2, 1, 1, 1): a rank reads exactly its own experts, whole. Either way, the group
    reads each byte of each expert tensor exactly once."""
    folder = reference["bf16"][0]
    from loaders.checkpoint import Checkpoint

    with Checkpoint(folder) as ckpt:
        sizes = {n: info.nbytes for n, info in ckpt.tensors.items() if ".experts." in n}
    total = sum(sizes.values())
    for world, ep in ((3, False), (4, True)):
        per_rank = expert_reads(folder, world, ep)
        assert sum(sum(r.values()) for r in per_rank) == total, (world, ep)
        for rank, reads in enumerate(per_rank):
            experts = {int(k.split("[")[1][:-1]) for k in reads}
            if ep:
                assert experts == set(range(*[(0, 2), (2, 3), (3, 4), (4, 5)][rank])), (rank, experts)
                for k, b in reads.items():  # whole: one expert's slice of the fused tensor
                    assert b == sizes[k.split("[")[0]] // 5, k
            else:
                assert experts == set(range(5)), (rank, experts)
                assert any("down_proj_bias" in k for k in reads) == (rank == 0), rank


def naive_sinks(q, k_all, v_all, scale, sinks, window=None):
    """transformers' eager gpt-oss attention for one sequence: q [n, H, d] at the last n positions of k_all/v_all
    [T, H, d]; the sink column appended to the masked scores, softmaxed, dropped."""
    n, t = q.shape[0], k_all.shape[0]
    s = torch.einsum("nhd,thd->hnt", q, k_all) * scale
    qpos = torch.arange(t - n, t)[:, None]
    kpos = torch.arange(t)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    s = s.masked_fill(~mask, float("-inf"))
    s = torch.cat([s, sinks.view(-1, 1, 1).expand(-1, n, 1)], dim=-1)
    return torch.einsum("hnt,thd->nhd", s.softmax(-1)[..., :-1], v_all)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (5, 2), (3, 1)])
@pytest.mark.parametrize("window", [None, 5])
def test_attend_with_sinks(heads, kv_heads, window, monkeypatch):
    """attend(sinks=...) over mixed prefill/decode steps (prefills from 0 and after cached blocks, decode batches of
    1-5) equals the eager formula, on the fused prefill kernel and on the explicit fallback."""
    from test_attention_steps import run_mixed_steps

    from sharding.layers import attention
    from sharding.layers.attention import attend

    fused_calls = []
    monkeypatch.setattr(attention, "_sink_flash_attention",
                        lambda *a, _f=attention._sink_flash_attention: fused_calls.append(1) or _f(*a))
    steps = [[(0, 5)], [(0, 1), (3, 7)], [(0, 1), (3, 1), (1, 2)], [(0, 1), (1, 1), (2, 9), (3, 1), (5, 1)],
             [(4, 3), (2, 1)], [(4, 6), (2, 1)], [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1)], [(2, 1)]]
    for fused in (True, False):
        if not fused:
            assert fused_calls  # the prefills took the fused kernel
            monkeypatch.setattr(attention, "_flash_with_lse", lambda: None)
            fused_calls.clear()
        torch.manual_seed(0)
        d = 8
        scale = 1 / math.sqrt(d)
        sinks = 2 * torch.randn(heads)
        worst_without = [0.0]

        def attend_step(q, k, v, cache, meta, kv_for_q):
            return attend(q, k, v, cache, meta, kv_for_q, scale, sinks=sinks).view(q.shape)

        def check(out, q, ks, vs, msg):
            ref = naive_sinks(q, ks, vs, scale, sinks, window)
            torch.testing.assert_close(out, ref, msg=f"{msg}, fused {fused}")
            without = naive_sinks(q, ks, vs, scale, torch.full_like(sinks, -math.inf), window)
            worst_without[0] = max(worst_without[0], float((without - ref).abs().max()))

        run_mixed_steps(steps, heads, kv_heads, d, 4, window, attend_step, check)
        assert worst_without[0] > 0.1  # the sinks matter
    assert not fused_calls


def test_refused_configs(reference, tmp_path):
    """What this implementation does not compute as transformers does is refused at start, the field named (built in
    process: the model's constructor and the rotary table are where the runner refuses them). The accepted model
    takes the CPU decode plan with each layer's sinks and window (test_one_call_equals_the_loop runs it)."""
    from loaders.checkpoint import Checkpoint
    from loaders.config import load_config
    from sharding.cpu import kernels
    from sharding.layers.attention import RotaryTable
    from sharding.dist import Dist
    from sharding.models import model_class

    def start(name: str, **config):
        folder = config_variant(reference["f32"][0], tmp_path / name, **config)
        with Checkpoint(folder) as ckpt:
            config = load_config(ckpt)
            model = model_class(ckpt.architecture)(config, Dist(), torch.float32, torch.device("cpu"))
            RotaryTable(config, 16, torch.float32, torch.device("cpu"))
        return model

    assert kernels.build_kernels() and kernels.decode_glue_ops() is not None
    model = start("plain")
    plan = model._decode_plan()  # on the decode plan: each layer's sinks and window, the experts as a module
    assert plan is not None
    assert all(f.sinks is not None and f.ffn is not None for f in plan.layers)
    windows = [SPEC["sliding_window"] if t == "sliding_attention" else None for t in model.config.layer_types]
    assert [f.window for f in plan.layers] == windows and None in windows and 8 in windows
    cases = [
        (dict(num_experts_per_tok=6), "num_experts_per_tok (6)"),
        (dict(layer_types=["sliding_attention", "chunked_attention"] * 2), "layer_types holds ['chunked_attention']"),
        (dict(sliding_window=None), "sliding_window=None"),
        (dict(rope_parameters=dict(SPEC["rope_parameters"], partial_rotary_factor=0.5)), "partial_rotary_factor=0.5"),
        (dict(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)), "'dynamic' is not supported"),
    ]
    for i, (config, message) in enumerate(cases):
        with pytest.raises(ValueError, match=re.escape(message)):
            start(f"case{i}", **config)
    # LongRoPE changes its frequencies past original_max_position_embeddings: only a max_model_len within it
    longrope = start("longrope", rope_parameters=dict(rope_type="longrope", rope_theta=1e4,
                                                      original_max_position_embeddings=64,
                                                      short_factor=[1.0] * 8, long_factor=[2.0] * 8))
    longrope.check_max_model_len(64)
    with pytest.raises(ValueError, match=re.escape("max_model_len (65) must not exceed 64")):
        longrope.check_max_model_len(65)


def test_one_call_equals_the_loop(reference):
    """gpt-oss's decode steps as one compiled call (each layer's sinks and window, the router with its bias, top-k
    then softmax, the clamped SwiGLU experts with their biases: decode_glue.cpp) against the plan's Python loop and
    the modules (tests/sharding/test_perf_paths.py three_decode_paths)."""
    from test_perf_paths import three_decode_paths

    three_decode_paths(reference["f32"][0], None, moe=True)


def test_compiled_experts_equal_the_loop(reference):
    """The clamped SwiGLU inside the compiled grouped experts (decode_glue.cpp moe_experts, activation kind 1) against
    the loop over the experts' linears with the torch activation: inputs large enough that both clamps bite."""
    from sharding.cpu import kernels
    from sharding.layers.moe import SparseMoe
    from tests.helpers.in_process import loaded_model

    assert kernels.build_kernels() and kernels.moe_experts_ops() is not None, "the CPU kernels did not build"
    model = loaded_model(reference["f32"][0], dtype="float32")
    x = 30 * torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    layers = [m for m in model.modules() if isinstance(m, SparseMoe)]
    assert layers
    clamped = 0
    for moe in layers:
        got = moe.routed(x)
        assert moe._compiled is not None
        e = moe.experts[0]
        gate, up = e.gate_up.matmul(x, e.gate_up.bias).chunk(2, dim=-1)
        clamped += int((gate > moe._act.limit).sum() + (up.abs() > moe._act.limit).sum())
        moe._compiled = None  # the loop over the experts' linears, the torch activation
        torch.testing.assert_close(got, moe.routed(x), rtol=1e-5, atol=1e-4)  # (gates far below -88 included)
    assert clamped > 0
