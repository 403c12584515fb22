"""docs/img/bench_summary.png from the JSON the benchmark scripts wrote into results/.

    python scripts/plot_benchmarks.py    # after bench_baseline (fp32 and bf16), bench_serving, bench_servers, bench_tp
    python scripts/plot_benchmarks.py --results /tmp/plot   # from a folder of copies (names as below)

Inputs in --results: baseline_fp32.json, baseline_bf16.json (bench_baseline), serving/*_summary.json (bench_serving),
servers.json (bench_servers), tp_0.9b.json (bench_tp).

Panels: offline output tok/s by batch (tpserve, transformers, llama.cpp), served tok/s by concurrency against the
transformers baselines and llama.cpp's own server (bench_servers), and TP decode ms/step at batch 1 against the
weight-streaming floor. A missing input file leaves its panel empty.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def load(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(ROOT / "results"))
    ap.add_argument("--output", default=str(ROOT / "docs" / "img" / "bench_summary.png"))
    args = ap.parse_args()
    res = Path(args.results)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))

    ax = axes[0]
    for name in ("baseline_fp32.json", "baseline_bf16.json"):
        data = load(res / name)
        for (engine, dtype), rows in _group(data["summary"] if data else []).items():
            label = f"{engine} {'fp32' if dtype in ('auto', 'float32', 'f32') else 'bf16'}"
            style = "o-" if engine == "tpserve" else ("s--" if engine == "transformers" else "^:")
            ax.plot([r["batch"] for r in rows], [r["tok_s"] for r in rows], style, label=label,
                    markersize=10 if engine == "llama.cpp" else 6)
    ax.set(xscale="log", xlabel="batch (sequences decoded together)", ylabel="output tok/s",
           title="Offline generation, SmolLM2-135M, TP=1")
    ax.set_xticks([1, 8, 32], ["1", "8", "32"])
    ax.legend(fontsize=7)

    ax = axes[1]
    for path in sorted((res / "serving").glob("*_summary.json")):
        rows = load(path)
        ax.plot([r["concurrency"] for r in rows], [r["output_tok_s"] for r in rows], "o-", label=f"tpserve {path.stem[:-8]}")
    side = load(res / "servers.json")  # bench_servers: tpserve and llama.cpp's server in alternating rounds
    for server in dict.fromkeys(r["server"] for r in (side["summary"] if side else [])):  # tpserve, llama-server
        rows = sorted((r for r in side["summary"] if r["server"] == server), key=lambda r: r["concurrency"])
        ax.plot([r["concurrency"] for r in rows], [r["output_tok_s"] for r in rows],
                "D--" if server == "tpserve" else "^:", markersize=8, label=f"{server} (side-by-side run)")
    base = load(res / "baseline_fp32.json")
    for r in _group(base["summary"] if base else []).get(("transformers", "float32"), []):
        ax.axhline(r["tok_s"], ls="--", lw=0.8, color="gray")
        ax.annotate(f"transformers fp32 b{r['batch']}", (1, r["tok_s"]), fontsize=7, color="gray")
    ax.set(xscale="log", xlabel="concurrent streamed requests", ylabel="output tok/s",
           title="Served over HTTP (loadtest on the same 2 cores)")
    ax.set_xticks([1, 8, 32], ["1", "8", "32"])
    ax.legend(fontsize=7)

    ax = axes[2]
    tp = load(res / "tp_0.9b.json")
    if tp and "summary" in tp:  # medians over bench_tp's rounds
        runs = tp["summary"]["runs"]
        labels = [f"TP={k.split('x')[0]} x {k.split('x')[1]}t" for k in runs]
        ax.bar(labels, [r.get("decode_ms_b1", 0) for r in runs.values()], color="tab:blue", label="decode, batch 1")
        # bench_tp's "floors" time oneDNN's packed linears and F.linear, which tpserve's own float32 kernel in huge
        # pages now beats (BENCHMARKS.md section 12): drawn as reference passes, not as a floor
        colors = {"1x1": "tab:red", "1x2": "tab:orange", "2x1": "tab:green"}
        for key, ms in tp["summary"]["floor"].items():
            kernel, shape = key.split()
            if kernel == "packed":
                procs, threads = shape.split("x")
                ax.axhline(ms, ls="--", color=colors.get(shape, "gray"),
                           label=f"one pass of oneDNN's packed linears: {procs} process(es) x {threads} thread(s)")
        ax.set(ylabel="ms per decode step", title="~0.9B Llama fp32: decode at batch 1 by layout")
        ax.legend(fontsize=7)
    fig.tight_layout()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output, dpi=80)
    print(f"wrote {args.output}")


def _group(summary: list[dict]) -> dict:
    groups: dict = {}
    for r in summary:
        groups.setdefault((r["engine"], r["dtype"]), []).append(r)
    return {k: sorted(v, key=lambda r: r["batch"]) for k, v in groups.items()}


if __name__ == "__main__":
    main()
