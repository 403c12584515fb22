"""The paged KV cache end to end: prefix caching, chunked prefill and preemption change no token (greedy, fp32,
against transformers, at TP 1 and 2); the prefix cache hits what it should; a long prompt is prefilled in chunks while
the other streams keep decoding; the memory budget, its errors and its metrics, on a real server."""

import json
import re
import subprocess
import sys

import httpx
import openai
import pytest

from llm_runner import run_llm
from tiny import hf_greedy

BLOCK = 8  # tokens per block in these tests
MAX_TOKENS = 24


def prompts_for(vocab: int) -> list[list[int]]:
    """Prompts that share nothing, part of a block, and several full blocks with each other, plus a long one."""
    shared = [(7 * i + 5) % (vocab - 10) + 5 for i in range(3 * BLOCK)]  # three full blocks
    return [
        shared + [11, 12, 13],  # shares three full blocks with the next one
        shared + [21, 22, 23, 24, 25],
        shared[:4] + [31, 32],  # part of a block only
        [40 + i for i in range(5)],  # nothing
        [(13 * i + 3) % (vocab - 10) + 5 for i in range(80)],  # 5x the step budget below
    ]


@pytest.fixture(scope="module")
def case(checkpoints):
    folder = checkpoints("llama")
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    prompts = prompts_for(vocab)
    return folder, prompts, [hf_greedy(folder, p, MAX_TOKENS)[0] for p in prompts]


def job(folder, prompts, **llm):
    return {"model": str(folder), "prompts": prompts, "max_tokens": MAX_TOKENS, "repeat": 2,
            "llm": {"block_size": BLOCK, **llm}}


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_caching_chunking_and_preemption_keep_transformers_tokens(case, tp):
    """Prefix caching on and off, one large step and 16-token chunks, a roomy pool and one so small that sequences
    are preempted: every output equals transformers', in the first round and when the same prompts come again."""
    folder, prompts, expected = case
    # bytes of one block per rank: 2 layers x K,V x 4 KV heads / tp x 8 tokens x head_dim 8 x 4 bytes
    per_block = 2 * 2 * (4 // tp) * BLOCK * 8 * 4
    jobs = [
        job(folder, prompts, enable_prefix_caching=True, max_num_batched_tokens=16),
        job(folder, prompts, enable_prefix_caching=False, max_num_batched_tokens=4096),
        # room for about two of the sequences at once: the rest are preempted and recomputed
        job(folder, prompts, enable_prefix_caching=True, max_num_batched_tokens=16, kv_cache_memory=20 * per_block),
    ]
    results = run_llm(tp, jobs, timeout=600)
    for name, res in zip(("cached+chunked", "uncached, one step", "tiny pool"), results):
        assert "error" not in res, res
        got = [o["token_ids"] for o in res["outputs"]]
        for i, (g, e) in enumerate(zip(got, expected)):
            assert g == e, f"{name}: prompt {i} differs from transformers"
        assert res["repeats"][0] == expected, f"{name}: second round differs"
    cached, uncached, tiny = results
    assert cached["prefix_hit_tokens"] > 0 and uncached["prefix_hit_tokens"] == 0
    assert tiny["preemptions"] > 0 and cached["preemptions"] == 0


def test_a_repeated_prompt_hits_exactly_its_full_blocks(case):
    """The first request warms the cache; the same prompt again skips its full blocks but the last token's:
    (40 - 1) // 8 = 4 blocks = 32 tokens. Echo + logprobs needs every prompt token's logits: it bypasses the cache
    and its prompt logprobs equal the uncached, unchunked ones."""
    folder, _, _ = case
    prompt = [[(5 * i + 9) % 300 + 5 for i in range(40)]]
    res = run_llm(1, [job(folder, prompt, max_num_batched_tokens=16),
                      dict(job(folder, prompt, max_num_batched_tokens=16), prompt_logprobs=0),
                      dict(job(folder, prompt, enable_prefix_caching=False, max_num_batched_tokens=4096),
                           prompt_logprobs=0, repeat=1)])
    plain, echo_chunked, echo_reference = res
    assert plain["prefix_hit_tokens"] == 32
    assert plain["repeats"][0] == [plain["outputs"][0]["token_ids"]]
    assert echo_chunked["prefix_hit_tokens"] == 0
    got, ref = echo_chunked["outputs"][0]["prompt_logprobs"], echo_reference["outputs"][0]["prompt_logprobs"]
    assert len(got) == len(ref) == 39
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-4


def test_streams_get_a_token_in_every_step_of_a_chunked_prefill(case):
    """A prompt 5x the step's token budget is prefilled over several steps; every other sequence, once decoding,
    gets exactly one token in each of those steps."""
    folder, prompts, expected = case
    short = [[50 + i, 51 + i, 52 + i] for i in range(3)]
    long_prompt = prompts[-1]
    res = run_llm(1, [dict(job(folder, short + [long_prompt], max_num_batched_tokens=16), max_num_seqs=4,
                           trace=True, repeat=1)])[0]
    assert "error" not in res, res
    assert res["outputs"][-1]["token_ids"] == expected[-1]
    trace = res["trace"]
    prefill_steps = [i for i, row in enumerate(trace) if 0 < row[3][1] < len(long_prompt)]
    assert len(prefill_steps) >= 5, trace[:8]  # 80 tokens in steps of at most 16 - 3 decoding tokens
    for i in prefill_steps[1:]:
        for s in range(3):
            before, after = trace[i - 1][s][0], trace[i][s][0]
            if 0 < before < MAX_TOKENS:
                assert after == before + 1, f"stream {s} got {after - before} tokens in step {i}"


# ---- a real server ----------------------------------------------------------------------------------------------

def rss_bytes(pid: int) -> int:
    total = 0
    for p in [pid] + [int(c) for c in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                                        text=True).stdout.split()]:
        with open(f"/proc/{p}/status") as f:
            total += int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) * 1024
    return total


def metric(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert m, name
    return float(m.group(1))


@pytest.fixture(scope="module")
def small_pool(server_factory, checkpoints):
    """A pool of 12 blocks of 8 tokens = 96 tokens (2 layers x K,V x 4 heads x 8 x 8 x 4 bytes = 2 KiB a layer)."""
    return server_factory(checkpoints("llama"), 1, "--kv-cache-memory", "48KiB", "--block-size", "8",
                          "--max-num-seqs", "8", "--max-num-batched-tokens", "16")


@pytest.fixture(scope="module")
def roomy(server_factory, checkpoints):
    return server_factory(checkpoints("llama"), 1, "--max-num-seqs", "8")


def test_server_under_a_tiny_pool_preempts_and_answers_like_a_roomy_one(small_pool, roomy):
    """8 concurrent requests on a 96-token pool force preemptions; every answer equals the one a roomy server gives;
    a request that can never fit gets a 400 that names the limit; the metrics count hits and preemptions."""
    import asyncio

    # ~36 tokens each (two full blocks of 16 on the roomy server); with 40 more, 10 of the small pool's 12 blocks
    prompts = [f"Hello world! {i} How are you today? I am fine, thank you. The capital of France is Paris."
               for i in range(8)]

    async def run(srv):
        async with openai.AsyncOpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=120) as client:
            outs = await asyncio.gather(*[client.completions.create(model=srv.model_name, prompt=p, max_tokens=40,
                                                                    temperature=0, extra_body={"ignore_eos": True})
                                          for p in prompts])
        return [o.choices[0].text for o in outs]

    assert asyncio.run(run(small_pool)) == asyncio.run(run(roomy))
    assert metric(small_pool, "tpserve_num_preemptions_total") > 0
    assert metric(roomy, "tpserve_num_preemptions_total") == 0
    # the same prompts again hit their cached full blocks (two each, of 16 tokens)
    before = metric(roomy, "tpserve_prefix_cache_hits_total")
    asyncio.run(run(roomy))
    assert metric(roomy, "tpserve_prefix_cache_hits_total") - before >= 8 * 32
    assert 0 <= metric(roomy, "tpserve_kv_cache_usage_ratio") <= 1
    # the default max model length (256) was lowered to what the pool holds; beyond it: a 400 in OpenAI's shape
    r = httpx.post(small_pool.v1 + "/completions", json={"model": small_pool.model_name, "prompt": "Hello",
                                                         "max_tokens": 200}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and "96 tokens" in err["message"] and err["code"] == "context_length_exceeded"


def test_a_multi_turn_chat_replay_answers_the_same_with_and_without_the_cache(roomy, server_factory, checkpoints):
    """Each turn resends the whole conversation: with prefix caching its earlier blocks are hits, and every answer
    equals the one a server without the cache gives (greedy)."""
    uncached = server_factory(checkpoints("llama"), 1, "--max-num-seqs", "8", "--no-enable-prefix-caching")

    def replay(srv) -> list[str]:
        client = openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=120)
        messages, answers = [], []
        for turn in ("Hello world! How are you today?", "The capital of France is", "I am fine, thank you.",
                     "Tensor parallelism splits every weight matrix"):
            messages.append({"role": "user", "content": turn})
            r = client.chat.completions.create(model=srv.model_name, messages=messages, max_tokens=12, temperature=0)
            answers.append(r.choices[0].message.content)
            messages.append({"role": "assistant", "content": answers[-1]})
        return answers

    before = metric(roomy, "tpserve_prefix_cache_hits_total")
    assert replay(roomy) == replay(uncached)
    assert metric(roomy, "tpserve_prefix_cache_hits_total") >= before + 16  # at least one full block per later turn
    assert metric(uncached, "tpserve_prefix_cache_hits_total") == 0


def test_the_pool_is_resident_from_the_start_and_sized_by_the_budget(server_factory, checkpoints):
    """Two servers that differ only in --kv-cache-memory differ in resident memory by that much (within 5 %):
    the pool is allocated once at start, not per request."""
    folder = checkpoints("llama")
    small = server_factory(folder, 1, "--kv-cache-memory", "8MiB")
    large = server_factory(folder, 1, "--kv-cache-memory", "200MiB")
    grown = rss_bytes(large.proc.pid) - rss_bytes(small.proc.pid)
    assert abs(grown - 192 * 2**20) < 0.05 * 192 * 2**20, grown / 2**20


def test_a_cache_too_small_for_one_sequence_is_refused_with_a_clear_message(checkpoints):
    proc = subprocess.run([sys.executable, "-m", "server.cli.main", "serve", str(checkpoints("llama")), "--port", "0",
                           "--kv-cache-memory", "16KiB", "--max-model-len", "256"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "raise --kv-cache-memory to at least" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("args,message", [
    (["--kv-cache-memory", "lots"], "is not a size"),
    (["--kv-cache-memory", "0"], "more than 0 bytes"),
    (["--max-num-batched-tokens", "4", "--max-num-seqs", "8"], "must be at least --max-num-seqs"),
])
def test_bad_budget_flags_are_refused_with_a_clear_message(checkpoints, args, message):
    """Refused while the flags are read, before any model is opened: through the entry point in this process."""
    from conftest import cli_in_process

    code, err = cli_in_process(["serve", str(checkpoints("llama")), "--port", "0", *args])
    assert code != 0 and message in err and "Traceback" not in err, err[-2000:]
