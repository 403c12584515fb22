"""The tensor-parallel layers: linears, attention and the KV cache, norms, MoE, LoRA, quantization."""
