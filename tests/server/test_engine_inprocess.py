"""The engine and the scheduler in one process, against a fake executor with scripted logits (vLLM's
test_scheduler.py does the same): no ranks, no model, a step in microseconds (tests/helpers/fake_executor.py says
how the fake model makes a wrong block, position, token or adapter change the output).
"""

from __future__ import annotations

import pytest
import torch

from server.engine.lora_registry import Adapter, LoraRegistry
from server.engine.spec_decode.proposers import SpeculativeConfig
from sharding.wire import LOGITS_ALL
from tests.helpers.fake_executor import add, make_engine, next_token, prompts, reference
from tests.tiny import make_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder)
    return AutoTokenizer.from_pretrained(str(folder)), str(folder)


def test_preemption_recomputes_to_the_same_tokens(tok):
    """Four sequences of 40 tokens in a pool that holds about two: the latest admitted are preempted, recomputed
    with their generated tokens as prompt, and every output equals the reference."""
    engine, runner = make_engine(tok, num_blocks=24, block_size=4)
    seqs = [add(engine, tok[0], p, max_tokens=30) for p in prompts(4, 10)]
    engine.run_until_idle()
    assert engine.replicas.num_preemptions > 0
    for s in seqs:
        assert s.output_ids == reference(s.prompt_ids, 30, runner.vocab), s.seq_id
        assert s.finish_reason == "length"
    assert engine.replicas.pools[0].usage() == 0  # every block given back


def test_prefix_hits_and_chunked_prefill(tok):
    """A 37-token prompt in chunks of at most 8 tokens (a step budget of 8), then the same prompt again: the
    second one starts from the cached full blocks and computes only the rest, with the same output."""
    engine, runner = make_engine(tok, num_blocks=64, block_size=4, max_num_batched_tokens=8)
    prompt = prompts(1, 37, seed=1)[0]
    first = add(engine, tok[0], prompt, max_tokens=5)
    engine.run_until_idle()
    chunks = [r for s in runner.steps for r in s["rows"] if r[0] > 1]
    assert [n for n, *_ in chunks] == [8, 8, 8, 8, 5] and [st for _, st, *_ in chunks] == [0, 8, 16, 24, 32]
    runner.steps.clear()
    second = add(engine, tok[0], prompt, max_tokens=5)
    engine.run_until_idle()
    assert first.output_ids == second.output_ids == reference(prompt, 5, runner.vocab)
    assert second.num_cached_prompt == 36  # 9 full blocks of 4
    assert runner.steps[0]["rows"][0][:2] == (1, 36)  # only the last prompt token computed
    assert engine.replicas.prefix_hit_tokens == 36


def test_stops_and_prompt_logprobs(tok):
    """A stop token ends the answer at it; prompt logprobs (LOGITS_ALL rows over chunks) are every prompt token's
    logprob under the model, the same as the rows a one-step prefill gives."""
    engine, runner = make_engine(tok, num_blocks=64, max_num_batched_tokens=6)
    prompt = prompts(1, 15, seed=2)[0]
    ref = reference(prompt, 20, runner.vocab)
    stop = ref[6]
    s = add(engine, tok[0], prompt, max_tokens=20, stop_token_ids=[stop], prompt_logprobs=0)
    engine.run_until_idle()
    assert s.output_ids == ref[: ref.index(stop) + 1] and s.finish_reason == "stop"
    hit = torch.log_softmax(torch.tensor([8.0] + [0.0] * (runner.vocab - 1)), 0)
    expected = [float(hit[0]) if next_token(prompt[: i + 1], runner.vocab) == prompt[i + 1] else float(hit[1])
                for i in range(len(prompt) - 1)]
    assert s.prompt_logprobs == pytest.approx(expected)
    assert any(r[2] & LOGITS_ALL and r[0] > 1 for st in runner.steps for r in st["rows"])


def test_speculation_keeps_greedy_outputs_and_rolls_back(tok):
    """n-gram drafts verified as extra decode rows: rejected drafts roll back (their cache slots are written again
    by the next step), accepted ones skip steps, and the output is the reference either way."""
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    engine, runner = make_engine(tok, num_blocks=96, speculative=spec)
    seqs = [add(engine, tok[0], p, max_tokens=40) for p in prompts(3, 12, seed=3)]
    engine.run_until_idle()
    for s in seqs:
        assert s.output_ids == reference(s.prompt_ids, 40, runner.vocab)
    assert 0 < engine.speculator.num_accepted_tokens < engine.speculator.num_draft_tokens
    decode_steps = sum(1 for st in runner.steps if st["prefill"] == 0)
    assert decode_steps < 40  # accepted drafts saved steps


def test_a_dead_replica_moves_its_sequences_to_the_other(tok):
    """Two replicas; replica 1's launch fails and the supervisor confirms it: its sequences recompute on replica 0
    and finish with the reference output; replica 1 leaves rotation."""
    engine, runner = make_engine(tok, num_blocks=64, dp=2)
    confirmed = []
    engine.on_replica_failure = lambda replica, reason: confirmed.append((replica, reason)) or True
    seqs = [add(engine, tok[0], p, max_tokens=12) for p in prompts(4, 9, seed=4)]
    engine.step()  # both replicas get work
    runner.failing.add(1)
    engine.run_until_idle()
    assert [r for r, _ in confirmed] == [1] and "connection reset" in confirmed[0][1]
    assert engine.replicas.down.keys() == {1} and engine.replicas.alive == 1
    for s in seqs:
        assert s.output_ids == reference(s.prompt_ids, 12, runner.vocab)
    assert any(s.num_preemptions for s in seqs)  # the moved ones were recomputed


def test_lora_slots_admission_eviction_and_rows(tok):
    """Three adapters, two slots, one adapter per step (base rows may join it): every sequence is served with its own
    adapter (the fake model shifts by it), an idle adapter is evicted for a waiting one and read again when needed,
    and a retired adapter's slot is freed once nothing holds it."""
    engine, runner = make_engine(tok, num_blocks=96, max_num_seqs=2)
    registry = LoraRegistry("unused", "base", max_loras=1, max_cpu_loras=2, max_rank=8)
    adapters = [Adapter(f"a{i}", f"/adapters/a{i}") for i in (1, 2, 3)]
    for a in adapters:
        registry.register(a)
    engine.enable_lora(registry)
    plan = [adapters[0], adapters[1], adapters[2], None, None, adapters[0]]
    seqs = [add(engine, tok[0], p, lora=a, max_tokens=10) for p, a in zip(prompts(6, 7, seed=5), plan)]
    engine.run_until_idle()
    for s, a in zip(seqs, plan):
        assert s.output_ids == reference(s.prompt_ids, 10, runner.vocab, shift=int(a.name[1:]) if a else 0), a
    assert max(len({slot for *_, slot in st["rows"] if slot}) for st in runner.steps) == 1  # --max-loras
    assert any(len({slot for *_, slot in st["rows"]}) == 2 for st in runner.steps)  # base rows beside an adapter's
    # a3 evicted a1 (the least recently used idle one), which was read again for the fourth sequence
    assert adapters[0].loads == 2 and sum(a.loads for a in adapters) > 3
    assert all(c[3:] in (((), True), ((0,), False)) for c in runner.lora_calls if c[0] == "load")  # rank 0, then ranks
    held = next(a for a in adapters if a.slot)
    slot = held.slot
    registry.retire(held.name)
    engine.loras.retire(held)
    assert held.slot == 0 and registry.slots[slot] is None
    assert runner.lora_calls[-2:] == [("unload", slot, ()), ("unload", slot, (0,))]  # rank 0, then the ranks
