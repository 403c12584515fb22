"""Pipeline and data parallelism beside TP: real ranks over gloo on 127.0.0.1, a tiny 5-layer model (no PP degree
tried divides it), greedy fp32 against transformers."""

import random

import pytest

from llm_runner import run_llm
from tiny import hf_greedy, make_checkpoint

MAX_TOKENS = 32
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory):
    folder = make_checkpoint(tmp_path_factory.mktemp("five"), "llama", num_hidden_layers=5)
    return folder, [hf_greedy(folder, p, MAX_TOKENS) for p in PROMPTS]


def check(result, expected):
    assert "error" not in result, result
    for out, (tokens, logprobs) in zip(result["outputs"], expected):
        assert out["token_ids"] == tokens
        worst = max(abs(float(logprobs[i, t]) - v) for i, step in enumerate(out["top_logprobs"]) for t, v in step)
        assert worst < 1e-4, worst


SLOW = pytest.mark.slow


@pytest.mark.parametrize("tp,pp,dp", [pytest.param(1, 2, 1, marks=SLOW), pytest.param(1, 3, 1, marks=SLOW), (2, 2, 1),
                                      pytest.param(1, 1, 2, marks=SLOW), pytest.param(2, 1, 2, marks=SLOW),
                                      pytest.param(1, 2, 2, marks=SLOW)])
def test_layouts_equal_transformers(five_layers, tp, pp, dp):
    folder, expected = five_layers
    job = {"model": str(folder), "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "logprobs": 5,
           "llm": {"pipeline_parallel_size": pp, "data_parallel_size": dp}}
    (result,) = run_llm(tp, [job], timeout=300)
    check(result, expected)
    if pp == 2:
        # rank 0 reads only its stage (the embedding and layers 0-2 of 5), and of it only its tensor-parallel share
        share = result["bytes_read"] / result["checkpoint_bytes"] * tp
        assert 0.3 < share < 0.7, share


@pytest.mark.slow
def test_layer_partition_override(five_layers):
    folder, expected = five_layers
    job = {"model": str(folder), "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "logprobs": 5,
           "llm": {"pipeline_parallel_size": 2}}
    (even,) = run_llm(1, [job], timeout=300)
    (skewed,) = run_llm(1, [job], timeout=300, env={"TPSERVE_PP_LAYER_PARTITION": "1,4"})
    check(skewed, expected)
    assert skewed["bytes_read"] < even["bytes_read"]  # stage 0 now holds one layer instead of three
    (bad,) = run_llm(1, [job], timeout=300, env={"TPSERVE_PP_LAYER_PARTITION": "3,3"})
    assert "layer partition '3,3' must give 2 stage(s)" in bad["error"]


def test_batched_equals_alone_with_steps_in_flight(five_layers):
    """16 requests of mixed lengths at PP=2 (two steps in flight): each equals the same request alone."""
    folder, _ = five_layers
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 380) for _ in range(rng.randrange(2, 60))] for _ in range(16)]
    job = {"model": str(folder), "prompts": prompts, "max_tokens": 24, "max_num_seqs": 8, "alone": True,
           "llm": {"pipeline_parallel_size": 2}}
    (result,) = run_llm(1, [job], timeout=300)
    assert "error" not in result, result
    assert [o["token_ids"] for o in result["outputs"]] == result["alone"]


@pytest.mark.parametrize("tp", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_sequence_parallel_equals_transformers(five_layers, tp):
    """Prefill steps run sequence parallel, decode steps plain TP: both prompts in one prefill step of 18 tokens,
    then each alone, 11 and 7 tokens (TP divides neither), in one server."""
    folder, _ = five_layers
    prompts = [list(range(30, 41)), list(range(50, 57))]
    expected = [hf_greedy(folder, p, MAX_TOKENS) for p in prompts]
    (result,) = run_llm(tp, [{"model": str(folder), "prompts": prompts, "max_tokens": MAX_TOKENS, "logprobs": 5,
                              "alone": True, "llm": {"sequence_parallel": True}}], timeout=300)
    check(result, expected)
    assert result["alone"] == [tokens for tokens, _ in expected]
    assert result["seq_parallel_steps"] == 3  # the three prefills; the decode steps are plain TP
