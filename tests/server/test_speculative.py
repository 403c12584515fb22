"""Speculative decoding: the proposers, and verification that changes no greedy token and no sampled distribution.

Most tests run the offline engine (real ranks) with an oracle proposer: it proposes transformers' own continuation
with wrong tokens planted at chosen places, so every path of verification runs on purpose (all drafts kept, a
rejection at each position, a stop, EOS or max_tokens inside a kept run), on a tiny random model whose own text
would rarely repeat. The n-gram proposer itself is checked on its lookup rules and, end to end, through the server.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from server.llm import LLM
from server.engine.sampler import SamplingParams
from server.engine.spec_decode.proposers import NgramIndex, SuffixTrie, parse_speculative_config
from tiny import hf_greedy

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 64}
PROMPTS = [[5, 9, 17, 33, 65, 100, 5, 9, 17], [1, 2, 3, 4, 1, 2, 3, 7, 8, 9, 10, 11], list(range(40, 75))]


def oracle(references: dict[tuple, list[int]], wrong_every: int = 3):
    """A proposer that knows each prompt's greedy continuation and plants a wrong token at every `wrong_every`-th
    position of it (counting from the sequence's start), so that runs of kept drafts end at many positions."""
    def propose(seq, running, room):
        ref = references[tuple(seq.prompt_ids)]
        at = len(seq.output_ids)  # the first draft guesses what the token being decoded now (the last) produces
        drafts = list(ref[at : at + min(room, 4)])
        for j in range(len(drafts)):
            if (at + j) % wrong_every == 0:
                drafts[j] = (drafts[j] + 1) % 300
        return drafts
    return propose


@pytest.fixture(scope="module")
def folder(checkpoints):
    return checkpoints("llama")


@pytest.fixture(scope="module")
def references(folder):
    return {tuple(p): hf_greedy(folder, p, 24)[0] for p in PROMPTS}


@pytest.mark.parametrize("tp", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_greedy_identity_with_preemption_chunks_and_prefix_hits(folder, references, tp):
    # a pool of 10 blocks of 8 for 6 sequences of up to 59 tokens: they preempt each other; 8-token steps chunk the
    # prompts; the last round starts from cached blocks
    kv_heads = {1: 4, 2: 2, 3: 2}[tp]  # the tiny Llama's 4 KV heads per rank (replicated where 3 ranks share 4)
    block_bytes = 2 * kv_heads * 8 * 8 * 4 * 2  # K and V, 8 tokens of head_dim 8, float32, 2 layers
    with LLM(str(folder), tp, max_num_seqs=6, block_size=8, kv_cache_memory=10 * block_bytes,
             max_num_batched_tokens=8, max_model_len=64, speculative_config=NGRAM) as llm:
        assert llm.executor.num_blocks == 10
        llm.engine.speculator.propose = oracle(references)
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        out = llm.generate(PROMPTS + PROMPTS, params)
        for _ in range(2):  # the second time from the blocks the first left in the prefix cache
            out += llm.generate(PROMPTS[2:], params)
        e = llm.engine
        assert [c.token_ids for c in out] == [references[tuple(p)] for p in PROMPTS + PROMPTS + PROMPTS[2:] * 2]
        assert e.replicas.num_preemptions > 0 and e.speculator.num_accepted_tokens > 0 and e.speculator.num_draft_tokens > e.speculator.num_accepted_tokens
        assert sum(p.prefix_hit_tokens for p in e.replicas.pools) > 0
        # a wrong draft every third position: runs of two kept drafts at most, never a third
        assert e.speculator.accepted_per_position[1] > 0 and e.speculator.accepted_per_position[2] == 0


@pytest.mark.parametrize("layout", [{"pipeline_parallel_size": 2}, {"data_parallel_size": 2}], ids=["pp2", "dp2"])
def test_greedy_identity_over_pipeline_lanes_and_replicas(folder, references, layout):
    with LLM(str(folder), 1, max_num_seqs=4, speculative_config=NGRAM, **layout) as llm:
        llm.engine.speculator.propose = oracle(references)
        out = llm.generate(PROMPTS * 2, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        assert [c.token_ids for c in out] == [references[tuple(p)] for p in PROMPTS * 2]
        assert llm.engine.speculator.num_accepted_tokens > 0 and len(llm.engine.lanes) == 2


def test_suffix_method_learns_from_earlier_outputs(folder, references):
    suffix = {**NGRAM, "method": "suffix", "prompt_lookup_min": 2}
    with LLM(str(folder), speculative_config=suffix) as llm:
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        first = llm.generate([PROMPTS[2]], params)[0].token_ids
        before = llm.engine.speculator.num_accepted_tokens
        again = llm.generate([PROMPTS[2]], params)[0].token_ids  # its output is now in the trie
        gained = llm.engine.speculator.num_accepted_tokens - before
    assert first == again == references[tuple(PROMPTS[2])]
    assert gained >= 12  # most of the repeated output came as accepted drafts


def test_stops_inside_a_kept_run(folder, references):
    prompt = PROMPTS[2]
    ref = references[tuple(prompt)]
    with LLM(str(folder), speculative_config=NGRAM) as llm:
        llm.engine.speculator.propose = oracle(references, wrong_every=1000)  # every draft right
        cases = {"max_tokens": SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                 "stop_token_ids": SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                  stop_token_ids=[ref[6]]),
                 "eos": SamplingParams(max_tokens=24, temperature=0),
                 "logprobs": SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)}
        spec = {name: llm.generate([prompt], p)[0] for name, p in cases.items()}
        text = spec["logprobs"].text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        spec["stop"] = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                             stop=[stop]))[0]
        assert llm.engine.speculator.accepted_per_position[3] > 0  # runs of four kept drafts
    with LLM(str(folder)) as llm:
        cases["stop"] = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
        base = {name: llm.generate([prompt], p)[0] for name, p in cases.items()}
    for name in cases:
        assert (spec[name].token_ids, spec[name].text, spec[name].finish_reason) == \
            (base[name].token_ids, base[name].text, base[name].finish_reason), name
    assert len(spec["max_tokens"].token_ids) == 6
    assert spec["stop_token_ids"].token_ids[-1] == ref[6] and len(spec["stop_token_ids"].token_ids) <= 7
    assert spec["stop"].finish_reason == "stop" and stop not in spec["stop"].text
    torch.testing.assert_close(torch.tensor(spec["logprobs"].logprobs), torch.tensor(base["logprobs"].logprobs),
                               rtol=0, atol=1e-5)


def test_grammar_constrained_request_under_speculation(folder, references):
    prompt = PROMPTS[0]
    regex = r"[a-z ]{3,30}\."
    with LLM(str(folder), speculative_config=NGRAM) as llm:
        tok = llm.tokenizer
        words = tok.encode("hello world hello world hello world.")
        llm.engine.speculator.propose = lambda seq, running, room: words[len(seq.output_ids):][:4]
        spec = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0), regex=regex)[0]
        drafts = llm.engine.speculator.num_draft_tokens
    with LLM(str(folder)) as llm:
        base = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0), regex=regex)[0]
    assert drafts > 0
    assert (spec.token_ids, spec.text) == (base.token_ids, base.text)


def test_sampling_keeps_the_target_distribution_and_seeds(folder):
    """Two sampled tokens, many seeds: each position's token frequencies against the exact distribution (top-k 4,
    temperature 1.3, a presence penalty), with drafts proposing the most likely token and what followed it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    prompt = PROMPTS[1]
    params = dict(temperature=1.3, top_k=4, presence_penalty=0.5, max_tokens=2, ignore_eos=True)

    def dist(logits, seen):
        logits = logits.clone() / 1.0
        logits[list(set(seen))] -= 0.5  # presence penalty over the output so far
        logits = logits / 1.3
        top = logits.topk(4)
        p = torch.zeros_like(logits)
        p[top.indices] = torch.softmax(top.values, -1)
        return p

    with torch.inference_mode():
        p1 = dist(model(torch.tensor([prompt])).logits[0, -1], [])
        first = p1.nonzero().squeeze(1).tolist()
        rows = model(torch.tensor([prompt + [t] for t in first])).logits[:, -1]
    p2 = torch.zeros_like(p1)
    for t, row in zip(first, rows):
        p2 += p1[t] * dist(row, [t])
    # the first token comes from the prompt's prefill; the second is drafted: its most likely value after the first
    best_next = {t: int(dist(row, [t]).argmax()) for t, row in zip(first, rows)}
    n = 1200

    def propose(seq, running, room):
        return [best_next.get(seq.output_ids[0], 0)][:room] if len(seq.output_ids) == 1 else []

    with LLM(str(folder), max_num_seqs=32, speculative_config=NGRAM) as llm:
        llm.engine.speculator.propose = propose
        out = llm.generate([prompt] * n, SamplingParams(**{**params, "max_tokens": 3}))
        seeded = [c.token_ids for c in llm.generate([prompt] * 8, SamplingParams(**params, seed=7))]
        seeded4 = [c.token_ids for c in llm.generate([prompt] * 8, SamplingParams(**{**params, "max_tokens": 4},
                                                                                     seed=11))]
        e = llm.engine
        assert e.speculator.num_accepted_tokens > n // 8 and e.speculator.num_draft_tokens > e.speculator.num_accepted_tokens
    with LLM(str(folder), max_num_seqs=32) as llm:
        base_seeded = [c.token_ids for c in llm.generate([prompt] * 8, SamplingParams(**params, seed=7))]
        base_seeded4 = [c.token_ids for c in llm.generate([prompt] * 8, SamplingParams(**{**params, "max_tokens": 4},
                                                                                          seed=11))]
    assert seeded == base_seeded and seeded4 == base_seeded4  # a seed gives the same tokens with speculation
    for pos, exact in ((0, p1), (1, p2)):
        counts = torch.bincount(torch.tensor([c.token_ids[pos] for c in out]), minlength=exact.numel()).float()
        support = exact > 0
        assert counts[~support].sum() == 0  # nothing outside top-k
        expected = exact[support] * n
        chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
        dof = int(support.sum()) - 1
        assert chi2 < dof + 6 * (2 * dof) ** 0.5 + 10, (pos, chi2, dof)  # far below the 1e-6 tail


@pytest.mark.slow
def test_draft_model_at_tp2(folder, references, tmp_path, tool_checkpoint):
    """The served model as its own draft keeps every proposal; another random model with the same tokenizer keeps
    almost none; both give transformers' tokens, and the draft's pool is empty again afterwards."""
    from tiny import make_checkpoint

    other = make_checkpoint(tmp_path / "draft", "llama", seed=1, num_hidden_layers=1)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    kept = {}
    for name, draft in (("self", folder), ("other", other)):
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
        with LLM(str(folder), 2, speculative_config=spec) as llm:
            out = llm.generate(PROMPTS, params)
            e = llm.engine
            assert [c.token_ids for c in out] == [references[tuple(p)] for p in PROMPTS], name
            kept[name] = (e.speculator.num_accepted_tokens, e.speculator.num_draft_tokens)
            assert e.speculator.draft.blocks.usage() == 0 and len(e.speculator.draft.free_rows) == 32
    assert kept["self"][0] == kept["self"][1] > 20
    assert kept["other"][0] < kept["other"][1] // 2
    with pytest.raises(ValueError, match="another vocabulary"):  # the tool model's tokenizer is another one
        LLM(str(folder), speculative_config={"method": "draft_model", "model": str(tool_checkpoint)})


def test_ngram_lookup_rules():
    idx = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]  # (the sequence's token list, growing in place)
    idx.extend(tokens)
    assert idx.propose(2) == [7, 5]  # the longest suffix (1 2 3), at its most recent earlier occurrence
    tokens += [4, 5, 6]
    assert idx.propose(3) == []  # neither 6, "5 6" nor "4 5 6" occurred before
    tokens.append(2)
    assert idx.propose(2) == [3, 4]  # only "2" matches: its latest occurrence (index 10) was followed by 3 4
    trie = SuffixTrie(max_tokens=12, depth=4)
    trie.add([10, 11, 12, 13])
    trie.add([10, 11, 14, 15])
    trie.add([10, 11, 14, 16])
    assert trie.propose([99, 10, 11], 2, 1) == [14, 15]  # the most frequent continuation, first seen among equals
    trie.add([20, 21, 22, 23])  # past 12 tokens: the oldest output leaves
    assert trie.size <= 12 and trie.propose([11, 12], 2, 2) == []


@pytest.mark.parametrize("text, words", [
    ("{bad", "not valid JSON"),
    ('{"method": "ngram", "num_speculative_token": 3}', "unknown key"),
    ('{"method": "medusa"}', "method must be one of"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "must not exceed"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "positive integer"),
    ('{"method": "draft_model", "model": "/nonexistent"}', "needs \"model\""),
    ('{"method": "draft_model", "model": "/", "draft_tensor_parallel_size": 2}', "draft_tensor_parallel_size 1"),
    ('{"method": "ngram", "model": "/"}', "apply to draft_model"),
])
def test_bad_configurations_are_refused(text, words):
    with pytest.raises(ValueError, match=words):
        parse_speculative_config(text)


def test_cli_refuses_a_bad_config_before_starting_ranks(folder, tool_checkpoint):
    from conftest import cli_in_process

    code, err = cli_in_process(["serve", str(folder), "--speculative-config", '{"method": "ngram", "bogus": 1}'])
    assert code == 2 and "unknown key(s) bogus" in err, err[-2000:]
    draft = json.dumps({"method": "draft_model", "model": str(tool_checkpoint)})
    code, err = cli_in_process(["serve", str(folder), "-tp", "2", "--speculative-config", draft])
    assert code == 2 and "another vocabulary" in err and "loading weights" not in err, err[-2000:]


def test_server_streams_metrics_and_the_start_line(server_factory, tool_checkpoint):
    """The trained tool model writes its call, whose JSON the prompt's tool list already spells: n-gram lookup
    finds it. The answer equals the one without speculation; the stream too (chunks of several tokens)."""
    import tool_model

    s = server_factory(tool_checkpoint, 2, "--tool-call-parser", "hermes", "--speculative-config", json.dumps(NGRAM))
    assert "speculative decoding: n-gram lookup of 1-3 tokens, up to 4 tokens" in s.log.read_text()
    body = {"model": s.model_name, "messages": tool_model.QUESTION, "tools": [tool_model.WEATHER_TOOL],
            "temperature": 0, "max_tokens": 60}
    r = httpx.post(s.v1 + "/chat/completions", json=body, timeout=60).json()["choices"][0]
    (call,) = r["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"} and r["finish_reason"] == "tool_calls"
    text = httpx.post(s.v1 + "/completions", timeout=60, json={
        "model": s.model_name, "prompt": tool_model.render(_tokenizer(tool_checkpoint), tool_model.QUESTION),
        "max_tokens": 60, "temperature": 0}).json()["choices"][0]["text"]
    assert text == tool_model.CALL_TEXT
    chunks = []
    with httpx.stream("POST", s.v1 + "/chat/completions", json={**body, "tools": None, "stream": True},
                      timeout=60) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
    plain = httpx.post(s.v1 + "/chat/completions", json={**body, "tools": None}, timeout=60).json()
    assert "".join(chunks) == plain["choices"][0]["message"]["content"]
    metrics = {line.split()[0]: float(line.split()[1]) for line in httpx.get(s.url + "/metrics").text.splitlines()
               if line.startswith("tpserve_spec_decode")}
    assert metrics["tpserve_spec_decode_num_drafts_total"] > 0
    drafted, accepted = (metrics[f"tpserve_spec_decode_num_{x}_tokens_total"] for x in ("draft", "accepted"))
    assert drafted >= accepted > 0
    per_pos = [v for k, v in metrics.items() if k.startswith("tpserve_spec_decode_num_accepted_tokens_per_pos_total")]
    assert per_pos and sum(per_pos) == accepted


def _tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
