"""POST /v1/embeddings: OpenAI's embeddings endpoint on any served model.

An embedding request becomes one prefill-only engine sequence per input. It runs in the same steps as the decodes
(chunked under the same token budget, its full blocks registered in the prefix cache) and asks the step for one
pooled row of final-normed hidden states instead of logits (sharding/wire.py, HIDDEN_*). Pooling is the model's:

- a sentence-transformers checkpoint says it in `modules.json` and its Pooling module's `config.json` (mean, CLS or
  last token; a Normalize module means L2-normalized), as vLLM reads it;
- otherwise a decoder model's last token, L2-normalized (what decoder-based embedding models such as e5-mistral or
  gte-Qwen use);
- `--pooling last|mean|cls` and `--no-normalize-embeddings` override both.

"last" may start from a prefix-cache hit (only the last token's state is needed); "mean" and "cls" compute every
token. `dimensions` truncates to a Matryoshka dimension (then normalizes) when the model's config declares them
(`matryoshka_dimensions`, or `is_matryoshka`), and is refused otherwise: truncating any other model's vectors gives
embeddings nobody trained.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from fastapi import FastAPI, Request
from pydantic import ConfigDict, Field, field_validator

from server.engine.detokenizer import IncrementalDetokenizer
from server.api.state import PendingRequest, ServerState, admit, gather
from server.api.preprocess import check_model, prompt_chars, refuse_long_prompts, tokenize_prompts
from server.api.protocol import APIError, RequestBody, check_prompts
from server.engine.sampler import SamplingParams
from server.engine.request import Sequence

logger = logging.getLogger(__name__)

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request
POOLINGS = ("last", "mean", "cls")
ST_POOLING = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
ST_PASSTHROUGH = {"sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
                  "sentence_transformers.models.Normalize"}


@dataclass(slots=True)
class PoolingConfig:
    pooling: str = "last"
    normalize: bool = True
    dimensions: tuple[int, ...] | None = None  # Matryoshka dimensions a request may ask for (None: refused)
    hidden_size: int = 0
    source: str = "default for decoder models"

    def describe(self) -> str:
        return f"embeddings: {self.pooling} pooling{', normalized' if self.normalize else ''} ({self.source})"


def pooling_config(model_path: str, config, pooling: str | None = None,
                   normalize: bool | None = None) -> PoolingConfig:
    """The model's pooling: the flags, else a sentence-transformers config in the folder, else last + normalized.
    A sentence-transformers pipeline this server cannot reproduce (a Dense layer after pooling, max pooling) is
    refused at start, unless --pooling says what to do instead."""
    out = PoolingConfig(hidden_size=config.hidden_size)
    modules_file = os.path.join(model_path, "modules.json")
    if os.path.exists(modules_file) and pooling is None:
        with open(modules_file) as f:
            modules = json.load(f)
        types = [m.get("type", "") for m in modules]
        extra = [t for t in types if t not in ST_PASSTHROUGH]
        if extra:
            raise ValueError(f"{modules_file} lists {', '.join(extra)} after the transformer: this server pools and "
                             "normalizes only; start with --pooling last|mean|cls to serve the bare model's pooling")
        out.normalize = "sentence_transformers.models.Normalize" in types
        out.source = "sentence-transformers modules.json"
        for m in modules:
            if m.get("type") == "sentence_transformers.models.Pooling":
                with open(os.path.join(model_path, m.get("path", ""), "config.json")) as f:
                    st = json.load(f)
                modes = [ST_POOLING.get(k) or k for k, v in st.items() if k.startswith("pooling_mode") and v]
                if len(modes) != 1 or modes[0] not in POOLINGS:
                    raise ValueError(f"the sentence-transformers pooling {modes} is not supported (supported: "
                                     "lasttoken, mean_tokens, cls_token); start with --pooling to choose one")
                out.pooling = modes[0]
    if pooling is not None:
        out.pooling, out.source = pooling, "--pooling"
    if normalize is not None:
        out.normalize = normalize
    dims = getattr(config, "matryoshka_dimensions", None)
    if dims:
        out.dimensions = tuple(int(d) for d in dims if 0 < int(d) <= config.hidden_size)
    elif getattr(config, "is_matryoshka", False):
        out.dimensions = tuple(range(1, config.hidden_size + 1))
    return out


class EmbeddingRequest(RequestBody):
    """OpenAI's fields, and vLLM's truncate_prompt_tokens / add_special_tokens."""

    model_config = ConfigDict(extra="ignore")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None  # keep the last N tokens (vLLM)
    add_special_tokens: bool = True

    @field_validator("input")
    @classmethod
    def _check_input(cls, v):
        return check_prompts(v, "input", MAX_INPUTS)


TRUNCATE_HINT = " (send truncate_prompt_tokens to keep the last tokens)"


def input_ids(state: ServerState, body: EmbeddingRequest) -> list[list[int]]:
    """The inputs' token ids, each at most the max model length (after truncate_prompt_tokens). Runs in the
    CpuPool (server/api/state.py); `refuse_long_prompts` has already turned away, on the event loop, an input whose
    length in characters proves it too long (unless truncate_prompt_tokens asks for its last tokens: then it is
    tokenized whole)."""
    out = tokenize_prompts(state, body.input, "input", body.add_special_tokens)
    limit = state.max_model_len
    for i, ids in enumerate(out):
        if body.truncate_prompt_tokens is not None:
            out[i] = ids = ids[-body.truncate_prompt_tokens:]
        if len(ids) > limit:
            raise APIError(400, f"input[{i}] has {len(ids)} tokens; this server's max model length is {limit}"
                                f"{TRUNCATE_HINT}", param="input", code="context_length_exceeded")
    return out


def finish_vector(vec: torch.Tensor, cfg: PoolingConfig, dimensions: int | None) -> torch.Tensor:
    if dimensions is not None:
        vec = vec[:dimensions]
    if cfg.normalize:
        vec = torch.nn.functional.normalize(vec, dim=0)
    return vec


def encode(vec: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32 bytes, as OpenAI's client decodes them
        return base64.b64encode(vec.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()).decode()
    return vec.tolist()


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        lora = check_model(state, body.model)
        cfg: PoolingConfig = state.pooling
        if body.dimensions is not None:
            if cfg.dimensions is None:
                raise APIError(400, "dimensions is supported only by models that declare Matryoshka dimensions "
                                    "(matryoshka_dimensions in config.json); this model does not", param="dimensions")
            if body.dimensions not in cfg.dimensions:
                raise APIError(400, f"dimensions must be one of {list(cfg.dimensions)[:32]}", param="dimensions")
        if body.truncate_prompt_tokens is None:  # (an input whose length proves it too long: before tokenizing)
            refuse_long_prompts(state, body.input, "input", state.max_model_len + 1, TRUNCATE_HINT)
        prompts = await state.cpu.run(prompt_chars(body.input), input_ids, state, body,  # off the event loop
                                      gone=request.is_disconnected)
        req = PendingRequest(state, asyncio.get_running_loop())
        params = SamplingParams(max_tokens=1)
        for i, ids in enumerate(prompts):
            seq = Sequence(ids, params, IncrementalDetokenizer(state.tokenizer, [], []), emit=req.emit, lora=lora,
                           pooling=cfg.pooling)
            req.index[seq.seq_id] = i
            req.emitted_tokens[seq.seq_id] = 0
            req.seqs.append(seq)
        admit(state, req)
        await gather(req, request)
        data = [{"object": "embedding", "index": req.index[s.seq_id],
                 "embedding": encode(finish_vector(s.pooled, cfg, body.dimensions), body.encoding_format)}
                for s in req.seqs]
        n = sum(len(p) for p in prompts)
        return {"object": "list", "data": data, "model": state.model_name,
                "usage": {"prompt_tokens": n, "total_tokens": n}}
