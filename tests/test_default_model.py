"""The embedded default model (SmolLM2-135M-Instruct: 9 query heads, 3 KV heads) at uneven TP degrees."""

import pytest
from llm_runner import run_llm

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


# TP 3 is served in the fast tier by tests/server/test_default_model_server.py
@pytest.mark.parametrize("tp", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_default_model_knows_paris(tp):
    [result] = run_llm(tp, [{"messages": QUESTION, "max_tokens": 20, "max_model_len": 256}], timeout=600)
    assert "error" not in result, result
    assert "Paris" in result["outputs"][0]["text"], (tp, result["outputs"][0]["text"])
