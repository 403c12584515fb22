"""Random-weight checkpoints with a released model's layer geometry (fewer layers), bfloat16 safetensors, for the
per-family benchmarks (scripts/bench_families.py).

    python scripts/make_family_checkpoint.py olmoe /data/olmoe-4l --tokenizer /data/smollm2-tokenizer --layers 4
    python scripts/make_family_checkpoint.py gemma2 /data/gemma2-8l --tokenizer /data/smollm2-tokenizer
    python scripts/make_family_checkpoint.py phi4mini /data/phi4mini-8l --tokenizer /data/smollm2-tokenizer

Families (each config as its released config.json has it, but the layer count and the vocabulary):
- olmoe: OLMoE-1B-7B-0924 (OlmoeForCausalLM): hidden 2048, 16 heads of 128 (no GQA), 64 experts of intermediate
  1024, top 8 not renormalised, q/k norms over the whole projections, untied head.
- gemma2: Gemma-2-2B (Gemma2ForCausalLM): hidden 2304, 8 query / 4 KV heads of 256, intermediate 9216, GELU-tanh,
  four norms per layer, soft-capped scores (50) and logits (30), every other layer a 4096-token window, tied head.
- phi4mini: Phi-4-mini (Phi3ForCausalLM): hidden 3072, 24 query / 8 KV heads of 128, three quarters of each head
  rotated (partial_rotary_factor 0.75), fused qkv_proj and gate_up_proj, intermediate 8192, tied head.

The vocabulary is the --tokenizer folder's (tokenizer.json, tokenizer_config.json, chat_template.jinja copied; the
model's vocab_size set to its size): with SmolLM2's, llama.cpp's converter recognizes the pre-tokenizer, so OLMoE
and Phi (declared a GPT2Tokenizer, as Phi-4's is) convert to GGUF; Gemma 2's converter needs a SentencePiece
tokenizer.model, which no Gemma 2 folder here has. Weights: transformers' own init (normal, std 0.02), seeded.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

FAMILIES = {
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        hidden_size=2048, intermediate_size=1024, num_attention_heads=16, num_key_value_heads=16, num_experts=64,
        num_experts_per_tok=8, norm_topk_prob=False, rms_norm_eps=1e-5, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, clip_qkv=None, tie_word_embeddings=False)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        hidden_size=2304, intermediate_size=9216, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, sliding_window=4096, rms_norm_eps=1e-6, max_position_embeddings=8192,
        tie_word_embeddings=True)),
    "phi4mini": ("Phi3Config", "Phi3ForCausalLM", dict(
        hidden_size=3072, intermediate_size=8192, num_attention_heads=24, num_key_value_heads=8,
        partial_rotary_factor=0.75, rms_norm_eps=1e-5, max_position_embeddings=4096, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family", choices=sorted(FAMILIES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", type=Path, required=True, help="folder with tokenizer.json to copy")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import transformers
    from tokenizers import Tokenizer

    config_cls, arch, geometry = FAMILIES[args.family]
    tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    tok_cfg = json.loads((args.tokenizer / "tokenizer_config.json").read_text())
    ids = {role: tok.token_to_id(tok_cfg[f"{role}_token"]) for role in ("bos", "eos", "pad") if tok_cfg.get(f"{role}_token")}
    cfg = getattr(transformers, config_cls)(vocab_size=tok.get_vocab_size(), num_hidden_layers=args.layers,
                                            initializer_range=0.02, architectures=[arch],
                                            **{f"{r}_token_id": i for r, i in ids.items()}, **geometry)
    t0 = time.time()
    torch.manual_seed(args.seed)
    torch.set_default_dtype(torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    torch.set_default_dtype(torch.float32)
    n = sum(p.numel() for p in model.parameters())
    print(f"{arch}: {n / 1e9:.3f}B params ({time.time() - t0:.0f} s)", flush=True)
    model.config.dtype = "bfloat16"
    model.save_pretrained(args.out, max_shard_size="4GB")
    for name in ("tokenizer.json", "chat_template.jinja"):
        if (args.tokenizer / name).exists():
            shutil.copy2(args.tokenizer / name, args.out / name)
    if args.family == "phi4mini":  # llama.cpp's converter reads a GPT2Tokenizer's vocabulary as BPE (Phi-4's case)
        tok_cfg["tokenizer_class"] = "GPT2Tokenizer"
    (args.out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
