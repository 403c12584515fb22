"""The prebuilt kernel variants against a -march=native build, offline decode at batch 1 and 8 streams.

    python scripts/bench_variants.py --rounds 5                                   # SmolLM2: float32, int8, int4
    python scripts/bench_variants.py --model llama3-8b-shapes --precisions int4,int8 --rounds 5

One child process per kernel build (TPSERVE_KERNELS=native, x86-64-v4-vnni-bf16, x86-64-v4, x86-64-v3: those this
CPU runs; a variant not prebuilt is compiled into $TPSERVE_HOME/kernels first; `--refs` adds builds with -march flags
of their own, e.g. what -march=native would be on a CPU of a lower level), each holding the model loaded at the
precision. In every round each child generates in turn (the order rotates): `--tokens` greedy tokens after a
short prompt, EOS ignored, for 1 prompt and for 8 at once; tok/s = generated tokens / wall. Every ratio is a
variant over native within one round; medians over rounds are reported (this host's speed drifts by tens of percent
within minutes). `llama3-8b-shapes`: a random bfloat16 checkpoint with Llama-3-8B's layer shapes (hidden 4096, MLP
14336, 32 query / 8 KV heads of 128, vocabulary 128256) and `--layers` layers, written once under results/.
Writes JSON (--output).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BUILDS = ("native", "x86-64-v4-vnni-bf16", "x86-64-v4", "x86-64-v3")
PROMPT = "Write a long story about a lighthouse keeper and the sea."


def llama3_shapes(layers: int) -> str:
    """A random bfloat16 Llama checkpoint with Llama-3-8B's layer shapes (tensors written one at a time)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from loaders.default_model import ensure_default_model

    folder = ROOT / "results" / f"llama3-8b-shapes-{layers}l"
    if (folder / "model.safetensors").exists():
        return str(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      num_hidden_layers=layers, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                      tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
                      architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(folder)
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": rnd(128256, 4096), "lm_head.weight": rnd(128256, 4096),
         "model.norm.weight": torch.ones(4096, dtype=torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": rnd(4096, 4096), p + "self_attn.k_proj.weight": rnd(1024, 4096),
                  p + "self_attn.v_proj.weight": rnd(1024, 4096), p + "self_attn.o_proj.weight": rnd(4096, 4096),
                  p + "mlp.gate_proj.weight": rnd(14336, 4096), p + "mlp.up_proj.weight": rnd(14336, 4096),
                  p + "mlp.down_proj.weight": rnd(4096, 14336),
                  p + "input_layernorm.weight": torch.ones(4096, dtype=torch.bfloat16),
                  p + "post_attention_layernorm.weight": torch.ones(4096, dtype=torch.bfloat16)})
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    src = Path(ensure_default_model())  # a tokenizer for the prompts (its ids are all below 128256)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists():
            (folder / name).write_bytes((src / name).read_bytes())
    return str(folder)


def child(model: str | None, precision: str) -> int:
    """Load once, then answer {"batch", "tokens"} lines with {"tok_s"} lines."""
    from server.llm import LLM
    from server.engine.sampler import SamplingParams
    from sharding.cpu import kernels

    if os.environ.get("BENCH_MARCH"):  # a reference build: -march flags of its own, compiled into the cache
        from sharding.cpu import variants as cv

        name = os.environ["TPSERVE_KERNELS"]
        cv.BY_NAME[name] = cv.Variant(name, cv.platform.machine(), (), tuple(os.environ["BENCH_MARCH"].split()))
    q = None if precision == "float32" else precision
    llm = LLM(model, quantization=q, max_num_seqs=8, max_model_len=512, kv_cache_memory=256 * 2**20)
    print(json.dumps({"ready": kernels.describe()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        params = SamplingParams(max_tokens=req["tokens"], temperature=0, ignore_eos=True)
        prompts = [f"{PROMPT} ({i})" for i in range(req["batch"])]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        dt = time.perf_counter() - t0
        print(json.dumps({"tok_s": sum(len(o.token_ids) for o in outs) / dt}), flush=True)
    llm.close()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a checkpoint folder, llama3-8b-shapes, or the default model")
    ap.add_argument("--layers", type=int, default=8, help="llama3-8b-shapes: decoder layers")
    ap.add_argument("--precisions", default="float32,int8,int4")
    ap.add_argument("--builds", default=",".join(BUILDS))
    ap.add_argument("--refs", default="", help='reference builds "name=-march flags;...", e.g. what -march=native '
                    'is on a CPU of a lower level: "znver3=-march=znver3" (Zen 3: AVX2, no AVX-512)')
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--output", default="results/variants.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="float32", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.model, args.precision)
    from sharding.cpu import variants as cv

    flags = cv.cpu_flags()
    refs = dict(r.split("=", 1) for r in args.refs.split(";") if r)
    builds = [b for b in args.builds.split(",") if b == "native" or not cv.missing_flags(cv.BY_NAME[b], flags)]
    builds += list(refs)
    model = llama3_shapes(args.layers) if args.model == "llama3-8b-shapes" else args.model
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    out = {"cpu": cpu, "model": model or "SmolLM2-135M-Instruct", "tokens": args.tokens, "rounds": args.rounds,
           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "results": {}}
    levels = {"batch 1": 1, "8 streams": 8}
    for precision in args.precisions.split(","):
        procs = {}
        for b in builds:
            env = dict(os.environ, TPSERVE_KERNELS=b, TPSERVE_THREADS=str(len(os.sched_getaffinity(0))),
                       BENCH_MARCH=refs.get(b, ""))
            cmd = [sys.executable, __file__, "--child", "--precision", precision] + (["--model", model] if model
                                                                                     else [])
            p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            ready = json.loads(p.stdout.readline())["ready"]
            print(f"{precision} {b}: {ready}", flush=True)
            procs[b] = p

        def ask(b: str, batch: int, tokens: int) -> float:
            procs[b].stdin.write(json.dumps({"batch": batch, "tokens": tokens}) + "\n")
            procs[b].stdin.flush()
            return json.loads(procs[b].stdout.readline())["tok_s"]

        for b in builds:
            ask(b, 1, 8)  # warm-up
        res = {lvl: {b: [] for b in builds} for lvl in levels}
        for r in range(args.rounds):
            order = builds[r % len(builds):] + builds[:r % len(builds)]
            for lvl, batch in levels.items():
                for b in order:
                    time.sleep(0.3)  # the previous child's OpenMP threads stop spinning
                    res[lvl][b].append(ask(b, batch, args.tokens))
            print(f"{precision} round {r + 1}: " + "; ".join(
                f"{lvl} " + " ".join(f"{b} {res[lvl][b][-1]:.1f}" for b in builds) for lvl in levels), flush=True)
        for p in procs.values():
            p.stdin.close()
            p.wait(120)
        summary = {}
        for lvl in levels:
            summary[lvl] = {b: {"tok_s_median": statistics.median(res[lvl][b]), "tok_s": res[lvl][b],
                                "vs_native": [x / n for x, n in zip(res[lvl][b], res[lvl]["native"])]}
                            for b in builds}
            for b in builds:
                summary[lvl][b]["vs_native_median"] = statistics.median(summary[lvl][b]["vs_native"])
            print(f"{precision} {lvl}: " + ", ".join(
                f"{b} {summary[lvl][b]['tok_s_median']:.1f} tok/s ({summary[lvl][b]['vs_native_median']:.3f}x)"
                for b in builds), flush=True)
        out["results"][precision] = summary
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
