"""Batch-1 decode of a pre-quantized Hugging Face checkpoint against tpserve's own -q of the same float weights and
llama.cpp's `llama-bench` on a GGUF of them.

    python scripts/bench_prequantized.py --model /work/bench/llama3-8b-shapes \
        --gguf /work/bench/gguf/llama3-8b-shapes-8l-Q4_0.gguf --rounds 3

--model is a bfloat16 Hugging Face folder. Its W4A16 copy (compressed-tensors' int4, symmetric, group 128, written by
compressed-tensors itself with llm-compressor's round-to-nearest: tests/helpers/quantized.py) is made once beside it
(`<model>-W4A16`, or --quantized). Arms, every one in every round, each ratio taken within its round (the host's speed
drifts):
- `W4A16`: the compressed-tensors folder as it is (its linears int4 group 128; its LM head, which the scheme ignores,
  bfloat16 as stored);
- `W4A16 -q int8`: the same, with the linears it keeps in float (the LM head) at int8, as `-q int4` quantizes its head;
- `bf16 -q int4`: the float folder quantized at load (int4 group 32, LM head int8);
- `llama.cpp Q4_0`: `llama-bench -p 0 -n 128 -d 22` on --gguf (made by convert_hf_to_gguf.py --outtype bf16 and
  llama-quantize Q4_0 from the same float folder).
tpserve: offline LLM, TP 1, 128 greedy tokens after bench_baseline's 22-token prompt; decode ms/token = (wall - time to
first token) / 127 (bench_quant.py's Tpserve). Prints and saves results/prequantized.json.

    python scripts/bench_prequantized.py --model /work/bench/oss/gpt-oss-3l-BF16 \
        --quantized /work/bench/oss/gpt-oss-3l-MXFP4 --rounds 5 --output results/prequantized_gpt_oss.json

gpt-oss: its released MXFP4 folder (experts in MXFP4, the rest bfloat16) as stored and with `-q int4` (attention int4,
head int8, experts as stored), against the bfloat16 folder at `-q int4` (everything int4, head int8).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_prefill import cpu_name  # noqa: E402
from bench_quant import Tpserve, llama_bench, weight_bytes  # noqa: E402
from bench_baseline import load_avg  # noqa: E402
from bench_quant_accuracy import builds, llama_bin  # noqa: E402


def w4a16(model: Path, out: Path) -> Path:
    if not (out / "config.json").exists():
        from helpers.quantized import make_compressed_tensors

        print(f"writing {out} (compressed-tensors W4A16 of {model})", flush=True)
        make_compressed_tensors(model, out, "W4A16")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a bfloat16 Hugging Face folder")
    ap.add_argument("--quantized", default=None, help="its W4A16 folder (default: <model>-W4A16, made once)")
    ap.add_argument("--gguf", default=None, help="a Q4_0 GGUF of the same weights, for llama-bench")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--output", default="results/prequantized.json")
    args = ap.parse_args(argv)
    os.environ["TPSERVE_THREADS"] = str(args.threads)
    model = Path(args.model)
    quantized = Path(args.quantized or f"{model}-W4A16")
    if not args.quantized:
        w4a16(model, quantized)
    method = json.loads((quantized / "config.json").read_text())["quantization_config"]["quant_method"]
    label = {"compressed-tensors": "W4A16"}.get(method, method.upper())
    print(f"CPU: {cpu_name()}, {args.threads} threads, load {load_avg()}", flush=True)
    # as stored; with the linears it keeps in float quantized as -q does (int8: the LM head only; int4: gpt-oss's
    # attention too, its head int8); the float folder at -q int4
    second = "int8" if method == "compressed-tensors" else "int4"
    arms = {label: (str(quantized), None), f"{label} -q {second}": (str(quantized), second),
            "bf16 -q int4": (str(model), "int4")}
    have_llama = args.gguf is not None and llama_bin("llama-bench").exists()
    engines = {name: Tpserve(folder, "auto", q) for name, (folder, q) in arms.items()}  # loaded once, kept
    mine = [n for n in arms if n != "bf16 -q int4"]
    rows = []
    for r in range(args.rounds):
        row = dict(round=r, load=load_avg())
        for name, engine in engines.items():
            if r == 0:
                row[f"{name} MB"] = weight_bytes(engine.llm) / 1e6
            row[name] = engine.measure()
        if have_llama:
            row["llama.cpp Q4_0"] = llama_bench(Path(args.gguf), args.threads)
        others = ["bf16 -q int4", *(["llama.cpp Q4_0"] if have_llama else [])]
        print(f"[round {r}] " + " | ".join(f"{k} {row[k]:.2f} ms" for k in [*arms, "llama.cpp Q4_0"] if k in row)
              + " | " + ", ".join(f"{n} over {o} {row[o] / row[n]:.3f}x" for n in mine for o in others)
              + f" (load {row['load']})", flush=True)
        rows.append(row)
    for engine in engines.values():
        engine.close()
    names = [*arms, *(["llama.cpp Q4_0"] if have_llama else [])]
    summary = {n: statistics.median(r[n] for r in rows) for n in names}
    ratios = {f"{n} over {o}": [r[o] / r[n] for r in rows] for n in mine for o in others}
    print("\nmedians (ms/token): " + ", ".join(f"{n} {v:.2f}" for n, v in summary.items()))
    for n, v in ratios.items():
        print(f"  {n}: {statistics.median(v):.3f}x (rounds {', '.join(f'{x:.3f}' for x in v)}; > 1: faster)")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(cpu=cpu_name(), **builds(), threads=args.threads, model=str(model), quantized=str(quantized),
                                   gguf=args.gguf, rows=rows, medians=summary,
                                   ratios={n: dict(median=statistics.median(v), rounds=v) for n, v in ratios.items()},
                                   weight_mb={n: rows[0][f"{n} MB"] for n in arms}), indent=2))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
