"""Same checkpoint, same prompts, greedy: tpserve's tokens equal transformers' at TP 1, 2, 3 and 4, and its
log-probabilities are within 1e-4 (fp32). Each TP degree runs every architecture in one fresh process."""

import pytest
from transformers import AutoTokenizer

from llm_runner import run_llm
from tiny import ARCHS, hf_greedy, make_checkpoint

PROMPTS = ["The capital of France is", "Hello world! How are you today? I am fine, thank you. Tensor"]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def reference(checkpoints, tmp_path_factory):
    ref = {}
    for arch in ARCHS:
        folder = checkpoints(arch)
        tok = AutoTokenizer.from_pretrained(str(folder))
        prompts = [tok.encode(p) for p in PROMPTS]
        ref[arch] = (folder, prompts, [hf_greedy(folder, p, MAX_TOKENS) for p in prompts])
    # the llama checkpoint again, split into several files with an index
    sharded = make_checkpoint(tmp_path_factory.mktemp("sharded"), "llama", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    ref["llama_sharded"] = (sharded, ref["llama"][1], ref["llama"][2])
    return ref


def check(arch, result, ref):
    folder, prompts, expected = ref[arch]
    assert "error" not in result, result
    for out, (tokens, logprobs) in zip(result["outputs"], expected):
        assert out["token_ids"] == tokens, arch
        worst = max(abs(float(logprobs[i, t]) - v) for i, step in enumerate(out["top_logprobs"]) for t, v in step)
        assert worst < 1e-4, (arch, worst)


# TP 2 in the fast tier: the head layouts that split differently (GQA 8/4, 6/2 with q/k/v biases, Qwen3's q/k norms,
# MHA with every bias); the slow tier adds the rest (TP 1 runs every one in the fast tier)
TP2_FAST = ["llama", "qwen2", "qwen3", "llama_mha_bias"]


@pytest.mark.parametrize("tp, which", [(1, "all"), (2, "fast"), pytest.param(2, "rest", marks=pytest.mark.slow),
                                       pytest.param(3, "all", marks=pytest.mark.slow),
                                       pytest.param(4, "all", marks=pytest.mark.slow)])
def test_greedy_equals_transformers(reference, tp, which):
    archs = [a for a in reference if which == "all" or (a in TP2_FAST) == (which == "fast")]
    jobs = [{"model": str(reference[a][0]), "prompts": reference[a][1], "max_tokens": MAX_TOKENS, "logprobs": 5}
            for a in archs]
    results = run_llm(tp, jobs, timeout=600)
    for arch, result in zip(archs, results):
        check(arch, result, reference)
        # rank 0 reads its own shard only: about 1/TP of the checkpoint (more where KV heads are replicated or
        # blocks are uneven); every tensor exactly once at TP=1
        share = result["bytes_read"] / result["checkpoint_bytes"]
        if tp == 1:
            assert share == 1.0, (arch, share)
        else:
            assert share < 1 / tp + 0.1, (arch, tp, share)
