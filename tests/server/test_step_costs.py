"""The prefill cap measured from step times (server/engine/scheduler.py StepCosts): the estimates, the cap they give,
the scheduler holding a long prompt's chunks to it, and a real model's steps measured end to end."""

from __future__ import annotations

import pytest

from server.engine.scheduler import FIRST_PREFILL_CAP, STALL_STEPS, StepCosts


def test_cap_from_measured_decode_and_prefill_costs():
    costs = StepCosts(attention_depth=None, budget=512)
    assert costs.cap() == FIRST_PREFILL_CAP  # nothing measured yet
    for _ in range(20):
        costs.observe(4, [], 0.010)  # decode-only steps of 10 ms
    assert costs.cap() == FIRST_PREFILL_CAP  # no prefill measured yet
    for n in (64, 30, 50, 40, 45, 40, 40, 40, 40, 40, 40, 40, 40, 40, 40, 40):
        costs.observe(4, [(0, n)], 0.010 + 0.0005 * n)  # each prefill token adds 0.5 ms
    assert costs.decode == pytest.approx(0.010)
    assert costs.per_token == pytest.approx(0.0005)
    assert costs.cap() == int((STALL_STEPS - 1) * 0.010 / 0.0005)  # the tokens that add STALL_STEPS - 1 decode steps


def test_depth_is_scaled_back_and_the_cap_is_bounded():
    a = 1000
    costs = StepCosts(attention_depth=a, budget=512)
    for _ in range(10):
        costs.observe(2, [], 0.004)
    # a chunk of 10 tokens at depth 3000: each costs (a + 3005) / a of a token at depth 0
    for _ in range(30):
        costs.observe(2, [(3000, 10)], 0.004 + 10 * 0.001 * (a + 3005) / a)
    assert costs.per_token == pytest.approx(0.001)  # per token at depth 0
    assert costs.cap() == int((STALL_STEPS - 1) * 0.004 / 0.001)
    cheap = StepCosts(None, budget=100)
    cheap.observe(1, [], 0.5)
    cheap.observe(1, [(0, 10)], 0.5 + 1e-6)
    assert cheap.cap() == 100  # never past the step budget
    dear = StepCosts(None, budget=100)
    dear.observe(1, [], 0.001)
    dear.observe(1, [(0, 10)], 1.0)
    assert dear.cap() == 1  # at least one token a step
    alone = StepCosts(None, budget=512)
    alone.observe(0, [(0, 100)], 0.2)  # prefill with nothing decoding: an upper bound per token
    alone.observe(3, [], 0.01)
    assert alone.per_token == pytest.approx(0.002) and alone.cap() == int((STALL_STEPS - 1) * 0.01 / 0.002)


def test_a_real_engine_measures_its_steps_and_keeps_the_answers(checkpoints):
    """Short prompts decode while a long one prefills (a small step budget): the lane measures its decode steps and
    its prefill tokens, the cap follows them, and the greedy answers equal a run with no cap."""
    from server.engine.sampler import SamplingParams
    from server.llm import LLM

    prompts = [[5 + i, 6, 7, 8] for i in range(4)] + [list(range(3, 200))]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    answers = {}
    for cap in ("auto", 0):
        llm = LLM(str(checkpoints("llama")), max_num_seqs=8, kv_cache_memory=8 << 20, max_num_batched_tokens=48,
                  max_prefill_tokens_while_decoding=cap)
        sched = llm.engine.lanes[0].scheduler
        held = []  # per step with decoders: (prefill tokens scheduled, the cap then)
        schedule = sched.schedule

        def watched():
            limit = sched.prefill_cap()
            out = schedule()
            decode = [it for it in out.items if it.n == 1 and it.start >= len(it.seq.prompt_ids)]
            if decode:
                held.append((sum(it.n for it in out.items if it not in decode), limit))
            return out

        sched.schedule = watched
        try:
            answers[cap] = [o.token_ids for o in llm.generate(prompts, params)]
            # while streams decode, a step's prefill stays within the cap of that moment (the long prompt runs
            # alongside them: some step carries a chunk)
            assert any(n for n, _ in held) and all(not limit or n <= limit for n, limit in held), held
            if cap == "auto":
                costs = sched.costs
                assert costs.decode is not None and costs.decode > 0
                assert costs.per_token is not None and costs.per_token > 0
                assert 1 <= sched.prefill_cap() <= 48
                want = int(min(48, max(1, (STALL_STEPS - 1) * costs.decode / costs.per_token)))
                assert sched.prefill_cap() == want
            else:
                assert sched.costs is None and not sched.prefill_cap()
        finally:
            llm.close()
    assert answers["auto"] == answers[0]
