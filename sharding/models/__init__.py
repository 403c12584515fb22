"""The supported architectures, by the name in config.json's `architectures`."""

from __future__ import annotations

from sharding.models.gemma import GemmaForCausalLM
from sharding.models.gemma2 import Gemma2ForCausalLM
from sharding.models.gpt2 import GPT2LMHeadModel
from sharding.models.llama import LlamaForCausalLM
from sharding.models.phi3 import Phi3ForCausalLM
from sharding.models.qwen2 import Qwen2ForCausalLM
from sharding.models.qwen3 import Qwen3ForCausalLM

MODELS: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
}


def model_class(architecture: str) -> type:
    try:
        return MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(sorted(MODELS))}") from None
