"""Accuracy of weight-only quantization: tpserve's int8/int4/bf16 against llama.cpp's Q8_0/Q4_0/F16 of the same
weights.

    python scripts/bench_quant_accuracy.py                  # tpserve and llama.cpp (scripts/build_llama_cpp.sh first)
    python scripts/bench_quant_accuracy.py --only tpserve
    python scripts/bench_quant_accuracy.py --same-file '/data/SmolLM2-{kind}.gguf' --output results/gguf_ppl.json
                                          # both engines on the same GGUF files, a text of >= 20k tokens

Text: scripts/data/eval_text.txt, three chapters of the Python language reference as shipped in CPython's
`pydoc_data` (~5,300 SmolLM2 tokens). Both engines score it the way llama.cpp's `llama-perplexity` does: the text is
cut into 512-token windows, and only the second half of each window is scored (every scored token sees at least 256
tokens of context). For each precision:

- perplexity of the text, and its change against the same engine's float32;
- top-1 agreement: the share of scored positions where the quantized model's most likely next token is float32's
  (llama-perplexity --kl-divergence calls it "Same top p").

The float32 weights are tpserve's default checkpoint; llama.cpp gets the F32 GGUF holding the same values
(scripts/bench_baseline.f32_gguf), quantized with its own `llama-quantize` (the function llama-cpp-python's
`llama_model_quantize` wraps). tpserve's int4 uses groups of 32 (--quantization-group-size 32), as Q4_0 does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_baseline import f32_gguf  # noqa: E402
from bench_prefill import cpu_name  # noqa: E402

TEXT = ROOT / "scripts" / "data" / "eval_text.txt"
CTX = 512


def llama_bin(name: str) -> Path:
    """llama.cpp's tool `name` from LLAMA_CPP_DIR (default $TPSERVE_HOME/llama.cpp: scripts/build_llama_cpp.sh)."""
    home = Path(os.environ.get("TPSERVE_HOME") or Path.home() / ".cache" / "tpserve")
    return Path(os.environ.get("LLAMA_CPP_DIR") or home / "llama.cpp") / "bin" / name


def builds() -> dict:
    """What a result was measured with: tpserve's kernel build (TPSERVE_KERNELS) and llama.cpp's (its VERSION file:
    version and ISA, from scripts/build_llama_cpp.sh)."""
    version = llama_bin("VERSION").parent.parent / "VERSION"
    return dict(tpserve_kernels=os.environ.get("TPSERVE_KERNELS", "auto"),
                llama_cpp=version.read_text().strip() if version.exists() else None)


def long_text(min_chars: int = 110_000) -> Path:
    """A text of >= 20k SmolLM2 tokens for --same-file: CPython's pydoc_data topics (the language and library
    reference shipped with Python), in their sorted order, until `min_chars`; written to results/ so that both engines
    read the same bytes."""
    from pydoc_data.topics import topics

    parts, size = [], 0
    for key in sorted(topics):
        parts.append(topics[key].strip())
        size += len(parts[-1])
        if size >= min_chars:
            break
    out = ROOT / "results" / "eval_text_long.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n\n".join(parts) + "\n")
    return out


def tpserve_scores(model: str, quantization: str | None, group: int, threads: int) -> tuple[list[float], list[int]]:
    """(logprob of each scored token, float32-comparable top-1 id at each scored position)."""
    from server.llm import LLM
    from server.engine.sampler import SamplingParams

    os.environ["TPSERVE_THREADS"] = str(threads)
    llm = LLM(model, quantization=quantization, quantization_group_size=group, max_num_seqs=4)
    try:
        ids = llm.tokenizer.encode(TEXT.read_text())
        windows = [ids[i:i + CTX] for i in range(0, len(ids) - CTX + 1, CTX)]
        outs = llm.generate(windows, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    finally:
        llm.close()
    logprobs, top1 = [], []
    for o in outs:
        # prompt_logprobs[j] is the logprob of token j + 1 given tokens 0..j: score tokens CTX/2 .. CTX-1
        for j in range(CTX // 2 - 1, CTX - 1):
            logprobs.append(o.prompt_logprobs[j])
            top1.append(o.prompt_top_logprobs[j][0][0])
    return logprobs, top1


def llama_perplexity(gguf: Path, base_kld: Path | None, threads: int, write_base: bool) -> dict:
    """llama-perplexity's figures; `base_kld` None: perplexity only (no logits file: 1.35 GB for SmolLM2 and this
    text)."""
    cmd = [str(llama_bin("llama-perplexity")), "-m", str(gguf), "-f", str(TEXT), "-c", str(CTX), "-t", str(threads),
           "-b", str(CTX)]
    if base_kld is not None:
        cmd += ["--kl-divergence-base", str(base_kld)]
        if not write_base:
            cmd.append("--kl-divergence")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    res = {}
    m = re.search(r"Final estimate: PPL = ([\d.]+)", text)
    if m:
        res["ppl"] = float(m.group(1))
    m = re.search(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", text)
    if m:
        res["ppl"] = float(m.group(1))
    m = re.search(r"Same top p\s*:\s*([\d.]+)", text)
    if m:
        res["top1_agreement"] = float(m.group(1)) / 100
    m = re.search(r"Mean\s+KLD:\s*([\d.]+)", text)
    if m:
        res["mean_kld"] = float(m.group(1))
    if "ppl" not in res:
        raise RuntimeError("llama-perplexity printed no perplexity:\n" + text[-2000:])
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: tpserve's default SmolLM2-135M-Instruct)")
    ap.add_argument("--only", choices=["tpserve", "llamacpp"], action="append")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--gguf", default="results/SmolLM2-135M-Instruct-F32.gguf")
    ap.add_argument("--same-file", default=None,
                    help="GGUF files both engines score as they are, a template over --kinds (e.g. "
                         "results/SmolLM2-{kind}.gguf), on a text of >= 20k tokens (long_text); the perplexity "
                         "of each engine on each file")
    ap.add_argument("--kinds", default="Q8_0,Q6_K,Q5_K_M,Q4_K_M,Q4_0")
    ap.add_argument("--output", default="results/quant_accuracy.json")
    args = ap.parse_args(argv)
    from loaders.default_model import ensure_default_model

    if args.same_file:
        return same_file(args)

    model = args.model or str(ensure_default_model())
    which = args.only or ["tpserve", "llamacpp"]
    rows = []
    print(f"CPU: {cpu_name()}; text {TEXT.name}, windows of {CTX}, second halves scored", flush=True)
    if "tpserve" in which:
        base_lp, base_top = tpserve_scores(model, None, 32, args.threads)
        ppl0 = math.exp(-sum(base_lp) / len(base_lp))
        rows.append(dict(engine="tpserve", precision="float32", ppl=ppl0, top1_agreement=1.0, scored=len(base_lp)))
        for q, g in (("int8", 32), ("int4", 32), ("int4", 128), ("bf16", 32)):
            lp, top = tpserve_scores(model, q, g, args.threads)
            ppl = math.exp(-sum(lp) / len(lp))
            agree = sum(a == b for a, b in zip(top, base_top)) / len(top)
            name = f"{q} (group {g})" if q == "int4" else q
            rows.append(dict(engine="tpserve", precision=name, ppl=ppl, top1_agreement=agree, scored=len(lp)))
    if "llamacpp" in which:
        quantize = llama_bin("llama-quantize")
        if not quantize.exists():
            print("llama.cpp skipped: run scripts/build_llama_cpp.sh first", flush=True)
        else:
            f32 = f32_gguf(Path(args.gguf))
            base_kld = f32.with_suffix(".kld")
            rows.append(dict(engine="llama.cpp", precision="F32", top1_agreement=1.0,
                             **llama_perplexity(f32, base_kld, args.threads, write_base=True)))
            for q in ("Q8_0", "Q4_0", "F16"):
                out = f32.with_name(f32.name.replace("F32", q))
                if not out.exists():
                    subprocess.run([str(quantize), str(f32), str(out), q, str(args.threads)], check=True,
                                   capture_output=True)
                rows.append(dict(engine="llama.cpp", precision=q,
                                 **llama_perplexity(out, base_kld, args.threads, write_base=False)))
    base = {r["engine"]: r["ppl"] for r in rows if r["precision"] in ("float32", "F32")}
    print(f"\n{'engine':<10} {'precision':<16} {'perplexity':>10} {'delta':>8} {'top-1 agreement':>16}")
    for r in rows:
        r["ppl_delta"] = r["ppl"] - base[r["engine"]]
        print(f"{r['engine']:<10} {r['precision']:<16} {r['ppl']:10.3f} {r['ppl_delta']:+8.3f} "
              f"{r['top1_agreement'] * 100:15.2f}%")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(dict(cpu=cpu_name(), text=TEXT.name, ctx=CTX, rows=rows), indent=2))
    print(f"saved {args.output}")
    return 0


def same_file(args) -> int:
    """tpserve and llama-perplexity on the same GGUF files, over long_text()."""
    global TEXT
    TEXT = long_text()
    rows = []
    print(f"CPU: {cpu_name()}; text {TEXT} ({TEXT.stat().st_size} bytes), windows of {CTX}, second halves scored",
          flush=True)
    for kind in args.kinds.split(","):
        path = Path(args.same_file.format(kind=kind))
        lp, _ = tpserve_scores(str(path), None, 32, args.threads)
        ours = math.exp(-sum(lp) / len(lp))
        theirs = llama_perplexity(path, None, args.threads, write_base=False)["ppl"]
        rows.append(dict(kind=kind, file=str(path), tpserve_ppl=ours, llama_ppl=theirs, scored=len(lp),
                         relative=ours / theirs - 1))
        print(f"{kind:<8} tpserve {ours:9.4f}  llama-perplexity {theirs:9.4f}  ({(ours / theirs - 1) * 100:+.2f} %, "
              f"{len(lp)} tokens scored)", flush=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(dict(cpu=cpu_name(), **builds(), text=str(TEXT), ctx=CTX, rows=rows),
                                            indent=2))
    print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
