"""The supported architectures, by the name in config.json's `architectures`."""

from __future__ import annotations

from sharding.models.gemma import GemmaForCausalLM
from sharding.models.gemma2 import Gemma2ForCausalLM
from sharding.models.gpt2 import GPT2LMHeadModel
from sharding.models.gpt_oss import GptOssForCausalLM
from sharding.models.interface import CausalLM
from sharding.models.llama import LlamaForCausalLM
from sharding.models.mixtral import MixtralForCausalLM
from sharding.models.olmoe import OlmoeForCausalLM
from sharding.models.phi3 import Phi3ForCausalLM
from sharding.models.qwen2 import Qwen2ForCausalLM
from sharding.models.qwen3 import Qwen3ForCausalLM
from sharding.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MODELS: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}

# architectures refused with the reason, rather than "not supported"
NOT_YET: dict[str, str] = {
    "DeepseekV2ForCausalLM": "multi-head latent attention (kv_lora_rank) changes what the KV cache holds",
    "DeepseekV3ForCausalLM": "multi-head latent attention (kv_lora_rank) changes what the KV cache holds",
}


def model_class(architecture: str) -> type[CausalLM]:
    try:
        return MODELS[architecture]
    except KeyError:
        if architecture in NOT_YET:
            raise ValueError(f"architecture {architecture!r} is not supported yet: {NOT_YET[architecture]}") from None
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(sorted(MODELS))}") from None
