"""Run tpserve's offline LLM on several checkpoints at one TP degree; JSON spec on stdin, JSON results written to spec['out'].

Spec: {"tp": 2, "jobs": [{"model": path, "prompts": [[ids...]], "max_tokens": 32, "logprobs": 5, "temperature": 0,
"seed": null, "dtype": "auto", "llm": {extra LLM keyword arguments}, "repeat": 1}]}. Results carry the engine's
prefix-cache and preemption counters. Used by the tests so each TP degree starts its ranks in a fresh process.
"""

import json
import sys

from loaders.gguf_file import open_checkpoint
from server.llm import LLM
from server.engine.sampler import SamplingParams


def main() -> None:
    spec = json.load(sys.stdin)
    results = []
    for job in spec["jobs"]:
        try:
            llm = LLM(job.get("model"), tensor_parallel_size=spec["tp"], dtype=job.get("dtype", "auto"),
                      max_num_seqs=job.get("max_num_seqs", 8), max_model_len=job.get("max_model_len"),
                      **job.get("llm", {}))
        except Exception as e:  # reported to the test, which asserts on the message
            results.append({"error": f"{type(e).__name__}: {e}"})
            continue
        params = SamplingParams(max_tokens=job.get("max_tokens", 32), temperature=job.get("temperature", 0.0),
                                seed=job.get("seed"), logprobs=job.get("logprobs"), ignore_eos=True,
                                prompt_logprobs=job.get("prompt_logprobs"))
        prompts = job.get("prompts") or [list(llm.tokenizer.apply_chat_template(
            job["messages"], add_generation_prompt=True, tokenize=True, return_dict=False))]
        if "messages" in job:
            params.ignore_eos = False
        trace: list = []
        if job.get("trace"):  # after every step: (output tokens, computed tokens) of every sequence so far
            seen: list = []
            add = llm.engine.add
            llm.engine.add = lambda seq: (seen.append(seq), add(seq))
            llm.engine.step_listeners.append(lambda dt, n: trace.append([(len(s.output_ids), s.num_computed)
                                                                         for s in seen]))
        rounds = [llm.generate(prompts, params) for _ in range(job.get("repeat", 1))]
        outs = rounds[0]
        alone = [llm.generate([p], params)[0].token_ids for p in prompts] if job.get("alone") else []
        results.append({"outputs": [{"token_ids": o.token_ids, "text": o.text, "top_logprobs": o.top_logprobs,
                                     "prompt_logprobs": o.prompt_logprobs, "prompt_top": o.prompt_top_logprobs}
                                    for o in outs], "trace": trace,
                        "seq_parallel_steps": llm.executor.seq_parallel_steps,
                        "bytes_read": llm.executor.bytes_read,
                        "checkpoint_bytes": open_checkpoint(llm.cfg.model).total_bytes,
                        "repeats": [[o.token_ids for o in r] for r in rounds[1:]], "alone": alone,
                        "prefix_hit_tokens": llm.engine.replicas.pools[0].prefix_hit_tokens,
                        "preemptions": llm.engine.replicas.num_preemptions})
        llm.close()
    with open(spec["out"], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
