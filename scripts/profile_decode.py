"""Where a batch-1 decode step's time goes: the offline LLM, TP=1, one precision per run.

    python scripts/profile_decode.py                       # float32, default model
    python scripts/profile_decode.py --quantization int8 --rows 20
    python scripts/profile_decode.py --quantization int4 --batch 32   # a decode step of 32 sequences

Three measurements of 64 greedy tokens after a short chat prompt, in this order:
1. plain: ms per token, nothing attached;
2. split: the same with timers around the model's forward, around every linear's matmul and around the compiled
   call (at TP=1 every layer of a decode step is that one call, its linears included, and with decode_step its
   embedding and LM head too; the linears timed apart are then those the call does not hold), so step - forward =
   engine work (scheduling, metadata, sampling, detokenizing) and forward - compiled call - linears = everything
   else in the model (embedding, norms, Python);
3. torch.profiler: self CPU time per op, per token (the profiler adds its own overhead to every op; read the ranking,
   not the absolute numbers).
Writes results/profile_decode_<precision>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_prefill import cpu_name  # noqa: E402

TOKENS = 64


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: the default model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", choices=["int8", "int4", "bf16"])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--rows", type=int, default=15, help="profiler rows to print")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (figures are per step)")
    args = ap.parse_args(argv)
    os.environ["TPSERVE_THREADS"] = str(args.threads)
    from torch.profiler import ProfilerActivity, profile

    from loaders.default_model import ensure_default_model
    from server.llm import LLM
    from server.engine.sampler import SamplingParams
    from sharding.layers import linear as layers

    llm = LLM(args.model or str(ensure_default_model()), dtype=args.dtype, quantization=args.quantization,
              max_num_seqs=args.batch, kv_cache_memory=256 << 20)
    ids = llm.tokenizer.encode("<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n")
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    prompts = [ids] * args.batch
    llm.generate(prompts, params)  # warm-up

    t0 = time.perf_counter()
    llm.generate(prompts, params)
    plain = (time.perf_counter() - t0) / TOKENS * 1e3

    spent = {"forward": 0.0, "linears": 0.0, "layers": 0.0}
    steps: list[float] = []
    model, matmul = llm.executor.model, layers._Linear.matmul
    forward = model.forward

    def timed_forward(*a, **k):
        t = time.perf_counter()
        out = forward(*a, **k)
        spent["forward"] += time.perf_counter() - t
        return out

    def timed_matmul(self, x, bias=None):
        t = time.perf_counter()
        out = matmul(self, x, bias)
        spent["linears"] += time.perf_counter() - t
        return out

    plan = getattr(model, "_plan", None)
    # decode_layers (TP=1): every layer in one call, its linears included; decode_step: the same with the embedding
    # and the LM head (sharding/cpu/decode_plan.py DecodePlan.step)
    calls = {name: getattr(plan, name) for name in ("run", "run_step") if plan and getattr(plan, name, None)}

    def timed(call):
        def run(*a):
            t = time.perf_counter()
            out = call(*a)
            spent["layers"] += time.perf_counter() - t
            return out
        return run

    for name, call in calls.items():
        setattr(plan, name, timed(call))
    model.forward, layers._Linear.matmul = timed_forward, timed_matmul
    llm.engine.step_listeners.append(lambda dt, n: steps.append(dt))
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    total = (time.perf_counter() - t0) / TOKENS * 1e3
    model.forward, layers._Linear.matmul = forward, matmul
    for name, call in calls.items():
        setattr(plan, name, call)
    llm.engine.step_listeners.pop()
    split = dict(total_ms=total, step_ms=sum(steps) / TOKENS * 1e3, forward_ms=spent["forward"] / TOKENS * 1e3,
                 linears_ms=spent["linears"] / TOKENS * 1e3, layers_ms=spent["layers"] / TOKENS * 1e3)

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params)
    llm.close()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    top = [dict(op=e.key, self_us_per_token=e.self_cpu_time_total / TOKENS, calls_per_token=e.count / TOKENS)
           for e in ops[:args.rows]]

    name = args.quantization or (args.dtype if args.dtype != "auto" else "float32")
    print(f"CPU: {cpu_name()}, {args.threads} threads, {name}")
    unit = "token" if args.batch == 1 else f"step of {args.batch}"
    print(f"plain: {plain:.2f} ms/{unit}" + (f" ({args.batch / plain * 1e3:.1f} tok/s)" if args.batch > 1 else ""))
    rest = split['forward_ms'] - split['linears_ms'] - split['layers_ms']
    print(f"split: {split['total_ms']:.2f} ms/{unit} = engine {split['total_ms'] - split['forward_ms']:.2f} + "
          f"model forward {split['forward_ms']:.2f} ("
          + (f"the compiled call {split['layers_ms']:.2f}, " if split['layers_ms'] else "")
          + f"linears {split['linears_ms']:.2f}, everything else {rest:.2f})")
    print(f"{'op (torch.profiler, self CPU)':<40} {'us/' + unit[:4]:>9} {'calls/' + unit[:4]:>12}")
    for row in top:
        print(f"{row['op'][:40]:<40} {row['self_us_per_token']:9.0f} {row['calls_per_token']:12.1f}")
    out = ROOT / "results" / f"profile_decode_{name}{'' if args.batch == 1 else f'_b{args.batch}'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(cpu=cpu_name(), threads=args.threads, precision=name, batch=args.batch,
                                   plain_ms=plain, **split,
                                   top_ops=top), indent=2))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
