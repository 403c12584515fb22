"""The embedded default model (SmolLM2-135M-Instruct: 9 query heads, 3 KV heads) at uneven TP degrees."""

from llm_runner import run_llm

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_default_model_knows_paris_at_tp2_and_tp3():
    for tp in (2, 3):
        [result] = run_llm(tp, [{"messages": QUESTION, "max_tokens": 20, "max_model_len": 256}], timeout=600)
        assert "error" not in result, result
        assert "Paris" in result["outputs"][0]["text"], (tp, result["outputs"][0]["text"])
