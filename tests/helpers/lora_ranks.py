"""One rank of a LoRA test: start the rank's runner (sharding.runner.start_rank), load adapters into slots through
sharding.layers.lora.LoraManager on every rank, then rank 0 drives greedy generation with hand-built steps through
`Executor(runner).run(step)` while the other ranks sit in `worker_loop(runner)` (sharding/worker.py).

Usage: python tests/helpers/lora_ranks.py SPEC.json, with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set (see
tests/sharding/test_lora.py: run_ranks). Spec: {"out": path, "jobs": [{"model", "quantization", "ops":
[["load", slot, path] | ["unload", slot]], "runs": [{"prompts": [[ids]], "slots": [slot per prompt], "max_tokens": n, "together": bool}]}]}.
A run with together=true puts every prompt in every step (prefill, then decode); otherwise each prompt runs alone
(batch 1: the decode fast path). Rank 0 writes {"jobs": [{"runs": [{"tokens", "logprobs", "step_slots"}],
"bytes_read": [per rank]}]} to `out`; each rank also writes its bytes read to out.rank<r>.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))

from loaders.gguf_file import open_checkpoint  # noqa: E402
from sharding.dist import init_dist  # noqa: E402
from sharding.layers.lora import LoraManager  # noqa: E402
from server.engine.lora_registry import validate_adapter  # noqa: E402
from sharding.executor import Executor  # noqa: E402
from sharding.runner import EngineConfig, start_rank  # noqa: E402
from sharding.wire import LOGITS_LAST, Step, with_lora  # noqa: E402
from sharding.worker import worker_loop  # noqa: E402


def generate(runner, mgr, prompts: list[list[int]], slots: list[int], max_tokens: int) -> dict:
    """Greedy tokens (and full log-softmax rows) of every prompt, all of them in every step."""
    bs = runner.block_size
    per_seq = -(-(max(map(len, prompts)) + max_tokens) // bs)
    updates = [(i, j, i * per_seq + j) for i in range(len(prompts)) for j in range(per_seq)]
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)
    table = torch.tensor([(i, len(p), 0, with_lora(LOGITS_LAST, s)) for i, (p, s) in enumerate(zip(prompts, slots))])
    step = Step(ids, table, torch.tensor(updates, dtype=torch.int64))
    tokens: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[list[float]]] = [[] for _ in prompts]
    step_slots = []
    pos = [len(p) for p in prompts]
    for _ in range(max_tokens):
        logits = runner.run(step)
        seen = mgr.ctx.rows  # what the model's linears saw in this step's forward
        step_slots.append([0] if seen is None else sorted(set(seen.token_slots.tolist())))
        lp = torch.log_softmax(logits.float(), -1)
        nxt = logits.argmax(-1).tolist()
        for i, t in enumerate(nxt):
            tokens[i].append(t)
            logprobs[i].append(lp[i].tolist())
        table = torch.tensor([(i, 1, pos[i], with_lora(LOGITS_LAST, s)) for i, s in enumerate(slots)])
        step = Step(torch.tensor(nxt, dtype=torch.int64), table, None)
        pos = [p + 1 for p in pos]
    return {"tokens": tokens, "logprobs": logprobs, "step_slots": step_slots}


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    dist = init_dist()
    rank = dist.global_rank
    out = {"jobs": []}
    for job in spec["jobs"]:
        cfg = EngineConfig(model=job["model"], max_num_seqs=8, max_model_len=128, kv_cache_memory=8 << 20,
                           quantization=job.get("quantization"))
        runner = start_rank(cfg, dist)
        mgr = LoraManager(runner.model, num_slots=job.get("num_slots", 2), max_rank=64)
        read = {}
        for op in job["ops"]:  # ["load", slot, path] or ["unload", slot], on every rank, in order
            if op[0] == "unload":
                mgr.unload(op[1])
                continue
            _, slot, path = op
            if rank == 0:
                with open_checkpoint(job["model"]) as base:  # (a quantized folder: its linears under float names)
                    validate_adapter(path, base, max_rank=64)
            mgr.load(slot, path)
            read[str(slot)] = mgr.bytes_read
        read["held"] = {str(s): mgr.nbytes(s) for s in range(1, mgr.num_slots + 1)}
        with open(f"{spec['out']}.rank{rank}", "w") as f:
            json.dump(read, f)
        if rank == 0:
            executor, runs = Executor(runner), []
            for run in job["runs"]:
                if run.get("together", True):
                    runs.append(generate(executor, mgr, run["prompts"], run["slots"], run["max_tokens"]))
                else:
                    alone = [generate(executor, mgr, [p], [s], run["max_tokens"])
                             for p, s in zip(run["prompts"], run["slots"])]
                    runs.append({k: [r[k][0] for r in alone] if k != "step_slots" else [r[k] for r in alone]
                                 for k in ("tokens", "logprobs", "step_slots")})
            decode_plan = getattr(runner.model, "_plan", None)
            out["jobs"].append({"runs": runs, "compiled_decode": bool(decode_plan and decode_plan.compiled is not None)})
            executor.stop_workers()
        else:
            worker_loop(runner)
    if rank == 0:
        with open(spec["out"], "w") as f:
            json.dump(out, f)
    dist.shutdown()


if __name__ == "__main__":
    main()
