"""Offline generation without HTTP: `LLM(model, tensor_parallel_size=N).generate(prompts, params)`.

The calling process becomes rank 0; the other ranks are spawned on this host (or come from torchrun).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

from server.engine.core import Engine
from server.cli.launcher import launch, resolve_model, torchrun_worker_signals, under_torchrun
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.sampler import SamplingParams
from server.engine.request import Sequence
from server.engine.spec_decode.proposers import parse_speculative_config
from server.engine.tokenizer import load_tokenizer
from sharding.runner import EngineConfig

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float] | None = None  # of prompt tokens 1.. when params.prompt_logprobs is set
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None  # (id, logprob) of the top ones, same positions


def offline_constraint(json_schema, regex, choice, grammar):
    """The Constraint for LLM.generate's keyword arguments (a ValueError names what is wrong)."""
    from server.engine.structured.grammar import Constraint
    from server.api.protocol import APIError
    from server.engine.structured.constraint import check_schema, json_constraint

    given = [x is not None for x in (json_schema, regex, choice, grammar)]
    if sum(given) > 1:
        raise ValueError("give at most one of json_schema, regex, choice, grammar")
    try:
        if json_schema is not None:
            return json_constraint(check_schema(json_schema, "json_schema"), "json_schema")
    except APIError as e:
        raise ValueError(e.message) from None
    if regex is not None:
        return Constraint("regex", regex, "", "regex")
    if choice is not None:
        import json

        return Constraint("choice", json.dumps(list(choice)), "", "choice")
    if grammar is not None:
        return Constraint("grammar", grammar, "", "grammar")
    return None


class LLM:
    def __init__(self, model: str | None = None, tensor_parallel_size: int = 1, dtype: str = "auto",
                 max_num_seqs: int = 32, max_model_len: int | None = None, *, block_size: int = 16,
                 kv_cache_memory: int | None = None, gpu_memory_utilization: float = 0.9,
                 max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool = True, max_prefill_tokens_while_decoding: int | None = None,
                 pipeline_parallel_size: int = 1, data_parallel_size: int = 1, sequence_parallel: bool = False,
                 quantization: str | None = None, quantization_group_size: int = 32, quantized_cache: bool = True,
                 speculative_config: dict | str | None = None, enable_expert_parallel: bool = False,
                 tokenizer: str | None = None):
        self.cfg = EngineConfig(resolve_model(model), dtype, max_num_seqs, max_model_len, block_size=block_size,
                                kv_cache_memory=kv_cache_memory, gpu_memory_utilization=gpu_memory_utilization,
                                pipeline_parallel_size=pipeline_parallel_size, data_parallel_size=data_parallel_size,
                                sequence_parallel=sequence_parallel, quantization=quantization,
                                quantization_group_size=quantization_group_size, quantized_cache=quantized_cache,
                                enable_expert_parallel=enable_expert_parallel)
        # the same --speculative-config as the server: a dict or its JSON (server/engine/spec_decode/proposers.py)
        speculative = parse_speculative_config(
            json.dumps(speculative_config) if isinstance(speculative_config, dict) else speculative_config)
        # tokenizer: a replacement's path, checked against the model before any rank starts (on rank 0)
        self.tokenizer = None
        if tokenizer is not None and (not under_torchrun() or os.environ.get("RANK", "0") == "0"):
            self.tokenizer = load_tokenizer(self.cfg.model, tokenizer)
        torchrun_worker_signals()
        self.executor, self.dist, self.workers = launch(self.cfg, tensor_parallel_size)
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.cfg.model)
        self.engine = Engine(self.executor, self.tokenizer, max_num_batched_tokens, enable_prefix_caching,
                             max_prefill_tokens_while_decoding=max_prefill_tokens_while_decoding,
                             speculative=speculative)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | None = None, *,
                 json_schema: dict | None = None, regex: str | None = None, choice: list[str] | None = None,
                 grammar: str | None = None) -> list[Completion]:
        """Complete every prompt; at most one of json_schema / regex / choice / grammar (Lark or GBNF) constrains
        every answer, as the server's structured outputs do (docs/structured-outputs.md)."""
        params = params or SamplingParams()
        constraint = offline_constraint(json_schema, regex, choice, grammar)
        seqs = []
        for prompt in prompts:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            if not ids or len(ids) >= self.engine.max_model_len:
                raise ValueError(f"prompt of {len(ids)} tokens does not fit max_model_len {self.engine.max_model_len}")
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.skip_special_tokens)
            state = self.engine.grammars.compile_sync(constraint) if constraint else None
            seq = Sequence(ids, params, detok, emit=lambda *_: None, grammar=state)
            self.engine.add(seq)
            seqs.append(seq)
        self.engine.run_until_idle()
        return [Completion(s.prompt_ids, s.output_ids, s.detok.text, s.finish_reason,
                           s.token_logprobs if params.logprobs is not None else None,
                           s.top_logprobs if params.logprobs is not None else None,
                           s.prompt_logprobs if params.prompt_logprobs is not None else None,
                           s.prompt_top_logprobs if params.prompt_logprobs is not None else None) for s in seqs]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> Completion:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        return self.generate([list(ids)], params)[0]

    def close(self) -> None:
        if self.dist.global_world_size > 1:
            self.executor.stop_workers()
        self.workers.close()
        self.dist.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
