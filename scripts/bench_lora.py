"""LoRA decode cost on SmolLM2-135M at TP=1: random rank-16 adapters on every linear (q/k/v/o/gate/up/down of every
layer), the runner driven with hand-built steps (sharding.executor.Executor.run), interleaved rounds.

    python scripts/bench_lora.py --rounds 5                      # float32 and int8, JSON to results/lora.json
    python scripts/bench_lora.py --rounds 5 --base-only --out results/lora_base.json   # base decode only (runs on
                                                                                       # code without sharding/layers/lora.py)

Per round and precision, every configuration decodes --tokens tokens after a 22-token prompt, their steps interleaved
(step t of each configuration in turn, so contention from other work on the host hits all alike), and reports
ms/token (the median step):
- b1 base: batch 1, no adapter row (the compiled one-call decode step at TP=1);
- b1 base loop: the same step through the per-layer decode loop (what a step with adapter rows takes; the compiled
  step is set aside for it), to separate the routing cost from the adapter arithmetic;
- b1 lora: batch 1, one adapter;
- b8 base / b8 lora xN: 8 sequences, with N distinct adapters over them (1, 2, 4): how the grouped shrink/expand
  scales with adapters per step.
Ratios are taken within a round; medians over rounds are reported. --base-only runs only the base configurations
(for before/after comparisons of base-only steps on two checkouts, alternated by the caller).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from loaders.default_model import ensure_default_model  # noqa: E402
from sharding.dist import init_dist  # noqa: E402
from sharding.executor import start_executor  # noqa: E402
from sharding.runner import EngineConfig  # noqa: E402
from sharding.wire import LOGITS_LAST, Step  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT_LEN = 22


def cpu_name() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def make_adapter(model: Path, folder: Path, seed: int, rank: int = 16) -> Path:
    """A PEFT-format adapter with random A and B on every linear of every layer (written directly: the format's
    keys and config, no peft needed)."""
    from safetensors.torch import save_file

    from loaders.checkpoint import Checkpoint

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    with Checkpoint(model) as ck:
        for name, info in ck.tensors.items():
            module = name[: -len(".weight")]
            if name.endswith(".weight") and module.rsplit(".", 1)[-1] in TARGETS:
                out, inp = info.shape
                tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * 0.02
                tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.02
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS,
        "base_model_name_or_path": str(model), "bias": "none"}))
    return folder


def decode_interleaved(runner, configs: dict[str, list[int]], tokens: int, flags_of) -> dict[str, float]:
    """Every configuration's sequences (their own rows and blocks) prefilled with PROMPT_LEN tokens, then `tokens`
    decode steps of each configuration in turn (step t of every configuration, then step t + 1), so a slow spell of
    a shared host hits all alike; median ms per step of each. "b1 base loop" runs with the compiled step set aside."""
    bs = runner.block_size
    per_seq = -(-(PROMPT_LEN + tokens + 1) // bs)
    state = {}
    row = 0
    for name, slots in configs.items():
        rows = list(range(row, row + len(slots)))
        row += len(slots)
        updates = torch.tensor([(r, j, r * per_seq + j) for r in rows for j in range(per_seq)])
        ids = torch.randint(10, 1000, (len(slots) * PROMPT_LEN,), generator=torch.Generator().manual_seed(0))
        table = torch.tensor([(r, PROMPT_LEN, 0, flags_of(s)) for r, s in zip(rows, slots)])
        state[name] = [rows, runner.run(Step(ids, table, updates)).argmax(-1), []]
    for t in range(tokens):
        for name, slots in configs.items():
            rows, nxt, times = state[name]
            table = torch.tensor([(r, 1, PROMPT_LEN + t, flags_of(s)) for r, s in zip(rows, slots)])
            saved, plan = None, runner.model._plan
            if name.endswith("base loop") and plan and plan.compiled is not None:
                saved, plan.compiled = plan.compiled, None
            t0 = time.perf_counter()
            logits = runner.run(Step(nxt, table, None))
            times.append(time.perf_counter() - t0)
            if saved is not None:
                plan.compiled = saved
            state[name][1] = logits.argmax(-1)
    return {name: 1000 * statistics.median(v[2]) for name, v in state.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--quantization", nargs="*", default=["none", "int8"])
    ap.add_argument("--base-only", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=str(ROOT / "results" / "lora.json"))
    args = ap.parse_args()
    model = Path(args.model) if args.model else ensure_default_model()
    dist = init_dist()
    runners = {}
    for q in args.quantization:
        cfg = EngineConfig(model=str(model), max_num_seqs=48, max_model_len=256, kv_cache_memory=256 << 20,
                           quantization=None if q == "none" else q)
        runners[q] = start_executor(cfg, dist)
    flags_of = lambda s: LOGITS_LAST  # noqa: E731
    managers = {}
    if not args.base_only:
        from sharding.layers.lora import LoraManager
        from sharding.wire import with_lora

        flags_of = lambda s: with_lora(LOGITS_LAST, s)  # noqa: E731
        tmp = Path(tempfile.mkdtemp(prefix="bench_lora_"))
        adapters = [make_adapter(model, tmp / f"a{i}", seed=i) for i in range(1, 5)]
        for q, r in runners.items():
            managers[q] = m = LoraManager(r.model, num_slots=4, max_rank=16)
            for slot, path in enumerate(adapters, 1):
                m.load(slot, str(path))
    configs = {"b1 base": [0], "b8 base": [0] * 8}
    if not args.base_only:
        configs.update({"b1 base loop": [0], "b1 lora": [1], "b8 lora x1": [1] * 8, "b8 lora x2": [1, 2] * 4,
                        "b8 lora x4": [1, 2, 3, 4] * 2})
    rounds: list[dict] = []
    for rnd in range(args.rounds):
        row = {}
        for q, r in runners.items():
            for name, ms in decode_interleaved(r, configs, args.tokens, flags_of).items():
                row[f"{q} {name}"] = ms
        rounds.append(row)
        print(f"round {rnd + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    summary = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    ratios = {}
    for q in runners:
        pairs = [("b1 lora", "b1 base"), ("b1 base loop", "b1 base"), ("b1 lora", "b1 base loop"),
                 ("b8 lora x1", "b8 base"), ("b8 lora x2", "b8 base"), ("b8 lora x4", "b8 base")]
        for a, b in pairs:
            if f"{q} {a}" in rounds[0]:
                ratios[f"{q} {a} / {b}"] = statistics.median(r[f"{q} {a}"] / r[f"{q} {b}"] for r in rounds)
    result = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "model": str(model), "tokens": args.tokens,
              "rounds": rounds, "median_ms_per_token": summary, "ratios": ratios}
    print(json.dumps({"cpu": result["cpu"], "threads": result["threads"], "median_ms_per_token": summary,
                      "ratios": ratios}, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for r in runners.values():
        del r
    os._exit(0)


if __name__ == "__main__":
    main()
