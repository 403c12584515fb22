"""Write a random-weight Hugging Face Qwen3-MoE checkpoint with Qwen3-30B-A3B's layer geometry, for benchmarking.

No Qwen3-MoE weights can be downloaded here, and instantiating a 7.5B-parameter model in transformers would take too
much RAM and time, so the weights are drawn straight into safetensors shards, one shard at a time (peak RAM is about
one shard). Tensor names are those transformers' save_pretrained writes (one tensor per expert), so the folder loads
with AutoModelForCausalLM.from_pretrained and converts with llama.cpp's convert_hf_to_gguf.py.

Geometry per layer (Qwen3-30B-A3B): hidden 2048, 32 query / 4 KV heads of dim 128, 128 experts (8 active, top-k
probabilities renormalised) of intermediate size 768, every layer sparse. The vocabulary is SmolLM2's (49152 tokens,
copied from a local SmolLM2 folder) because no Qwen tokenizer is available offline. Matrices are drawn from
N(0, 0.02) with a seeded generator, norm weights are ones, everything is bfloat16, untied lm_head.

    python scripts/make_moe_checkpoint.py /work/bench/moe/qwen3moe-12l --layers 12        # ~15 GB, 7.7B params
    python scripts/make_moe_checkpoint.py /tmp/moe-1l --layers 1                           # ~1.6 GB
    python scripts/make_moe_checkpoint.py /tmp/moe-tiny --layers 1 --experts 8 --hidden 256 --moe-intermediate 64
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

DEFAULT_TOKENIZER = Path(os.environ.get("TPSERVE_HOME", Path.home() / ".cache/tpserve")) / "models/SmolLM2-135M-Instruct"
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]


def token_ids(tokenizer_dir: Path) -> dict[str, int | None]:
    """bos/eos/pad ids, looked up from the special-token strings in tokenizer_config.json."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    ids = {}
    for role in ("bos", "eos", "pad"):
        value = cfg.get(f"{role}_token")
        if isinstance(value, dict):  # older AddedToken serialisation
            value = value.get("content")
        ids[role] = tok.token_to_id(value) if value else None
    ids["vocab_size"] = tok.get_vocab_size(with_added_tokens=True)
    return ids


def build_config(args, ids: dict):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=args.vocab_size,
        hidden_size=args.hidden,
        intermediate_size=6144,
        num_hidden_layers=args.layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=args.experts,
        num_experts_per_tok=min(8, args.experts),
        moe_intermediate_size=args.moe_intermediate,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        dtype="bfloat16",
    )


def tensor_plan(cfg) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, is_norm) for every tensor, in the order transformers' save_pretrained writes them."""
    h, hd, ff = cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    plan = [("model.embed_tokens.weight", (cfg.vocab_size, h), False)]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        plan += [
            (p + "input_layernorm.weight", (h,), True),
            (p + "self_attn.q_proj.weight", (q, h), False),
            (p + "self_attn.k_proj.weight", (kv, h), False),
            (p + "self_attn.v_proj.weight", (kv, h), False),
            (p + "self_attn.o_proj.weight", (h, q), False),
            (p + "self_attn.q_norm.weight", (hd,), True),
            (p + "self_attn.k_norm.weight", (hd,), True),
            (p + "post_attention_layernorm.weight", (h,), True),
            (p + "mlp.gate.weight", (cfg.num_experts, h), False),
        ]
        for e in range(cfg.num_experts):
            plan += [
                (f"{p}mlp.experts.{e}.gate_proj.weight", (ff, h), False),
                (f"{p}mlp.experts.{e}.up_proj.weight", (ff, h), False),
                (f"{p}mlp.experts.{e}.down_proj.weight", (h, ff), False),
            ]
    plan += [("model.norm.weight", (h,), True), ("lm_head.weight", (cfg.vocab_size, h), False)]
    return plan


def split_shards(plan, max_bytes: int) -> list[list]:
    shards, current, size = [], [], 0
    for item in plan:
        nbytes = 2 * torch.Size(item[1]).numel()
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(item)
        size += nbytes
    return shards + [current] if current else shards


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="output folder (created)")
    ap.add_argument("--layers", type=int, default=12, help="decoder layers (Qwen3-30B-A3B has 48)")
    ap.add_argument("--experts", type=int, default=128, help="experts per layer (override only for smoke tests)")
    ap.add_argument("--hidden", type=int, default=2048, help="hidden size (override only for smoke tests)")
    ap.add_argument("--moe-intermediate", type=int, default=768, help="expert intermediate size (smoke tests)")
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER, help="folder with tokenizer.json to copy")
    ap.add_argument("--shard-gb", type=float, default=3.0, help="max shard size in GB (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02, help="std of the normal init for matrices")
    args = ap.parse_args()

    ids = token_ids(args.tokenizer)
    args.vocab_size = max(49152, ids["vocab_size"])
    cfg = build_config(args, ids)
    args.out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(args.out)
    (args.out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]}, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (args.tokenizer / name).exists():
            shutil.copy2(args.tokenizer / name, args.out / name)

    plan = tensor_plan(cfg)
    shards = split_shards(plan, int(args.shard_gb * 1e9))
    total_params = sum(torch.Size(shape).numel() for _, shape, _ in plan)
    print(f"{len(plan)} tensors, {total_params / 1e9:.3f}B params, {2 * total_params / 1e9:.2f} GB in {len(shards)} shards")

    gen = torch.Generator().manual_seed(args.seed)
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape, is_norm in shard:
            if is_norm:
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                tensors[name] = torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, args.std, generator=gen)
            weight_map[name] = fname
        save_file(tensors, args.out / fname, metadata={"format": "pt"})
        print(f"  wrote {fname}: {len(tensors)} tensors, {sum(t.nbytes for t in tensors.values()) / 1e9:.2f} GB", flush=True)
        del tensors

    index = {"metadata": {"total_size": 2 * total_params, "total_parameters": total_params}, "weight_map": weight_map}
    (args.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    print(f"done: {args.out}")


if __name__ == "__main__":
    main()
