"""The embedded default model at TP=3 (9 query heads over 3 ranks) through the official openai client."""

import openai


def test_default_model_answers_paris_at_tp3(server_factory):
    s = server_factory(None, 3, "--max-model-len", "256", "--max-num-seqs", "4", ready_timeout=600)
    client = openai.OpenAI(base_url=s.v1, api_key="x", max_retries=0, timeout=300)
    r = client.chat.completions.create(model=s.model_name, temperature=0, max_tokens=20,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_default_model_int8_served_at_tp2(server_factory):
    """`-q int8` end to end: the flag reaches both ranks, each quantizes its own shard, and the answer survives."""
    s = server_factory(None, 2, "-q", "int8", "--max-model-len", "256", "--max-num-seqs", "4", ready_timeout=600)
    client = openai.OpenAI(base_url=s.v1, api_key="x", max_retries=0, timeout=300)
    r = client.chat.completions.create(model=s.model_name, temperature=0, max_tokens=20,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
