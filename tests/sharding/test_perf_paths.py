"""The fast paths of the decode step compute exactly what the plain formulas compute."""

import pytest
import torch
import torch.nn.functional as F

from sharding.layers.attention import GroupedHeads, _prefill_attention
from sharding.layers.linear import RMSNorm


@pytest.mark.parametrize("kernel", [True, False])
def test_rmsnorm_fast_paths_equal_the_formula(kernel, monkeypatch):
    """The compiled one-pass kernel (another summation order: within float32 rounding) and, without it, torch's
    F.rms_norm (bit-identical); 2-D rows, the parallel row split of a prefill, and Qwen3's per-head [N, H, D]."""
    from sharding.cpu import kernels

    if kernel:
        assert kernels.build_kernels() and kernels.rms_norm_op() is not None, "no RMSNorm kernel"
    else:
        monkeypatch.setitem(kernels._OPS, "norm", None)
    for shape in ((1, 576), (7, 576), (32, 576), (300, 576), (5, 3, 64)):
        norm = RMSNorm("w", shape[-1], 1e-5, torch.float32, torch.device("cpu"))
        norm.weight.data.normal_()
        x = torch.randn(*shape)
        ref = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))
        got = norm(x)
        assert (norm._op is not None) == kernel
        if norm._op is not None:
            torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-6)
        else:
            assert torch.equal(got, ref)


def test_grouped_decode_equals_expanded_kv():
    """Decode attention with a KV head's query heads as its "query positions" (padded for uneven groups) equals
    attention over K/V expanded to every query head, on the SDPA path (< 4 sequences) and the matmul path."""
    from sharding.layers.attention import _decode_attention

    for kv_for_q in ([0, 0, 0, 1, 1], [0, 0, 1, 1, 2, 2], [0, 1, 1, 1]):
        gh = GroupedHeads(kv_for_q)
        kv = torch.tensor(kv_for_q)
        for b in (2, 5):
            t, d = 11, 16
            q = torch.randn(b, len(kv_for_q), d)
            k, v = torch.randn(max(kv_for_q) + 1, b, t, d), torch.randn(max(kv_for_q) + 1, b, t, d)
            lens = torch.randint(1, t + 1, (b,))
            lens[0] = t
            mask = torch.arange(t)[None, :] < lens[:, None]
            ref = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(0, 1)[:, kv], v.transpose(0, 1)[:, kv],
                                                 attn_mask=mask[:, None, None, :], scale=0.25).squeeze(2)
            qd = q.index_select(1, gh.q_index) if gh.q_index is not None else q
            o = _decode_attention(qd.reshape(b, k.shape[0], gh.group, d), k, v, mask, 0.25, None).reshape(b, -1, d)
            if gh.out_index is not None:
                o = o.index_select(1, gh.out_index)
            torch.testing.assert_close(o, ref, rtol=0, atol=1e-6)


def test_prefill_attention_gqa_equals_repeated_kv():
    q, k, v = torch.randn(9, 6, 16), torch.randn(3, 6, 16), torch.randn(3, 6, 16)
    gh = GroupedHeads([0, 0, 0, 1, 1, 1, 2, 2, 2])
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 0), v.repeat_interleave(3, 0), is_causal=True)
    torch.testing.assert_close(_prefill_attention(q, k, v, gh, None, 16 ** -0.5, None), ref)


@pytest.mark.parametrize("f32_kernel", [True, False])
def test_packed_linears_equal_plain_ones(f32_kernel, monkeypatch):
    """The runner's CPU layouts compute F.linear: float32 through the compiled f32_linear over its column blocks
    (or oneDNN's packed weight without it) to fp32 rounding; bfloat16 through oneDNN within two bf16 roundings of the
    exact product (the bias may be added after the product is rounded)."""
    from sharding.cpu import kernels
    from sharding.dist import Dist
    from sharding.layers.linear import ColumnParallelLinear, ParallelLMHead, Piece, RowParallelLinear

    assert kernels.build_kernels()
    if not f32_kernel:
        monkeypatch.setitem(kernels._OPS, "f32", None)
    cpu, d = torch.device("cpu"), Dist()
    for dtype in (torch.float32, torch.bfloat16):
        col = ColumnParallelLinear(96, [Piece("q", 0, 40, (40, 96))], True, dtype, cpu)
        row = RowParallelLinear(Piece("o", 0, 40, (96, 40)), True, d, dtype, cpu)
        head = ParallelLMHead("h", 300, 96, d, dtype, cpu)
        for m in (col, row, head):
            m.weight.data.normal_()
            if m.bias is not None:
                m.bias.data.normal_()
        plain = [(m, m.weight.clone(), m.bias) for m in (col, row, head)]
        for m in (col, row, head):
            m.prepack()
            if dtype == torch.float32 and f32_kernel:
                assert m.blocked is not None and m.packed is None and m.weight is None
            elif dtype == torch.float32 or kernels._onednn_bf16():
                assert m.packed is not None and m.blocked is None
                assert m.weight is None  # the packed copy replaced the weight
            else:  # an AVX2-only CPU: oneDNN has no bfloat16 linear there, the weight stays plain
                assert m.packed is None and m.weight is not None
        for rows in (1, 3, 8, 33):
            for m, w, b in plain:
                x = torch.randn(rows, w.shape[1]).to(dtype)
                out = m(x).float()
                if dtype == torch.float32:
                    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
                else:
                    exact = F.linear(x.float(), w.float(), None if b is None else b.float())
                    torch.testing.assert_close(out, exact, rtol=2 * 2 ** -8, atol=0.02)


def test_f32_linear_is_exact_to_rounding_and_the_same_at_every_batch_size():
    """The compiled float32 linear against the float64 product (partial last block, with and without bias, row
    counts around its 8-row tile), and each row's output bitwise the same whether computed alone or in any batch."""
    from sharding.cpu import kernels

    assert kernels.build_kernels()
    op = kernels.f32_linear_op()
    assert op is not None
    torch.manual_seed(0)
    for n, k in ((40, 96), (577, 64), (5, 16), (33, 48)):
        w, b = torch.randn(n, k), torch.randn(n)
        blocked = kernels.block_f32(w)
        assert blocked.shape == (-(-n // 32), k, 32) and torch.equal(kernels.unblock_f32(blocked, n), w)
        x = torch.randn(37, k)
        for bias in (b, None):
            ref = F.linear(x.double(), w.double(), None if bias is None else bias.double()).float()
            whole = op(x, blocked, bias, n)
            torch.testing.assert_close(whole, ref, rtol=1e-5, atol=1e-4)
            for m in (1, 7, 8, 9, 16):
                assert torch.equal(op(x[:m], blocked, bias, n), whole[:m])
            assert torch.equal(torch.cat([op(x[i : i + 1], blocked, bias, n) for i in range(37)]), whole)


def test_packed_linears_run_at_a_bounded_set_of_row_counts():
    """Every row count maps to a bucket at least as large (~6 % more rows on average from 33 to 512), and 1..4096 use
    few distinct shapes (each distinct shape costs oneDNN a compiled primitive that stays in memory)."""
    from sharding.layers.linear import bucket_rows

    buckets = {bucket_rows(m) for m in range(1, 4097)}
    assert all(bucket_rows(m) >= m for m in range(1, 4097))
    assert all(bucket_rows(m) == m for m in range(1, 33))
    assert max(bucket_rows(m) / m for m in range(33, 4097)) < 2
    assert sum(bucket_rows(m) - m for m in range(33, 513)) / sum(range(33, 513)) < 0.06
    assert len(buckets) <= 32 + 6 + 12 + 12 + 4


def test_rotary_kernel_is_bit_identical_to_the_formula():
    """The in-place rotary of q and k (views into a fused qkv row, as the attention makes them) equals transformers'
    `x * cos + rotate_half(x) * sin` bit for bit."""
    from sharding.cpu import kernels
    from sharding.layers.attention import apply_rotary

    assert kernels.build_kernels(), "the CPU kernels did not build"
    op = kernels.rotary_op()
    assert op is not None
    for n, hq, hk, d in ((1, 9, 3, 64), (7, 4, 2, 16), (33, 8, 8, 128)):
        qkv = torch.randn(n, (hq + 2 * hk) * d)
        q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        q, k = q.reshape(n, hq, d), k.reshape(n, hk, d)
        cos, sin = torch.randn(n, d), torch.randn(n, d)
        want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v_before = qkv[:, (hq + hk) * d:].clone()
        op(q, k, cos, sin)
        assert torch.equal(q, want_q) and torch.equal(k, want_k)
        assert torch.equal(qkv[:, (hq + hk) * d:], v_before)  # v, beside them in the row, untouched


@pytest.mark.parametrize("heads,kv_heads,window,qk_norm", [(4, 2, 0, False), (5, 2, 0, False), (4, 4, 3, False),
                                                            (5, 2, 0, True)])
def test_decode_attention_op_equals_the_module_path(heads, kv_heads, window, qk_norm):
    """The decode fast path's attention op (rotary, cache write, paged attention from the fused qkv rows) against the
    module path (split, per-head q/k RMSNorms where the model has them, apply_rotary, attend), uneven GQA groups (5
    query heads over 2 KV heads) and a window included: the same cache contents and the same output."""
    from sharding.layers.linear import RMSNorm

    import random

    from sharding.cpu import kernels
    from sharding.layers.attention import AttentionMetadata, PagedKVCache, apply_rotary, attend
    from sharding.wire import LOGITS_LAST, Step

    assert kernels.build_kernels() and kernels.decode_glue_ops() is not None, "the CPU kernels did not build"
    attention_op = kernels.decode_glue_ops()[0]
    torch.manual_seed(0)
    d, bs, rows = 16, 4, 3
    groups = GroupedHeads(None if heads == kv_heads else [h * kv_heads // heads for h in range(heads)])
    caches = [PagedKVCache(24, bs, kv_heads, d, torch.float32, torch.device("cpu")) for _ in range(2)]
    caches[0].pool.normal_()
    caches[1].pool.copy_(caches[0].pool)  # earlier tokens' K/V: random history, the same in both
    blocks = list(range(24))
    random.Random(0).shuffle(blocks)
    table = torch.tensor(blocks[:18]).reshape(rows, 6)
    starts = [5, 13, 9]  # each row's decode position
    step = Step(torch.zeros(rows, dtype=torch.int64),
                torch.tensor([[r, 1, starts[r], LOGITS_LAST] for r in range(rows)], dtype=torch.int64))
    meta = AttentionMetadata.build(step, table, bs, None, window or None, torch.device("cpu"))
    meta.cos, meta.sin = torch.randn(rows, d), torch.randn(rows, d)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.reshape(rows, heads, d), k.reshape(rows, kv_heads, d)
    norms = ()
    if qk_norm:  # Qwen 3's norms, as its module computes them (sharding/models/qwen3.py)
        norms = [RMSNorm(n, d, 1e-6, torch.float32, torch.device("cpu")) for n in ("q", "k")]
        for n in norms:
            n.weight.data.copy_(torch.rand(d) + 0.5)
        q, k = norms[0](q), norms[1](k)
    q, k = apply_rotary(q, meta.cos, meta.sin), apply_rotary(k, meta.cos, meta.sin)
    want = attend(q, k, v.reshape(rows, kv_heads, d), caches[0], meta, groups, 0.25)
    got = attention_op(qkv, meta.cos, meta.sin, caches[1].pool, meta.slots, meta.decode_table, meta.decode_lens,
                       groups.q_index, heads, kv_heads, 0.25, window, *(n.weight for n in norms),
                       *((1e-6,) if norms else ()))
    if groups.out_index is not None:
        got = got.view(rows, -1, d).index_select(1, groups.out_index).reshape(rows, -1)
    assert torch.equal(caches[1].pool, caches[0].pool)  # the rotated keys bit for bit, the values copied
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch, quantization", [("qwen2", None), ("qwen2", "int8"), ("qwen2", "int4"),
                                                 ("qwen2", "bf16"), ("qwen3", None), ("qwen3", "int4")])
def test_llama_decode_fast_path_equals_the_module_path(checkpoints, arch, quantization):
    """A whole model's decode steps through the compiled layers (decode_layers: every layer in one call), through
    the fast path's Python loop, and through the modules: the same greedy tokens, logprobs equal to float32
    rounding (to int8 rounding of the activations where the kernels quantize them). Qwen 2's layout (q/k/v biases,
    6 heads over 2 KV heads), each linear kernel; Qwen 3's per-head q/k norms."""
    three_decode_paths(checkpoints(arch), quantization)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """Qwen 3-MoE: sparse layers 0 and 2 around dense layer 1, 6 experts, top 2 renormalised; input sizes of 64, so
    int8 and int4 quantize every expert; heads of 32, so the one call quantizes the o projection's input head by head
    as attention completes it (the other tiny models' heads of 16 take the separate phase)."""
    import tiny

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(tiny.ARCHS, "qwen3_moe", dict(cls="Qwen3MoeConfig", num_attention_heads=8, num_key_value_heads=4,
                                                 head_dim=32, num_experts=6, num_experts_per_tok=2,
                                                 moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[1],
                                                 num_hidden_layers=3))
        return tiny.make_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_moe_layers_in_the_one_call(moe_checkpoint, quantization):
    """MoE layers inside the one compiled call (router, top-k, grouped experts: decode_glue.cpp's MoeExperts), mixed
    with a dense layer: the same tokens and logprobs, bit for bit, as the Python loop (which calls the MoE module,
    moe_forward), and to rounding as the modules; the expert-token metric counts the same routing in each. Six
    sequences: steps of more rows than thread 0 routes alone (decode_glue.cpp's ROUTE_ALONE)."""
    prompts = [[5, 6, 7, 8, 9, 10], list(range(30, 50)), [3, 4], [11, 12, 13], list(range(60, 69)), [21, 22, 23, 24]]
    three_decode_paths(moe_checkpoint, quantization, moe=True, prompts=prompts)


@pytest.mark.parametrize("arch, quantization", [("llama_long", None), ("llama_long", "int4"), ("mistral", None),
                                                 ("llama_heads32", "int8")])
def test_long_contexts_attend_in_chunks_alike_on_every_path(checkpoints, tmp_path_factory, arch, quantization):
    """Contexts of several attention chunks (sharding/cpu/csrc/core/kernels.h: ATTENTION_CHUNK keys at fixed
    positions), which the one call hands out to its team chunk by chunk and the loop's op attends in one call, with and
    without a sliding window that starts inside a chunk: the same tokens and logprobs bit for bit, and the modules' to
    rounding. Heads of 32: the o projection's int8 input made head by head as the chunks' combine completes it."""
    import tiny

    if arch == "mistral":
        folder = tiny.make_checkpoint(tmp_path_factory.mktemp("mistral_window"), "mistral",
                                      max_position_embeddings=1024, sliding_window=300)
    elif arch == "llama_heads32":
        folder = tiny.make_checkpoint(tmp_path_factory.mktemp("llama_heads32"), "llama_long", head_dim=32)
    else:
        folder = checkpoints(arch)
    prompts = [[3 + (7 * i) % 300 for i in range(700)], [3 + (5 * i) % 290 for i in range(300)], [4, 5]]
    three_decode_paths(folder, quantization, prompts=prompts, kv_cache_memory=32 << 20)


def plan_steps(monkeypatch) -> list[tuple[int, bool]]:
    """The (rows, every row a decode row) of each step the CPU decode plan runs from here on, recorded as it runs."""
    from sharding.cpu.decode_plan import DecodePlan

    steps: list[tuple[int, bool]] = []
    forward, step = DecodePlan.forward, DecodePlan.step

    def whole(plan, ids, meta, embed):  # (the whole step in one call; None: the caller calls forward)
        logits = step(plan, ids, meta, embed)
        if logits is not None:
            steps.append((ids.shape[0], meta.all_decode))
        return logits

    monkeypatch.setattr(DecodePlan, "forward",
                        lambda plan, h, meta: steps.append((h.shape[0], meta.all_decode)) or forward(plan, h, meta))
    monkeypatch.setattr(DecodePlan, "step", whole)
    return steps


@pytest.mark.parametrize("arch, quantization", [("qwen3", None), ("qwen3", "int4"), ("mistral", "int8")])
def test_prompts_run_as_rows_of_the_decode_step(checkpoints, tmp_path_factory, arch, quantization, monkeypatch):
    """A prompt's tokens run on the CPU decode plan as rows of its step, each attending as a decode row of its
    position would: its logprobs are the same bit for bit however the prompt is cut into chunks, and so is the
    answer after it. Mistral's case: a sliding window of 24 keys, which the prompt's rows pass."""
    import tiny
    from server.llm import LLM
    from server.engine.sampler import SamplingParams

    folder = (tiny.make_checkpoint(tmp_path_factory.mktemp("mistral_w24"), "mistral", sliding_window=24)
              if arch == "mistral" else checkpoints(arch))
    steps = plan_steps(monkeypatch)
    prompt = [3 + (11 * i) % 200 for i in range(45)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    results = []
    for chunk in (64, 7):  # the whole prompt in one step, then in chunks of 7 tokens
        steps.clear()
        llm = LLM(str(folder), max_num_seqs=4, kv_cache_memory=8 << 20, quantization=quantization,
                  max_num_batched_tokens=chunk, enable_prefix_caching=False)
        try:
            results.append(llm.generate([prompt], params)[0])
        finally:
            llm.close()
        prefill = [n for n, decode in steps if not decode]
        assert prefill == ([45] if chunk == 64 else [7] * 6 + [3]), steps
    one, chunked = results
    assert one.token_ids == chunked.token_ids
    assert one.prompt_logprobs[1:] == chunked.prompt_logprobs[1:] and one.logprobs == chunked.logprobs


@pytest.mark.parametrize("arch, dtype, quantization", [
    ("llama", torch.bfloat16, None), ("llama", torch.float16, "int4"), ("llama_tied", torch.float32, None),
    ("qwen3", torch.float32, "int8")])
def test_the_whole_step_in_one_call_equals_the_layers_between_embedding_and_head(tmp_path_factory, arch, dtype,
                                                                                 quantization):
    """DecodePlan.step (decode_glue.cpp decode_step: the ids looked up in the table as stored and widened to float32,
    the first norm, the layers, the LM head over the rows that return logits, in one call) against the same compiled
    layers between the embedding module and the head's op: the same tokens, logprobs and prompt logprobs, bit for bit.
    Three prompts together (prompt rows, then decode rows), then one alone (one-row steps), each prompt in one step
    or in chunks of 7 tokens; with prompt logprobs every prompt row returns logits, without them the last of each
    prompt (a chunk before it: none). A 16-bit table (bfloat16, float16: kept as stored), a tied float32 head, int8
    and int4 layers under an int8 head."""
    import tiny

    folder = tiny.make_checkpoint(tmp_path_factory.mktemp(f"ends_{arch}"), arch, dtype=dtype)
    tiny.check_whole_steps(folder, quantization, lambda model: model.embed_tokens.weight.dtype == dtype)


def test_a_step_past_the_partials_bound_runs_the_modules(checkpoints, monkeypatch):
    """A step with prompt chunks whose rows' attention partials pass DecodePlan's bound runs the modules (SDPA), and
    the answer is the plan's to float32 rounding; the decode steps after it stay on the plan."""
    from server.llm import LLM
    from server.engine.sampler import SamplingParams
    from sharding.cpu import decode_plan

    steps = plan_steps(monkeypatch)
    prompt = [3 + (13 * i) % 250 for i in range(45)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    llm = LLM(str(checkpoints("qwen3")), max_num_seqs=4, kv_cache_memory=8 << 20, enable_prefix_caching=False)
    try:
        attn = llm.executor.model.layers[0].self_attn
        row = attn.num_heads * (attn.head_dim + 2) * 4  # one row's partials at one chunk of keys
        on_plan = llm.generate([prompt], params)[0]
        assert [n for n, decode in steps if not decode] == [45]
        steps.clear()
        monkeypatch.setattr(decode_plan, "ROWS_PARTIALS_MAX", 44 * row)  # 45 rows: one too many
        on_modules = llm.generate([prompt], params)[0]
        assert steps and all(decode for _, decode in steps)  # the prompt's step left the plan, the decode steps not
    finally:
        llm.close()
    assert on_plan.token_ids == on_modules.token_ids
    torch.testing.assert_close(torch.tensor(on_plan.prompt_logprobs[1:]), torch.tensor(on_modules.prompt_logprobs[1:]),
                               rtol=0, atol=1e-4)


def three_decode_paths(folder, quantization, moe: bool = False, prompts=None, kv_cache_memory: int = 8 << 20) -> None:
    from server.llm import LLM
    from server.engine.sampler import SamplingParams
    from sharding.cpu.decode_plan import DecodePlan
    from sharding.layers import quant
    from sharding.layers.moe import SparseMoe

    # (no prefix cache: every run prefills every prompt token, so each counts the same tokens)
    llm = LLM(str(folder), max_num_seqs=max(4, len(prompts or ())), kv_cache_memory=kv_cache_memory,
              quantization=quantization, enable_prefix_caching=False)
    try:
        model = llm.executor.model
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
        prompts = prompts or [[5, 6, 7, 8, 9, 10], list(range(30, 50)), [3, 4]]
        sparse = [m for m in model.modules() if isinstance(m, SparseMoe)]
        assert bool(sparse) == moe
        counts = []  # the expert-token counts each path adds

        def generate():
            # the prompts together, then the first alone: its decode steps are of one row, which the one call runs in
            # its own form (decode_glue.cpp decode_layers' `solo`: per-thread copies of the row, moe_solo)
            before = [m.tokens_per_expert.clone() for m in sparse]
            out = llm.generate(prompts, params) + llm.generate(prompts[:1], params)
            counts.append([m.tokens_per_expert - b for m, b in zip(sparse, before)])
            return out

        compiled = generate()
        assert isinstance(model._plan, DecodePlan) and model._plan.compiled is not None
        assert model._plan.compiled.size() == len(model.layers)
        # its ends inside too where the model declares them (each step whole: DecodePlan.step), not for Gemma's
        assert (model._plan.run_step is not None) == (model.plan_ends() is not None)
        model._plan.compiled = None  # the Python loop over the same ops from here on (the pool is unchanged)
        loop = generate()
        assert model._plan.compiled is None
        model._plan = None  # the module path from here on
        modules = generate()
    finally:
        llm.close()
    # The modules sum some float32 products in another order (logprobs within ~2e-6 in float32), and they prefill
    # through SDPA where the plan runs the prompt's tokens as rows of its decode attention. Where the int8 and int4
    # kernels quantize their activations (AVX-512 VNNI, AVX2), such a difference can move one activation across a
    # rounding boundary: a logprob then moves by up to a few hundredths, and a near tie (in an MoE, a router's tie
    # between two experts) may go the other way, after which the answers part. There the paths must agree to that
    # until they part, and where they part each one's token must be among the other's top 3 (vLLM's
    # check_logprobs_close).
    rounded = quantization in ("int8", "int4") and quant.int8_activations()
    for a, b, c in zip(compiled, loop, modules):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=0)
        if not rounded:
            assert a.token_ids == c.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(c.logprobs), rtol=0, atol=1e-4)
            continue
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, c.token_ids)) if x != y), len(a.token_ids))
        torch.testing.assert_close(torch.tensor(a.logprobs[:same]), torch.tensor(c.logprobs[:same]), rtol=0,
                                   atol=0.1)
        if same < len(a.token_ids):
            x, y = a.token_ids[same], c.token_ids[same]
            assert x in dict(c.top_logprobs[same]) and y in dict(a.top_logprobs[same]), (same, a.token_ids, c.token_ids)
    if moe:  # every token of the prompts and of the answers (but the last) routed to k experts in each sparse layer
        tokens = sum(len(p) for p in prompts + prompts[:1]) + (len(prompts) + 1) * (params.max_tokens - 1)
        for step in counts:
            assert [int(c.sum()) for c in step] == [m.routing.top_k * tokens for m in sparse]
        assert all(torch.equal(x, y) for x, y in zip(counts[0], counts[1]))
        if not rounded:
            assert all(torch.equal(x, y) for x, y in zip(counts[0], counts[2]))


def test_argmax_op_equals_torch_argmax():
    """The compiled greedy argmax: the first maximal value's index, a NaN counting as the maximum, as torch's; rows
    of ties, infinities and widths around its 16-wide vectors."""
    from sharding.cpu import kernels

    assert kernels.build_kernels()
    op = kernels.argmax_op()
    assert op is not None
    torch.manual_seed(0)
    for trial in range(300):
        b, v = 1 + trial % 5, [1, 15, 16, 17, 100, 49152][trial % 6]
        x = torch.randn(b, v)
        if trial % 3 == 0:
            x = x.round()  # ties: the first one wins
        if trial % 7 == 0:
            x[0, (trial * 13) % v] = float("nan")
        if trial % 11 == 0:
            x[-1] = float("-inf")
        if trial % 13 == 0 and v > 3:
            x[0, 2] = x[0, v - 1] = float("inf")
        assert torch.equal(op(x), x.argmax(dim=-1)), trial


def _mapping(addr: int) -> dict:
    """The /proc/self/smaps fields of the mapping holding addr."""
    fields, inside = {}, False
    for line in open("/proc/self/smaps").read().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = lo <= addr < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_load_trim_gives_back_what_a_load_leaves_in_the_heap():
    """The pattern that grew a quantizing load's heap by most of what it allocated (sharding/cpu/hugepages.py
    LoadTrim): once a large tensor has been freed, glibc keeps chunks of up to its size in the heap; temporaries of a
    few MB freed between small tensors that stay then leave their pages resident. LoadTrim, at its next check, gives
    them back; before the check, nothing is given back."""
    import os

    from sharding.cpu import hugepages

    if hugepages._glibc("malloc_trim") is None or hugepages._heap_free() is None:
        pytest.skip("needs glibc's malloc_trim and mallinfo2")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    torch.empty(30 << 20, dtype=torch.uint8).fill_(1)  # a large tensor freed: glibc's mmap threshold rises to 30 MiB
    base = rss()
    temps, kept = [], []
    for _ in range(100):  # 600 MB of touched temporaries, a small tensor kept after each
        temps.append(torch.ones(6 << 20, dtype=torch.uint8))
        kept.append(torch.ones(64 << 10, dtype=torch.uint8))
    del temps
    trim = hugepages.LoadTrim()
    trim(trim.CHECK_EVERY - 1)  # not yet a check
    held = rss()
    assert held - base > 400 << 20, "the freed temporaries stay resident (the premise)"
    trim(trim.CHECK_EVERY)
    assert rss() - base < 100 << 20
    del kept  # (the small tensors stay allocated between the temporaries' holes until here, as a load's weights do)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_weights_move_into_one_huge_page_mapping(checkpoints, quantization, monkeypatch):
    """Every streamed weight (float32 blocks; quantized bytes and scales) ends up a view of one mapping that the
    kernel may back with huge pages (advised: VmFlags `hg`), the KV cache's pools are advised too (and zero), the
    compiled kernels are bound to the moved tensors, and the answer is bit for bit the one from weights left where
    they were (TPSERVE_HUGE_PAGES=0)."""
    from server.llm import LLM
    from server.engine.sampler import SamplingParams
    from sharding.cpu import hugepages

    if not hugepages.enabled():
        pytest.skip(f"transparent huge pages are {hugepages.thp_mode() or 'absent'} here")
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
    prompts = [[5, 6, 7, 8, 9, 10], [3, 4]]
    answers = []
    for move in ("0", "1"):
        monkeypatch.setenv("TPSERVE_HUGE_PAGES", move)
        llm = LLM(str(checkpoints("qwen2")), max_num_seqs=2, kv_cache_memory=8 << 20, quantization=quantization)
        try:
            slots, quantized = hugepages._slots(llm.executor.model)
            tensors = [getattr(owner, attr) for owner, attr in slots]
            assert len(tensors) >= 4 * len(llm.executor.model.layers)
            maps = {tuple(sorted(_mapping(t.data_ptr()).items())) for t in tensors}
            if move == "1":
                assert len(maps) == 1
                fields = dict(next(iter(maps)))
                assert "hg" in fields["VmFlags"].split()
                for qw in quantized:
                    assert qw.kernel[1][0] is qw.data  # bound again after the move
                pool = llm.executor.model.attention_layers[0].cache.pool
                assert "hg" in _mapping(pool.data_ptr())["VmFlags"].split() and not pool.any()
            else:
                assert not any("hg" in dict(m).get("VmFlags", "").split() for m in maps)
            answers.append(llm.generate(prompts, params))
        finally:
            llm.close()
    for a, b in zip(*answers):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_silu_mul_op_equals_torch_with_large_gates():
    """The compiled SiLU(gate) * up (the decode plan's and the grouped experts'): torch's values, and no NaN where a
    gate is far below -88 (exp of its negation overflows; the build assumes finite math)."""
    import torch.nn.functional as F

    from sharding.cpu import kernels

    assert kernels.build_kernels() and kernels.decode_glue_ops() is not None, "the CPU kernels did not build"
    silu_mul = kernels.decode_glue_ops()[2]
    gate = torch.cat([torch.linspace(-300, 300, 1001), torch.randn(999)]).reshape(4, 500)
    up = torch.randn(4, 500)
    got = silu_mul(torch.cat([gate, up], dim=1))
    assert not got.isnan().any()
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-5, atol=1e-6)
