"""Streaming output whose characters span several tokens (emoji, CJK): no chunk carries a broken character.

The checkpoint is built so greedy decoding must follow a chosen chain of byte-level tokens: every attention and MLP
weight is zero (each layer passes the residual through), so the logits depend only on the last token's embedding,
and the LM head maps each chain token's embedding to its successor.
"""

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from tiny import make_checkpoint

TEXT = "🚀 日本語"


@pytest.fixture(scope="module")
def chain_model(tmp_path_factory):
    folder = make_checkpoint(tmp_path_factory.mktemp("chain"), "llama")
    tok = AutoTokenizer.from_pretrained(str(folder))
    chain = [tok.convert_tokens_to_ids("<s>")] + tok.encode(TEXT) + [tok.eos_token_id]
    assert len(set(chain)) == len(chain), "each chain token must have one successor"
    tensors = load_file(str(folder / "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith(("proj.weight",)):
            tensors[name] = torch.zeros_like(t)
        elif "norm" in name:
            tensors[name] = torch.ones_like(t)
    emb = torch.randn(tensors["model.embed_tokens.weight"].shape, generator=torch.Generator().manual_seed(0))
    head = torch.zeros_like(emb)
    for a, b in zip(chain, chain[1:]):
        head[b] = 20 * emb[a] / emb[a].norm()
    tensors["model.embed_tokens.weight"], tensors["lm_head.weight"] = emb, head
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder, tok, chain


def test_stream_never_emits_a_broken_character(server_factory, chain_model):
    folder, tok, chain = chain_model
    pieces = [tok.decode([t]) for t in chain[1:-1]]
    assert sum("\ufffd" in p for p in pieces) >= 3  # characters really are split across tokens
    s = server_factory(folder, 2, "--max-model-len", "64")
    client = openai.OpenAI(base_url=s.v1, api_key="x", max_retries=0)
    full = client.completions.create(model=s.model_name, prompt=chain[:1], max_tokens=40, temperature=0)
    assert full.choices[0].text == TEXT and full.choices[0].finish_reason == "stop"
    chunks = [c.choices[0].text for c in client.completions.create(
        model=s.model_name, prompt=chain[:1], max_tokens=40, temperature=0, stream=True)]
    assert "".join(chunks) == TEXT
    assert all("\ufffd" not in c for c in chunks), chunks
    assert sum(1 for c in chunks if c) >= 3  # it did stream piece by piece
