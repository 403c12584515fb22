"""Speculative decoding against none, in interleaved rounds on one engine (ratios from one run).

    python scripts/bench_speculative.py                       # SmolLM2 float32, n-gram, k = 4
    python scripts/bench_speculative.py -q int4 --method suffix

One offline engine (TP 1, the default model); speculation is switched on and off between runs of the same workload
(ABBA order), so both see the same weights, the same host and the same moment. Workloads:
  copy      batch 1: a paragraph quoted in the prompt and repeated (a rewrite)
  code      batch 1: a function in the prompt, returned with a variable renamed (a code edit)
  chat      batch 1: varied open questions, one after the other (little to copy)
  chat8     8 concurrent questions (speculation on: at most disable_by_batch_size running)
  chat32    32 concurrent questions (above disable_by_batch_size: no proposals)
Prints tokens/s end to end, the ratio, the acceptance (kept / proposed), and the decode rate after the first token
(the prompt's prefill left out: speculation does not change it) with its ratio, per workload; saves JSON.
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

PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lantern and a small "
             "notebook. He wrote down the color of the sky, the direction of the wind, and the names of the ships "
             "that passed the rocks. In winter the storms came from the north, and the waves broke over the lower "
             "windows, but the light never went out. Children from the village sometimes visited on Sundays, and "
             "he showed them the great lens, polished every morning until it shone like water.")
CODE = '''def summarize(values):
    x = 0
    total = 0.0
    for v in values:
        if v is None:
            continue
        total += v
        x += 1
    if x == 0:
        return None
    mean = total / x
    spread = 0.0
    for v in values:
        if v is not None:
            spread += (v - mean) ** 2
    return {"count": x, "mean": mean, "std": (spread / x) ** 0.5}
'''
QUESTIONS = ["What are three good habits for learning a new language?", "Why is the sky blue?",
             "Give me a short recipe for pancakes.", "What should I pack for a weekend hiking trip?",
             "Explain what a database index is.", "Write a haiku about autumn rain.",
             "How do vaccines train the immune system?", "Suggest a name for a friendly robot and explain it."]


def workloads():
    copy = [{"role": "user", "content": "Repeat the following text exactly, word for word:\n\n" + PARAGRAPH}]
    code = [{"role": "user", "content": "Rename the variable x to count in this Python function and return the "
                                        "whole function:\n\n" + CODE}]
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return {"copy": ([copy], 200), "code": ([code], 300), "chat": (chats, 128),
            "chat8": (chats, 128), "chat32": ((chats * 4), 128)}


def run(llm, convs, max_tokens, concurrent: bool):
    """(tokens/s end to end, decode tokens/s, each answer's tokens). The decode rate counts each answer's tokens after
    its first over the time from its first token to its last (the prompt's prefill, which speculation does not
    change, left out); summed over answers one after the other, or over the batch's span when concurrent."""
    from server.engine.sampler import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    prompts = [list(llm.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)) for c in convs]
    seqs, add = [], llm.engine.add
    llm.engine.add = lambda seq: (seqs.append(seq), add(seq))[1]
    try:
        t0 = time.perf_counter()
        if concurrent:
            outs = llm.generate(prompts, params)
        else:
            outs = [llm.generate([p], params)[0] for p in prompts]
        dt = time.perf_counter() - t0
    finally:
        llm.engine.add = add
    after_first = sum(len(s.output_ids) - 1 for s in seqs)
    if concurrent:
        span = max(s.last_token_time for s in seqs) - min(s.first_token_time for s in seqs)
    else:
        span = sum(s.last_token_time - s.first_token_time for s in seqs)
    return sum(len(o.token_ids) for o in outs) / dt, after_first / span, [o.token_ids for o in outs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("-q", "--quantization", default=None)
    ap.add_argument("--method", default="ngram")
    ap.add_argument("--draft", default=None, help="a draft checkpoint folder (method draft_model)")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds (each runs both orders)")
    ap.add_argument("--only", default=None, help="comma-separated workloads")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from server.llm import LLM

    spec_cfg = {"method": args.method, "num_speculative_tokens": args.k, "prompt_lookup_min": 2,
                "prompt_lookup_max": 5, "disable_by_batch_size": 8}
    if args.draft:
        spec_cfg = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k,
                    "disable_by_batch_size": 8}
    # no prefix caching: every run starts cold, so a run's tokens can be compared with the others' (under int8
    # activations a warm cache's shorter prefill rounds differently and can move a greedy token; not speculation)
    llm = LLM(args.model, 1, max_num_seqs=32, quantization=args.quantization, speculative_config=spec_cfg,
              enable_prefix_caching=False)
    engine = llm.engine
    speculator = engine.speculator
    propose = engine.lanes[0].scheduler.propose

    def spec(on: bool) -> None:
        engine.speculator = speculator if on else None
        for lane in engine.lanes:
            lane.scheduler.propose = propose if on else None

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "?")
    results = {"cpu": f"{cpu} ({os.cpu_count()} vCPU)", "quantization": args.quantization, "spec": spec_cfg,
               "workloads": {}}
    chosen = workloads()
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    try:
        spec(False)
        run(llm, [[{"role": "user", "content": "Hello"}]], 8, False)  # warm up
        for name, (convs, max_tokens) in chosen.items():
            concurrent = name.startswith("chat") and name != "chat"
            rows = []
            for r in range(args.rounds):
                for on in ((False, True) if r % 2 == 0 else (True, False)):
                    spec(on)
                    before = (speculator.num_draft_tokens, speculator.num_accepted_tokens)
                    tps, decode_tps, tokens = run(llm, convs, max_tokens, concurrent)
                    drafted = speculator.num_draft_tokens - before[0]
                    kept = speculator.num_accepted_tokens - before[1]
                    rows.append({"spec": on, "tok_s": tps, "decode_tok_s": decode_tps, "drafted": drafted,
                                 "kept": kept, "tokens": tokens})
            base = [x for x in rows if not x["spec"]]
            sped = [x for x in rows if x["spec"]]
            same = all(x["tokens"] == base[0]["tokens"] for x in rows)
            ratio = sum(x["tok_s"] for x in sped) / sum(x["tok_s"] for x in base)
            decode_ratio = sum(x["decode_tok_s"] for x in sped) / sum(x["decode_tok_s"] for x in base)
            drafted = sum(x["drafted"] for x in sped)
            acceptance = sum(x["kept"] for x in sped) / drafted if drafted else None
            print(f"{name:7s} base {sum(x['tok_s'] for x in base) / len(base):7.1f} tok/s   speculative "
                  f"{sum(x['tok_s'] for x in sped) / len(sped):7.1f} tok/s   ratio {ratio:.2f}   acceptance "
                  f"{'-' if acceptance is None else f'{acceptance:.2f}'}   identical {same}   decode only (after the "
                  f"first token) {sum(x['decode_tok_s'] for x in base) / len(base):7.1f} -> "
                  f"{sum(x['decode_tok_s'] for x in sped) / len(sped):7.1f} tok/s, ratio {decode_ratio:.2f}", flush=True)
            for x in rows:
                x.pop("tokens")
            results["workloads"][name] = {"rounds": rows, "ratio": ratio, "decode_ratio": decode_ratio,
                                          "acceptance": acceptance, "identical": same}
    finally:
        llm.close()
    name = f"bench_speculative_{args.quantization or 'f32'}_{spec_cfg['method']}.json"
    out = Path(args.out or ROOT / "results" / name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
