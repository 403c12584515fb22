"""Does `torch.compile` pay off for tpserve's decode step on CPU? Eager against compiled decoder layers, same process.

    python scripts/bench_compile.py                    # linears stay oneDNN-packed (an opaque custom op)
    python scripts/bench_compile.py --mode freezing    # plain weights; inductor freezes and picks its own linears

`packed`: each decoder layer's forward goes through torch.compile (inductor, dynamic shapes) with the packed linear
wrapped as a custom op, so inductor fuses the ~60 small ops around the linears (norms, rotary, SiLU, residuals,
attention glue) and calls the same oneDNN kernel. `freezing`: TPSERVE_PREPACK=0 and inductor's `freezing`, i.e.
what torch.compile does for CPU linears on its own. Greedy output must equal eager's. Default model, TP=1, offline
`LLM`, 128 new tokens; prints tok/s per round and writes results/compile_<mode>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["packed", "freezing"], default="packed")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output")
    args = ap.parse_args(argv)
    if args.mode == "freezing":
        os.environ["TPSERVE_PREPACK"] = "0"
    import torch._dynamo
    import torch._inductor.config

    import sharding.layers.linear as layers
    from server.llm import LLM
    from server.engine.sampler import SamplingParams

    torch._dynamo.config.cache_size_limit = 256  # 30 layers = 30 compiled frames of one code object
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    torch._inductor.config.freezing = args.mode == "freezing"

    llm = LLM(None, 1, max_num_seqs=32)
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    prompt = "Write a short story about a robot learning to paint."
    batches = [int(b) for b in args.batches.split(",")]

    def run(tag: str, b: int) -> tuple[float, list[list[int]]]:
        t = time.perf_counter()
        out = llm.generate([prompt] * b, params)
        rate = sum(len(o.token_ids) for o in out) / (time.perf_counter() - t)
        print(f"{tag:9s} batch {b:>2}: {rate:.1f} tok/s", flush=True)
        return rate, [o.token_ids for o in out]

    if args.mode == "packed":
        @torch.library.custom_op("tpserve_bench::packed_linear", mutates_args=())
        def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

        @packed_linear.register_fake
        def _(x, packed, out_features):
            return x.new_empty(*x.shape[:-1], out_features)

        for m in llm.executor.model.modules():
            if isinstance(m, layers._Linear) and m.packed is not None:
                if isinstance(m, layers.ColumnParallelLinear):
                    m.out_features = sum(m.out_sizes)
                elif isinstance(m, layers.RowParallelLinear):
                    m.out_features = m.piece.full[1] if m.piece.transposed else m.piece.full[0]
                else:
                    m.out_features = m.stop - m.start

        def matmul(self, x, bias=None):  # eager runs take the same custom op: only compilation differs
            if self.packed is not None:
                y = packed_linear(x, self.packed, self.out_features)
                return y if bias is None else y + bias
            return torch.nn.functional.linear(x, self.weight, bias)

        layers._Linear.matmul = matmul
    model_layers = llm.executor.model.layers
    eager = [layer.forward for layer in model_layers]
    compiled = [torch.compile(f, dynamic=True) for f in eager]

    def use(forwards) -> None:
        for layer, f in zip(model_layers, forwards):
            layer.forward = f

    results = {"mode": args.mode, "eager": {}, "compiled": {}, "compile_s": {}, "same_tokens": {}}
    for b in batches:
        use(eager)
        _, reference = run("eager", b)
        use(compiled)
        t = time.perf_counter()
        run("compiling", b)
        results["compile_s"][b] = round(time.perf_counter() - t, 1)
        results["eager"][b], results["compiled"][b] = [], []
        same = True
        for r in range(args.rounds):  # alternate, so the host's drift hits both alike
            for tag, forwards in (("eager", eager), ("compiled", compiled))[:: 1 if r % 2 == 0 else -1]:
                use(forwards)
                rate, tokens = run(tag, b)
                results[tag][b].append(rate)
                same &= tokens == reference
        results["same_tokens"][b] = same
    for b in batches:
        e, c = statistics.median(results["eager"][b]), statistics.median(results["compiled"][b])
        print(f"batch {b}: eager {e:.1f}, compiled {c:.1f} tok/s ({c / e:.2f}x), first compiled run "
              f"{results['compile_s'][b]} s, same greedy tokens: {results['same_tokens'][b]}")
    out = Path(args.output or ROOT / "results" / f"compile_{args.mode}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
