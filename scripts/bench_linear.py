"""The matmuls of one decode step, alone: F.linear (MKL) against oneDNN with prepacked weights (sharding/cpu/kernels.py).

    python scripts/bench_linear.py                       # SmolLM2-135M shapes, fp32, all cores
    python scripts/bench_linear.py --threads 1 --dtype bfloat16 --rows 1,8,32

For each row count M: the time of one pass over tensors shaped like every linear of the model (fused q/k/v,
o_proj, fused gate/up, down_proj per layer, then the LM head), median of --repeats passes, and the bandwidth that
implies. Prints a table and writes JSON (results/linear_<dtype>_t<threads>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent


def shapes(hidden: int, inter: int, heads: int, kv_heads: int, layers: int, vocab: int) -> list[tuple[int, int]]:
    hd = hidden // heads
    layer = [(hidden + 2 * kv_heads * hd, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    return layer * layers + [(vocab, hidden)]


def timed(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", default="1,2,8,32,128")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--shape", default="576,1536,9,3,30,49152", help="hidden,intermediate,heads,kv_heads,layers,vocab")
    ap.add_argument("--output")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    weights = [torch.randn(o, i, dtype=dtype) for o, i in shapes(*map(int, args.shape.split(",")))]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    with torch.inference_mode():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
        results = []
        print(f"{len(weights)} weights, {nbytes / 1e6:.0f} MB {args.dtype}, {args.threads} thread(s), "
              f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        for m in map(int, args.rows.split(",")):
            xs = {n: torch.randn(m, n, dtype=dtype) for n in {w.shape[1] for w in weights}}
            plain = timed(lambda: [F.linear(xs[w.shape[1]], w) for w in weights], args.repeats)
            onednn = timed(lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                    for w, p in zip(weights, packed)], args.repeats)
            results.append(dict(rows=m, f_linear_ms=plain * 1e3, packed_ms=onednn * 1e3,
                                f_linear_gb_s=nbytes / plain / 1e9, packed_gb_s=nbytes / onednn / 1e9))
            print(f"M={m:>4}: F.linear {plain * 1e3:7.1f} ms ({nbytes / plain / 1e9:5.1f} GB/s)   "
                  f"oneDNN packed {onednn * 1e3:7.1f} ms ({nbytes / onednn / 1e9:5.1f} GB/s)   "
                  f"x{plain / onednn:.2f}")
    out = Path(args.output or ROOT / "results" / f"linear_{args.dtype}_t{args.threads}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(args=vars(args), bytes=nbytes, results=results), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
