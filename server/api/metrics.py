"""Prometheus metrics (prometheus-client), one registry per server so tests can run several in one process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("tpserve_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("tpserve_requests_waiting", "Sequences waiting to be scheduled", registry=r)
        self.kv_usage = Gauge("tpserve_kv_cache_usage_ratio",
                              "Fraction of KV-cache blocks held by sequences (cached free blocks count as free)",
                              registry=r)
        # the same per data-parallel replica (--data-parallel-size): how the server balances its replicas
        self.replica_running = Gauge("tpserve_replica_requests_running", "Sequences running, per replica",
                                     ["replica"], registry=r)
        self.replica_waiting = Gauge("tpserve_replica_requests_waiting", "Sequences waiting, per replica",
                                     ["replica"], registry=r)
        self.replica_kv_usage = Gauge("tpserve_replica_kv_cache_usage_ratio", "KV-cache block usage, per replica",
                                      ["replica"], registry=r)
        self.replicas_alive = Gauge("tpserve_replicas_alive", "Replicas in rotation (--data-parallel-size when all "
                                    "serve)", registry=r)
        self.replica_failures = Counter("tpserve_replica_failures", "Replicas taken out of rotation because a rank "
                                        "died or hung", registry=r)
        self.lora_loaded = Gauge("tpserve_lora_adapters_loaded", "LoRA adapters held in the ranks' slots",
                                 registry=r)
        self.lora_running = Gauge("tpserve_lora_requests_running", "Sequences running, per LoRA adapter", ["adapter"],
                                  registry=r)
        self.prefix_queries = Counter("tpserve_prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache (at admission)", registry=r)
        self.prefix_hits = Counter("tpserve_prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache (their prefill was skipped)", registry=r)
        self.preemptions = Counter("tpserve_num_preemptions",
                                   "Running sequences preempted for lack of KV-cache blocks (recomputed later)",
                                   registry=r)
        self._synced: dict[str, float] = {}
        self._experts: ExpertTokens | None = None
        self.finished = Counter("tpserve_requests_finished", "Finished sequences by finish reason", ["reason"],
                                registry=r)
        self.prompt_tokens = Counter("tpserve_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("tpserve_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("tpserve_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("tpserve_inter_token_latency_seconds", "Time between two tokens of a sequence",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tpserve_e2e_request_latency_seconds", "Request latency, arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.responses_stored = Gauge("tpserve_responses_stored", "Responses held for previous_response_id / GET",
                                      registry=r)
        self.responses_store_bytes = Gauge("tpserve_responses_store_bytes", "JSON bytes of the stored responses",
                                           registry=r)
        self.responses_evicted = Counter("tpserve_responses_evicted",
                                         "Stored responses evicted (least recently used) to stay within the bounds",
                                         registry=r)
        # speculative decoding, as vLLM names them (server/engine/spec_decode/proposers.py)
        self.spec_drafts = Counter("tpserve_spec_decode_num_drafts", "Verifications of proposed tokens", registry=r)
        self.spec_draft_tokens = Counter("tpserve_spec_decode_num_draft_tokens", "Proposed tokens verified",
                                         registry=r)
        self.spec_accepted_tokens = Counter("tpserve_spec_decode_num_accepted_tokens", "Proposed tokens kept",
                                            registry=r)
        self.spec_accepted_per_pos = Counter("tpserve_spec_decode_num_accepted_tokens_per_pos",
                                             "Proposed tokens kept, by their position in the proposal", ["position"],
                                             registry=r)
        self.step_seconds = Histogram("tpserve_step_seconds", "Duration of one engine step", buckets=LATENCY_BUCKETS,
                                      registry=r)
        self.rank_placement = Info("tpserve_rank_placement", "Where each rank runs: host, NUMA node(s) (empty: not "
                                   "bound), CPUs, torch threads, memory policy or why not bound (--numa)", ["rank"],
                                   registry=r)

    def show_placements(self, placements: dict[int, dict[str, str]]) -> None:
        """What every rank reported at start (sharding/dist.py: placement_record), one info sample per rank."""
        for rank, record in sorted(placements.items()):
            self.rank_placement.labels(str(rank)).info(dict(record))

    def watch_experts(self, model) -> None:
        """Export an MoE model's per-expert token counts (ExpertTokens), once."""
        if self._experts is None:
            self._experts = ExpertTokens(model)
            if self._experts.layers:
                self.registry.register(self._experts)

    def sync_counter(self, counter: Counter, name: str, total: float) -> None:
        """Bring a counter up to a running total kept elsewhere (the engine's own counts)."""
        delta = total - self._synced.get(name, 0.0)
        if delta > 0:
            counter.inc(delta)
            self._synced[name] = total


class ExpertTokens:
    """`tpserve_moe_expert_tokens_total{layer,expert}`: the tokens routed to each expert of each MoE layer rank 0
    holds (every layer without pipeline parallelism; replica 0's, under data parallelism, as every replica's
    routing is the same function of its own traffic). Read from the layers' own counters at each scrape."""

    def __init__(self, model) -> None:
        from sharding.layers.moe import SparseMoe

        self.layers = [(getattr(layer, "layer_idx", i), layer.mlp) for i, layer in enumerate(model.layers)
                       if isinstance(getattr(layer, "mlp", None), SparseMoe)]

    def collect(self):
        family = CounterMetricFamily("tpserve_moe_expert_tokens", "Tokens routed to each expert, by MoE layer",
                                     labels=["layer", "expert"])
        for idx, moe in self.layers:
            for e, n in enumerate(moe.tokens_per_expert.tolist()):
                family.add_metric([str(idx), str(e)], n)
        yield family
