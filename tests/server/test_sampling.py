"""The batched sampler on crafted logits."""

import torch

from server.engine.sampler import SampleRow, SamplingParams, sample



def test_greedy_and_banned_ids():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 2.0, 1.0]])
    rows = [SampleRow(SamplingParams(temperature=0), None, [], [], []),
            SampleRow(SamplingParams(temperature=0), None, [], [], [0])]
    assert sample(logits, rows).token_ids == [1, 1]


def test_repetition_and_frequency_penalties():
    logits = torch.tensor([[4.0, 3.0, -1.0]])
    # repetition penalty 2 halves the positive logit of a seen token: 4 -> 2 < 3
    r = SampleRow(SamplingParams(temperature=0, repetition_penalty=2.0), None, [0], [], [])
    assert sample(logits, [r]).token_ids == [1]
    # frequency penalty 0.6 per occurrence: token 0 seen twice -> 4 - 1.2 = 2.8 < 3
    r = SampleRow(SamplingParams(temperature=0, frequency_penalty=0.6), None, [], [0, 0], [])
    assert sample(logits, [r]).token_ids == [1]
    r = SampleRow(SamplingParams(temperature=0, frequency_penalty=0.4), None, [], [0, 0], [])
    assert sample(logits, [r]).token_ids == [0]


def test_top_k_top_p_and_seeds():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = lambda **kw: {sample(logits, [SampleRow(SamplingParams(**kw), torch.Generator().manual_seed(s), [],
                                                    [], [])]).token_ids[0] for s in range(200)}
    assert draws(top_k=2) == {0, 1}
    assert draws(top_p=0.75) == {0, 1}  # 0.5 + 0.3 reaches 0.75: tokens 2 and 3 are cut
    assert draws(top_p=1.0) == {0, 1, 2, 3}
    a = sample(logits.repeat(3, 1), [SampleRow(SamplingParams(seed=1), torch.Generator().manual_seed(1), [], [], [])
                                     for _ in range(3)])
    b = sample(logits, [SampleRow(SamplingParams(seed=1), torch.Generator().manual_seed(1), [], [], [])])
    assert a.token_ids == [b.token_ids[0]] * 3  # a seeded row does not depend on its neighbours


def test_logprobs_are_raw_log_softmax():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    s = sample(logits, [SampleRow(SamplingParams(temperature=0, logprobs=2), None, [], [], [])])
    ref = torch.log_softmax(logits, -1)[0]
    assert abs(s.logprobs[0] - ref[2].item()) < 1e-6
    assert [t for t, _ in s.top_logprobs[0]] == [2, 1]


def test_degenerate_parameters_never_break_sampling():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    tiny_temp = SampleRow(SamplingParams(temperature=1e-300), torch.Generator().manual_seed(0), [], [], [])
    assert sample(logits, [tiny_temp]).token_ids == [2]
    all_banned = SampleRow(SamplingParams(temperature=1.0), torch.Generator().manual_seed(0), [], [], [0, 1, 2])
    assert sample(logits, [all_banned]).token_ids[0] in (0, 1, 2)


def test_logit_bias_moves_the_choice_of_its_row_only():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    rows = [SampleRow(SamplingParams(temperature=0, logit_bias={2: 10.0}), None, [], [], []),
            SampleRow(SamplingParams(temperature=0), None, [], [], [])]
    assert sample(logits, rows).token_ids == [2, 1]
    rows = [SampleRow(SamplingParams(temperature=0.7, seed=1, logit_bias={1: -100.0, 2: -100.0}),
                      torch.Generator().manual_seed(1), [], [], [])]
    assert sample(logits[:1], rows).token_ids == [0]  # the only token left with any mass
