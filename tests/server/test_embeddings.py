"""/v1/embeddings against transformers' hidden states, pooled the same way, through the official `openai` client.

Three servers: the default (last token, L2-normalized, TP 1); mean pooling without normalization over two pipeline
stages with a step budget small enough that every input is prefilled over several chunks; and at TP 2 a
sentence-transformers folder (CLS pooling + Normalize in modules.json, Matryoshka dimensions in config.json) whose own
config the server honours.
"""

import base64
import json
import shutil

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

TEXTS = ["The capital of France is Paris.", "Hello world! How are you today?",
         "Tensor parallelism splits every weight matrix over several ranks. " * 3]


def reference(folder, ids: list[int], pooling: str, normalize: bool, dims: int | None = None) -> np.ndarray:
    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32)
    with torch.inference_mode():
        h = model(torch.tensor([ids])).last_hidden_state[0]  # after the final norm
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling]
    if dims is not None:
        v = v[:dims]
    if normalize:
        v = torch.nn.functional.normalize(v, dim=0)
    return v.numpy()


@pytest.fixture(scope="module")
def folder(checkpoints):
    return checkpoints("llama")


@pytest.fixture(scope="module")
def tok(folder):
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def srv(server_factory, folder):
    return server_factory(folder, 1, "--max-model-len", "128", "--max-num-seqs", "8")


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=120)


def test_last_token_pooling_equals_transformers_float_and_base64(srv, client, folder, tok):
    r = client.embeddings.create(model=srv.model_name, input=TEXTS, encoding_format="float")
    assert [d.index for d in r.data] == [0, 1, 2]
    ids = [tok.encode(t) for t in TEXTS]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(i) for i in ids)
    for d, i in zip(r.data, ids):
        ref = reference(folder, i, "last", True)
        assert len(d.embedding) == ref.shape[0] == 64
        np.testing.assert_allclose(d.embedding, ref, atol=2e-5)
        assert abs(np.linalg.norm(d.embedding) - 1) < 1e-5
    # the official client asks for base64 when the caller names no format, and decodes it: the same vectors
    r64 = client.embeddings.create(model=srv.model_name, input=TEXTS)
    for a, b in zip(r.data, r64.data):
        np.testing.assert_array_equal(np.asarray(a.embedding, dtype=np.float32), np.asarray(b.embedding))
    raw = httpx.post(srv.v1 + "/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(vec, np.asarray(r.data[0].embedding, dtype=np.float32))


def test_token_id_inputs_and_a_prefix_cache_hit(srv, client, folder, tok):
    ids = tok.encode(TEXTS[2])
    assert len(ids) > 32  # two full blocks of 16: the second request starts from cached blocks
    first = client.embeddings.create(model=srv.model_name, input=ids, encoding_format="float").data[0].embedding
    again = client.embeddings.create(model=srv.model_name, input=[ids, ids[:5]], encoding_format="float")
    np.testing.assert_allclose(again.data[0].embedding, first, atol=2e-5)
    np.testing.assert_allclose(first, reference(folder, ids, "last", True), atol=2e-5)
    np.testing.assert_allclose(again.data[1].embedding, reference(folder, ids[:5], "last", True), atol=2e-5)
    # one token alone: a step of one-token rows takes the decode fast path, which must pool too
    one = client.embeddings.create(model=srv.model_name, input=[ids[3:4]], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, reference(folder, ids[3:4], "last", True), atol=2e-5)
    metrics = httpx.get(srv.url + "/metrics").text
    hits = [line for line in metrics.splitlines() if line.startswith("tpserve_prefix_cache_hits")]
    assert hits and float(hits[0].split()[-1]) >= 32


def test_embeddings_share_steps_with_a_decode(srv, client, folder, tok):
    """A long generation runs while embedding requests come and go: both answers are right."""
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(2) as pool:
        gen = pool.submit(client.completions.create, model=srv.model_name, prompt="Hello", max_tokens=30,
                          temperature=0, extra_body={"ignore_eos": True})
        embs = [client.embeddings.create(model=srv.model_name, input=TEXTS[1], encoding_format="float")
                for _ in range(3)]
        text = gen.result().choices[0].text
    ref = reference(folder, tok.encode(TEXTS[1]), "last", True)
    for e in embs:
        np.testing.assert_allclose(e.data[0].embedding, ref, atol=2e-5)
    alone = client.completions.create(model=srv.model_name, prompt="Hello", max_tokens=30, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    assert text == alone


@pytest.mark.parametrize("body, status, param", [
    ({"input": TEXTS[0], "dimensions": 32}, 400, "dimensions"),  # no Matryoshka dimensions declared
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [10**9]}, 400, "input"),
    ({"input": "x " * 300}, 400, "input"),  # longer than --max-model-len
    ({"input": TEXTS[0], "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": TEXTS[0], "model": "nope"}, 404, "model"),
])
def test_bad_embedding_requests(srv, body, status, param):
    r = httpx.post(srv.v1 + "/embeddings", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and "type" in err
    assert httpx.post(srv.v1 + "/embeddings", json={"input": "ok"}).status_code == 200


def test_truncate_prompt_tokens_keeps_the_last_tokens(srv, folder, tok):
    ids = tok.encode("x " * 300)
    r = httpx.post(srv.v1 + "/embeddings", json={"input": "x " * 300, "truncate_prompt_tokens": 100,
                                                 "encoding_format": "float"}).json()
    assert r["usage"]["prompt_tokens"] == 100
    np.testing.assert_allclose(r["data"][0]["embedding"], reference(folder, ids[-100:], "last", True), atol=2e-5)


@pytest.mark.slow
def test_mean_pooling_over_chunks_with_two_pipeline_stages(server_factory, folder, tok):
    """The pooled rows come back from the last stage beside the logits (sharding/executor.py, collect)."""
    s = server_factory(folder, 1, "-pp", "2", "--max-model-len", "128", "--max-num-seqs", "4",
                       "--max-num-batched-tokens", "8", "--pooling", "mean", "--no-normalize-embeddings")
    r = httpx.post(s.v1 + "/embeddings", json={"input": TEXTS, "encoding_format": "float"}, timeout=120).json()
    for d, text in zip(r["data"], TEXTS):
        ids = tok.encode(text)
        assert len(ids) > 8 or text is TEXTS[0]  # several chunks of at most 8 tokens
        np.testing.assert_allclose(d["embedding"], reference(folder, ids, "mean", False), atol=5e-5)


def test_sentence_transformers_config_and_matryoshka(server_factory, folder, tok, tmp_path):
    st = tmp_path / "st-model"
    shutil.copytree(folder, st)
    config = json.loads((st / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32, 64]
    (st / "config.json").write_text(json.dumps(config))
    (st / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (st / "1_Pooling").mkdir()
    (st / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                               "pooling_mode_cls_token": True,
                                                               "pooling_mode_mean_tokens": False}))
    s = server_factory(st, 2, "--max-model-len", "128", "--max-num-seqs", "4")  # TP 2
    ids = tok.encode(TEXTS[1])
    r = httpx.post(s.v1 + "/embeddings", json={"input": TEXTS[1], "encoding_format": "float"}).json()
    np.testing.assert_allclose(r["data"][0]["embedding"], reference(folder, ids, "cls", True), atol=2e-5)
    r = httpx.post(s.v1 + "/embeddings", json={"input": TEXTS[1], "encoding_format": "float",
                                                "dimensions": 16}).json()
    assert len(r["data"][0]["embedding"]) == 16
    np.testing.assert_allclose(r["data"][0]["embedding"], reference(folder, ids, "cls", True, 16), atol=2e-5)
    bad = httpx.post(s.v1 + "/embeddings", json={"input": "x", "dimensions": 20})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "dimensions"
