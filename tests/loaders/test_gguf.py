"""GGUF files (loaders/gguf_file.py): tiny random llama / qwen2 / qwen3 checkpoints written as GGUF with the `gguf`
package's writer the way llama.cpp's converter writes them (metadata keys, byte-level BPE vocabulary, Llama's q/k
rows permuted per head), in F16 and in Q8_0 / Q4_0 blocks (norms kept F32), then served:

- greedy tokens equal transformers loading the same GGUF (which dequantizes), at TP 1 and 2; where the CPU kernel
  rounds the activations of quantized linears to int8 blocks (AVX-512 VNNI), the reference's activations are rounded
  the same way, shard by shard;
- the repacked blocks, dequantized by quant.py, are bit-equal to gguf-py's dequantization of the file's blocks;
- the tokenizer built from the file encodes as the original Hugging Face tokenizer;
- bad files are refused with one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from llm_runner import run_llm
from tiny import CHAT_TEMPLATE, TEXT, make_checkpoint

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
LAYER_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                 "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}


def gguf_name(name: str) -> str:
    if not name.startswith(("model.", "lm_head.")):  # a GGUF name already (test_gguf_arch converts first)
        return name
    if name in TO_GGUF:
        return TO_GGUF[name]
    parts = name.split(".")  # model.layers.N.<module...>.<weight|bias>
    return f"blk.{parts[2]}.{LAYER_TO_GGUF['.'.join(parts[3:-1])]}.{parts[-1]}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for Llama's q/k (rotary halves interleaved within each head)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf: Path, out: Path, types, arch: str | None = None, split_max_tensors: int = 0,
               meta: dict | None = None, replace: dict | None = None, extra_tokens: int = 0,
               merges: bool = True) -> Path:
    """The checkpoint in `hf` as a GGUF file. `types(name, array)`: the GGML type of each HF tensor (1-D stay F32).
    `replace`: GGUF name -> (raw uint8 bytes, GGML type), written instead; `meta`: metadata to override (None:
    left out); `extra_tokens`: tokens past the embedding's rows, `merges=False`: none (bad files)."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(hf))
    real_arch = cfg.model_type
    arch = arch or real_arch
    meta = dict(meta or {})
    tok = json.loads((hf / "tokenizer.json").read_text())
    vocab = {i: t for t, i in tok["model"]["vocab"].items()}
    special = {a["id"]: a["content"] for a in tok["added_tokens"]}
    tokens, toktypes = [], []
    for i in range(cfg.vocab_size + extra_tokens):
        if i in special:
            tokens.append(special[i]), toktypes.append(gguf.TokenType.CONTROL)
        elif i in vocab:
            tokens.append(vocab[i]), toktypes.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]"), toktypes.append(gguf.TokenType.UNUSED)
    merge_list = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(out, arch, split_max_tensors=split_max_tensors)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = {f"{arch}.block_count": cfg.num_hidden_layers, f"{arch}.context_length": cfg.max_position_embeddings,
          f"{arch}.embedding_length": cfg.hidden_size, f"{arch}.feed_forward_length": cfg.intermediate_size,
          f"{arch}.attention.head_count": cfg.num_attention_heads,
          f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
          f"{arch}.rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
          f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps)}
    if real_arch == "qwen3":
        kv[f"{arch}.attention.key_length"] = kv[f"{arch}.attention.value_length"] = head_dim
    kv.update(meta)
    for key, value in kv.items():
        if value is not None:  # (None: a key the converter does not write for the architecture)
            (w.add_float32 if isinstance(value, float) else w.add_uint32)(key, value)
    w.add_tokenizer_model("gpt2")
    # what llama.cpp's converter detects: Qwen2Tokenizer (qwen2, qwen3 folders) splits with Qwen2's regex
    w.add_tokenizer_pre("qwen2" if real_arch in ("qwen2", "qwen3") else "gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(toktypes)
    if merges:
        w.add_token_merges(merge_list)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_chat_template(CHAT_TEMPLATE)
    state = load_file(str(hf / "model.safetensors"))
    for name, t in state.items():
        if name == "lm_head.weight" and getattr(cfg, "tie_word_embeddings", False):
            continue
        t = t.astype(np.float32)
        if real_arch == "llama" and ".q_proj." in name:
            t = permute(t, cfg.num_attention_heads)
        elif real_arch == "llama" and ".k_proj." in name:
            t = permute(t, cfg.num_key_value_heads)
        g = gguf_name(name)
        if replace and g in replace:
            raw, qtype = replace[g]
            w.add_tensor(g, raw, raw_dtype=qtype)
            continue
        qtype = types(name, t) if t.ndim >= 2 else Q.F32
        if qtype == Q.F32:
            w.add_tensor(g, t)
        elif qtype == Q.F16:
            w.add_tensor(g, t.astype(np.float16))
        elif qtype in RANDOM_BLOCKS:  # gguf-py cannot quantize to the K-quants: random blocks of that type
            w.add_tensor(g, random_blocks(qtype, t.shape, seed=len(g) * 7919 + sum(map(ord, g))), raw_dtype=qtype)
        else:
            w.add_tensor(g, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# K-quant blocks are random bytes (any bytes are valid blocks) with their float16 fields set so that the weights
# spread like a trained layer's (|W| up to ~0.2): d (and dmin) at these offsets of each block
RANDOM_BLOCKS = {Q.Q4_K: ([0, 2], 144, 0.2 / (63 * 15)), Q.Q5_K: ([0, 2], 176, 0.2 / (63 * 31)),
                 Q.Q6_K: ([208], 210, 0.2 / (127 * 32))}


def random_blocks(qtype, shape: tuple[int, int], seed: int) -> np.ndarray:
    """Random blocks of a K-quant type for a float [rows, cols] tensor: uint8 [rows, cols / 256 * block bytes]."""
    halves, nbytes, d = RANDOM_BLOCKS[qtype]
    rng = np.random.default_rng(seed)
    rows, blocks = shape[0], shape[1] // 256
    raw = rng.integers(0, 256, (rows, blocks, nbytes), dtype=np.uint8)
    for i, offset in enumerate(halves):  # d, then dmin (7.5 d: the mins centre the weights near 0)
        h = (rng.uniform(0.5, 1.5, (rows, blocks)) * d * (7.5 if i else 1.0)).astype(np.float16)
        raw[..., offset:offset + 2] = h.view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, -1)


def q4_k_m(name, t):
    """llama-quantize's Q4_K_M mix: Q6_K for v_proj, down_proj and the LM head (so q/k/v mixes two types)."""
    return Q.Q6_K if any(k in name for k in (".v_proj.", ".down_proj.", "lm_head")) else Q.Q4_K


def q5_k_m(name, t):
    return Q.Q6_K if any(k in name for k in (".v_proj.", ".down_proj.", "lm_head")) else Q.Q5_K


def legacy(name, t):
    """The 32-input types besides Q4_0: Q5_0 q/k/down, Q8_0 v, Q5_1 o, Q4_1 gate/up/embedding (SmolLM2's file is
    Q4_1 with a Q8_0 embedding)."""
    for key, qtype in ((".q_proj.", Q.Q5_0), (".k_proj.", Q.Q5_0), (".down_proj.", Q.Q5_0), (".v_proj.", Q.Q8_0),
                       (".o_proj.", Q.Q5_1), ("lm_head", Q.Q8_0)):
        if key in name:
            return qtype
    return Q.Q4_1


def q8(name, t):
    return Q.Q8_0


def q4_mixed(name, t):
    """Q4_0, with v_proj Q8_0 (a fused q/k/v mixing both: served as int8, exactly) and the embedding Q8_0."""
    return Q.Q8_0 if ".v_proj." in name or "embed" in name else Q.Q4_0


def f16(name, t):
    return Q.F16


# every linear's inputs, and each TP 2 shard's, are whole 32-input blocks (o_proj 64 -> 2 x 32, down_proj 128 -> 2 x 64)
SPECS = {"llama": dict(intermediate_size=128),
         "qwen2": dict(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
         "qwen3": dict(intermediate_size=128),
         "llama_tied": dict(intermediate_size=128),
         # K-quants: every linear's inputs (and at TP 2 each shard's) whole blocks of 256
         "llama_k": dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4),
         "qwen3_k": dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4,
                         head_dim=64)}
VARIANTS = [("llama", "q8", q8), ("llama", "q4", q4_mixed), ("llama", "f16", f16), ("qwen2", "q8", q8),
            ("qwen2", "q4", q4_mixed), ("qwen3", "q4", q4_mixed), ("llama_tied", "q8", q8),
            ("llama", "legacy", legacy), ("llama_k", "q4_k_m", q4_k_m), ("qwen3_k", "q5_k_m", q5_k_m)]
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(30, 50))]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    hf, out = {}, {}
    for arch, spec in SPECS.items():
        hf[arch] = make_checkpoint(root / f"hf-{arch}", arch.removesuffix("_k"), **spec)
    for arch, kind, types in VARIANTS:
        out[arch, kind] = write_gguf(hf[arch], root / f"{arch}-{kind}" / f"{arch}-{kind}.gguf", types)
    split = write_gguf(hf["qwen2"], root / "split" / "qwen2.gguf", q8, split_max_tensors=8)
    out["split"] = next(split.parent.glob("*-00001-of-*.gguf"))
    assert len(list(split.parent.glob("*.gguf"))) > 1
    # a --tokenizer folder for the llama files: the original tokenizer with a chat template of its own
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf["llama"]))
    tok.chat_template = OVERRIDE_TEMPLATE
    tok.save_pretrained(str(root / "tokenizer-override"))
    out["tokenizer"] = root / "tokenizer-override"
    return root, hf, out


OVERRIDE_TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
CHAT = [{"role": "user", "content": "hello there"}]


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """Each block of 32 inputs of a row rounded to a multiple of max|block| / 127, as the VNNI kernel rounds."""
    b = x.reshape(-1, x.shape[-1] // 32, 32)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(b * inv) * (amax / 127.0)).reshape(x.shape)


def shard_rounded(x: torch.Tensor, cuts: list[tuple[int, int]]) -> torch.Tensor:
    """x as the ranks of a row-parallel split round it: each rank its columns [a, b) in blocks of 32 of the whole
    row's grid (zeros elsewhere: a rank whose split cuts a block pads with zeros), the ranks' parts summed."""
    out = torch.zeros_like(x)
    for a, b in cuts:
        part = torch.zeros_like(x)
        part[..., a:b] = x[..., a:b]
        out += int8_rounded(part)
    return out


def reference(path: Path, quantized: bool, tp: int, prompt: list[int], n: int, forced: list[int] | None = None):
    """transformers' greedy tokens on the GGUF (dequantized by transformers); with `quantized` and int8 activations,
    every linear's input rounded as tpserve's kernel rounds it (row-parallel ones per TP shard)."""
    from transformers import AutoModelForCausalLM

    from sharding.cpu import kernels
    from sharding.layers import quant

    # transformers' GGUF config mapping leaves qwen3's attention.key_length out (head_dim would be its default 128)
    key_length = gguf.GGUFReader(path).fields.get("qwen3.attention.key_length")
    extra = {"head_dim": int(key_length.contents())} if key_length is not None else {}
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32, **extra)
    model.generation_config.eos_token_id = None
    if quantized and kernels.build_kernels() and quant.int8_activations():
        from loaders.partition import split_evenly

        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear):
                if name.endswith("o_proj"):  # split by query heads
                    cuts = [split_evenly(cfg.num_attention_heads, tp, r) for r in range(tp)]
                    cuts = [(a * head_dim, b * head_dim) for a, b in cuts]
                elif name.endswith("down_proj"):
                    cuts = [split_evenly(mod.in_features, tp, r) for r in range(tp)]
                else:
                    cuts = [(0, mod.in_features)]
                mod.register_forward_pre_hook(lambda _m, a, c=cuts: (shard_rounded(a[0], c),))
    with torch.inference_mode():
        if forced is not None:  # the logits of the reference along our tokens (one forward over them)
            return model(torch.tensor([prompt + forced])).logits[0, len(prompt) - 1:-1].float()
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_greedy_tokens_equal_transformers_on_the_same_gguf(files, tp):
    """TP 3 over the K-quant files: o_proj (8 heads: 3 / 3 / 2) and down_proj (1024: 342 / 341 / 341) cut blocks of
    256, which the ranks read whole and pad."""
    _, _, out = files
    keys = [(a, k) for a, k, _ in VARIANTS] + ["split"]
    if tp == 3:
        keys = [("llama_k", "q4_k_m"), ("qwen3_k", "q5_k_m")]
    flips: dict = {}
    jobs = [{"model": str(out[key].parent if key == ("llama", "q8") else out[key]), "prompts": PROMPTS,
             "max_tokens": 12} for key in keys]  # (one given as its folder)
    if tp == 1:  # the F16 file chatting through a --tokenizer folder's template (test_tokenizer_flag_...)
        jobs.append({"model": str(out["llama", "f16"]), "messages": CHAT, "max_tokens": 6,
                     "llm": {"tokenizer": str(out["tokenizer"])}})
    results = run_llm(tp, jobs, timeout=400)
    if tp == 1:
        override = results.pop()
        assert "error" not in override, override
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(str(out["tokenizer"])).apply_chat_template(
            CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
        got, expected = override["outputs"][0]["token_ids"], reference(out["llama", "f16"], False, 1, list(ids), 6)
        assert got and got == expected[:len(got)], (got, expected)  # (shorter only where it met an EOS id)
    for key, result in zip(keys, results):
        assert "error" not in result, (key, result)
        path = out[key] if key != "split" else out["qwen2", "q8"]  # transformers reads no split set: the same, whole
        for prompt, o in zip(PROMPTS, result["outputs"]):
            quantized = key == "split" or key[1] != "f16"
            expected = reference(path, quantized, tp, prompt, 12)
            if tp < 3:
                assert o["token_ids"] == expected, (key, tp, o["token_ids"], expected)
                continue
            # TP 3 sums 3 partial products where the reference makes one: a near-tie may flip. Every token we chose
            # must be the reference's top-1 along our own sequence, or within 1e-4 of its top logit
            logits = reference(path, quantized, tp, prompt, 12, forced=o["token_ids"])
            chosen = logits[torch.arange(len(o["token_ids"])), torch.tensor(o["token_ids"])]
            gap = (logits.max(-1).values - chosen) / logits.abs().max()
            assert (gap <= 1e-4).all(), (key, o["token_ids"], expected, gap)
            flips[key] = flips.get(key, 0) + int((gap > 0).sum())
    print("TP 3 near-tie flips:", flips)


@pytest.mark.parametrize("arch, kind", [("llama", "q8"), ("llama_tied", "q8"), ("llama", "f16"),
                                        ("llama_k", "q4_k_m")])
def test_a_gguf_file_runs_whole_steps_as_its_separate_ends(files, arch, kind):
    """A GGUF file on the CPU decode plan's whole step (DecodePlan.step): a table kept in its blocks (Q8_0, Q4_K) is
    looked up by the model and handed to the call, a float16 one is read by the call itself; the LM head (a Q8_0
    head tied to those blocks, Q6_K) in the call. The same bits as the separate embedding and head (tests/tiny.py
    check_whole_steps)."""
    import tiny

    blocks = kind != "f16"
    tiny.check_whole_steps(files[2][arch, kind], None, lambda model: (model.embed_tokens.blocks is not None) == blocks
                           and (model._plan.ends[0] is None) == blocks)


def test_repacked_blocks_dequantize_bit_equal_to_gguf(files):
    from loaders.gguf_file import open_checkpoint as Checkpoint
    from sharding.layers import quant

    _, _, out = files
    for kind in ("q8", "q4"):
        ckpt = Checkpoint(out["llama", kind])
        for name, dim, ranges in [("model.layers.0.mlp.gate_proj.weight", 0, [(32, 96)]),
                                  ("model.layers.1.mlp.down_proj.weight", 1, [(64, 128)]),
                                  ("model.layers.0.self_attn.o_proj.weight", 0, None)]:
            reader = gguf.GGUFReader(ckpt.path)
            t = next(t for t in reader.tensors if t.name == {
                "gate_proj": "blk.0.ffn_gate.weight", "down_proj": "blk.1.ffn_down.weight",
                "o_proj": "blk.0.attn_output.weight"}[name.split(".")[-2]])
            full = torch.from_numpy(gguf.quants.dequantize(np.array(t.data), t.tensor_type).copy())
            full = full.reshape(full.shape[0], -1)
            want = full if ranges is None else full.narrow(dim, ranges[0][0], ranges[0][1] - ranges[0][0])
            for rows in (quant.ROW_BLOCK, quant.VNNI_ROWS):
                mode, values, scale = quant.legacy_blocks(ckpt.quant_type(name), ckpt.read_blocks(name, dim, ranges))
                qw = quant.from_blocks(mode, values, scale, rows=rows)
                got = quant.dequantize(qw)
                assert got.dtype == torch.float32 and torch.equal(got, want), (kind, name, rows)
            assert torch.equal(ckpt.read(name, dim, ranges), want)  # the float read (embeddings) is exact too
        ckpt.close()


def test_the_file_s_tokenizer_encodes_as_the_original(files):
    from transformers import AutoTokenizer

    from server.engine.tokenizer import eos_token_ids, load_tokenizer

    _, hf, out = files
    ours = load_tokenizer(str(out["qwen2", "q8"]))
    theirs = AutoTokenizer.from_pretrained(str(hf["qwen2"]))
    texts = TEXT + ["  two  spaces\n\n\ttab and trailing  ", "😀🚀 mixed 日本語 café!!", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text), text
    assert ours.chat_template == CHAT_TEMPLATE
    assert eos_token_ids(str(out["qwen2", "q8"]), ours) == {theirs.eos_token_id}


def error_of(path) -> str:
    from loaders.checkpoint import CheckpointError
    from sharding.runner import EngineConfig
    from server.cli.launcher import validate

    with pytest.raises(CheckpointError) as e:
        validate(EngineConfig(str(path)), 2)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.fixture(scope="module")
def bad(files):
    root, hf, out = files
    made = {}
    data = out["llama", "q8"].read_bytes()
    (root / "bad").mkdir()
    made["truncated"] = root / "bad" / "truncated.gguf"
    made["truncated"].write_bytes(data[: len(data) - 1000])
    made["arch"] = write_gguf(hf["llama"], root / "bad" / "arch.gguf", q8, arch="gptneox")
    q2k = np.zeros((64, 2 * 84), dtype=np.uint8)  # [64, 512] in Q2_K's 84-byte blocks of 256
    made["q2k"] = write_gguf(hf["llama"], root / "bad" / "q2k.gguf", q8, replace={"blk.0.ffn_up.weight": (q2k, Q.Q2_K)})
    made["shape"] = write_gguf(hf["llama"], root / "bad" / "shape.gguf", q8, meta={"llama.feed_forward_length": 96})
    made["vocab"] = write_gguf(hf["llama"], root / "bad" / "vocab.gguf", q8, extra_tokens=8)
    made["merges"] = write_gguf(hf["llama"], root / "bad" / "merges.gguf", q8, merges=False)
    split = write_gguf(hf["llama"], root / "bad-split" / "s.gguf", q8, split_max_tensors=8)
    second = next(split.parent.glob("*-00002-of-*.gguf"))
    second.unlink()
    made["split"] = split.parent
    return made


def test_bad_files_are_refused_with_one_line(bad):
    assert "truncated" in error_of(bad["truncated"])
    assert "GGUF architecture 'gptneox' is not served; served: llama, qwen2, qwen3" in error_of(bad["arch"])
    msg = error_of(bad["q2k"])
    assert "Q2_K (1 tensor)" in msg and "Q4_K_S/M" in msg and "Q6_K" in msg and "re-quantize" in msg, msg
    msg = error_of(bad["shape"])
    assert "shape mismatch" in msg and "mlp.down_proj.weight" in msg and "GGUF metadata" in msg, msg
    assert "00002-of-" in error_of(bad["split"]) and "missing" in error_of(bad["split"])
    msg = error_of(bad["vocab"])
    assert "tokens but token_embd.weight has" in msg, msg
    assert "without tokenizer.ggml.merges" in error_of(bad["merges"])


def test_the_cli_refuses_a_bad_file_without_a_traceback(bad):
    r = subprocess.run([sys.executable, "-m", "server.cli.main", "serve", str(bad["q2k"])], capture_output=True,
                       text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode != 0
    assert "Q2_K (1 tensor)" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_a_block_cut_by_the_tp_split_is_refused(files):
    root, hf, _ = files
    # down_proj of 96 inputs: TP 2 would split it at input 48, inside a block
    src = make_checkpoint(root / "hf-odd", "llama", intermediate_size=96)
    path = write_gguf(src, root / "odd" / "odd.gguf", q8)
    from loaders.checkpoint import CheckpointError
    from loaders.gguf_file import GGUFCheckpoint

    with GGUFCheckpoint(path) as ckpt, pytest.raises(CheckpointError, match="cuts a 32-input Q8_0 block"):
        ckpt.read_blocks("model.layers.0.mlp.down_proj.weight", 1, [(48, 96)])


def test_default_gguf_names_the_embedded_file():
    from loaders.default_model import find_gguf
    from server.cli.launcher import DEFAULT_GGUF, resolve_model

    assert resolve_model(DEFAULT_GGUF) == str(find_gguf())
    assert find_gguf().name.endswith(".Q4_1.gguf")


@pytest.mark.slow
def test_the_default_model_served_from_its_own_gguf_file():
    """SmolLM2's shipped file (Q4_1 linears, Q8_0 embedding) at TP 1 and 2: greedy tokens equal transformers on the
    same file with the activations rounded as the kernels round them (TP 2: o_proj's 576 inputs split 320 / 256)."""
    from loaders.default_model import find_gguf

    prompt = list(range(100, 120))
    for tp in (1, 2):
        [result] = run_llm(tp, [{"model": "default.gguf", "prompts": [prompt], "max_tokens": 16}], timeout=400)
        assert result["outputs"][0]["token_ids"] == reference(find_gguf(), True, tp, prompt, 16), tp


def test_smollm_pre_tokenizer_splits_digits_as_llama_cpp():
    """SmolLM2's file (tokenizer.ggml.pre = smollm): llama.cpp splits every digit out before the byte-level regex, so a
    newline and three spaces before a digit stay one token (llama-server's /tokenize, checked on a 28k-token text:
    the same ids); transformers' converter alone gave newline + two spaces, a space, the digit."""
    from loaders.default_model import find_gguf
    from loaders.gguf_file import load_tokenizer

    tok = load_tokenizer(find_gguf())
    assert tok.convert_ids_to_tokens(tok.encode("x\n   2 12")) == ["x", "ĊĠĠĠ", "2", "Ġ", "1", "2"]


def test_tokenizer_flag_replaces_the_file_s(files, tmp_path):
    """--tokenizer: a Hugging Face folder replaces the GGUF's own tokenizer (its chat template renders the chat: served
    at TP 1 in test_greedy_tokens_equal_transformers_on_the_same_gguf; its generation_config's EOS ids join the
    model's); one with more ids than the embedding has rows, or a path that holds none, is refused before any rank
    starts."""
    from transformers import AutoTokenizer

    from server.engine.tokenizer import eos_token_ids, load_tokenizer

    _, _, out = files
    model = out["llama", "f16"]
    folder = tmp_path / "tok"
    tok = AutoTokenizer.from_pretrained(str(out["tokenizer"]))
    tok.save_pretrained(str(folder))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, 7]}))
    ours = load_tokenizer(str(model), str(folder))
    assert ours.chat_template == OVERRIDE_TEMPLATE != load_tokenizer(str(model)).chat_template
    assert eos_token_ids(str(model), ours) == {tok.eos_token_id, 7}

    big = tmp_path / "big"
    tok.add_tokens([f"<extra{i}>" for i in range(600)])
    tok.save_pretrained(str(big))
    with pytest.raises(ValueError, match=r"its vocabulary has \d+ tokens but the model's embedding has \d+ rows"):
        load_tokenizer(str(model), str(big))
    r = subprocess.run([sys.executable, "-m", "server.cli.main", "serve", str(model), "--tokenizer", "/nonexistent"],
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "cannot load a tokenizer from /nonexistent: no such file or folder" in r.stderr
    assert "Traceback" not in r.stderr and "rank" not in r.stderr, r.stderr[-2000:]
