"""The `tpserve` command: `serve` (the OpenAI-compatible server), `generate` (offline), `prepare` (default model).

`tpserve serve` launches its own ranks on this host; under torchrun each process is one rank and only rank 0 serves
HTTP. On SIGTERM/SIGINT the server drains: /health answers 503, new requests get 503, requests in flight finish
(up to --shutdown-timeout), then every rank exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time

from loaders import envs
from server.defaults import (DEFAULT_COMPILE_WORKERS, DEFAULT_STORE_KEY_SHARE, MAX_RUNTIME_LORAS,  # (light)
                             REASONING_PARSER_NAMES, TOOL_PARSER_NAMES)
from sharding import numa  # (light: no torch)

logger = logging.getLogger("tpserve")
STARTED = time.monotonic()  # the start's phases are logged with the time from here to serving


def _prefill_cap(text: str) -> int | str:
    """--max-prefill-tokens-while-decoding: `auto` or a count of at least 0."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be auto or a number of tokens at least 0 (got {text!r})")
    return value


def _cap_text(sched) -> str:
    if sched.costs is not None:
        return "a measured cap on"
    return str(sched.max_prefill_tokens_while_decoding or "no cap on")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="a local Hugging Face checkpoint folder or a GGUF file (or a folder holding one); default: "
                        "the embedded SmolLM2-135M-Instruct converted to float32; `default.gguf`: its own Q4_1 "
                        "GGUF file, served as it ships")
    p.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="use this tokenizer instead of the model's own: a Hugging Face tokenizer folder or a GGUF "
                        "file; its vocabulary, special tokens and chat template (its ids must fit the model's "
                        "embedding; EOS ids: the model's and the tokenizer's)")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="ranks each layer is split over (default 1)")
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1,
                   help="pipeline stages: contiguous groups of layers, each on its own tp ranks (default 1; "
                        "TPSERVE_PP_LAYER_PARTITION=3,2 sets the layers per stage)")
    p.add_argument("-dp", "--data-parallel-size", type=int, default=1,
                   help="replicas of the tp x pp ranks behind the one server (default 1)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="prefill steps split the tokens over the tp ranks between layers (Megatron sequence "
                        "parallelism): norms and residuals on a rank's tokens only; decode steps are unchanged")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="mixture-of-experts models: the tp ranks own whole experts (split as evenly as possible) "
                        "instead of a slice of every expert; attention stays tensor-parallel (default off)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations dtype (auto: the checkpoint's)")
    p.add_argument("--quantization", "-q", default=None, choices=["int8", "int4", "bf16"],
                   help="quantization of the linears and the LM head, done by each rank on its own shard at load: "
                        "int8 per block of 32 inputs (llama.cpp's Q8_0), int4 per group of inputs (Q4_0), bf16 "
                        "(16-bit weights); with AVX-512 VNNI / BF16 the linears' inputs are rounded to int8 / "
                        "bfloat16 as llama.cpp does (default: none)")
    p.add_argument("--quantization-group-size", type=int, default=32, choices=[32, 128],
                   help="int4: inputs per scale (default 32, as llama.cpp's Q4_0; 32 for layers whose input size is "
                        "not a multiple of 128)")
    p.add_argument("--no-quantized-cache", dest="quantized_cache", action="store_false",
                   help="with --quantization, neither read nor write the quantized-weights cache (by default the "
                        "first start keeps each rank's quantized linears under $TPSERVE_HOME/quantized and later "
                        "starts read them instead of quantizing again)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + completion in tokens (default: min(model maximum, 2048))")
    p.add_argument("--max-num-seqs", type=int, default=32,
                   help="most sequences in the running batch (default 32; reserves no memory)")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None, metavar="SIZE",
                   help="KV cache per rank, e.g. 4GiB, 512MiB (default: half the memory available after the weights, "
                        "split among this host's ranks, at most what --max-num-seqs sequences of --max-model-len "
                        "tokens use; on CUDA see --gpu-memory-utilization)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: fraction of the device's memory this process may use in all (default 0.9)")
    p.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32, 64, 128],
                   help="tokens per KV-cache block (default 16)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step: decoding sequences first, then prefill chunks (default 512)")
    p.add_argument("--max-prefill-tokens-while-decoding", type=_prefill_cap, default="auto",
                   help="while sequences decode, prefill tokens per step at most: bounds the pause a long prompt puts "
                        "in every running stream (default auto: sized from the measured step times so a step with a "
                        "prompt chunk lasts about 2 decode steps; 0: the step budget)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding (vLLM\'s keys), e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\'; methods ngram and suffix; greedy output '
                        'is unchanged, sampled output keeps its distribution')
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of earlier requests' identical prefixes (default on)")


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '1.5GB', '1000000' -> bytes (an argparse type: a readable error for anything else)."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use a number with an optional unit, e.g. 4GiB, "
                                         "512MiB, 2GB")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the KV cache needs more than 0 bytes")
    return value


def positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise SystemExit(f"tpserve: error: {name} must be at least 1 (got {value})")


def engine_config(args):
    from server.cli.launcher import resolve_model
    from sharding.runner import EngineConfig

    positive("--tensor-parallel-size", args.tensor_parallel_size)
    positive("--pipeline-parallel-size", args.pipeline_parallel_size)
    positive("--data-parallel-size", args.data_parallel_size)
    positive("--max-num-seqs", args.max_num_seqs)
    positive("--max-model-len", args.max_model_len)
    positive("--max-num-batched-tokens", args.max_num_batched_tokens)
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < args.max_num_seqs:
        raise SystemExit(f"tpserve: error: --max-num-batched-tokens ({args.max_num_batched_tokens}) must be at least "
                         f"--max-num-seqs ({args.max_num_seqs}): every running sequence decodes one token per step")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise SystemExit("tpserve: error: --gpu-memory-utilization must be in (0, 1] "
                         f"(got {args.gpu_memory_utilization})")
    model = args.model or args.model_flag
    return EngineConfig(resolve_model(model), args.dtype, args.max_num_seqs, args.max_model_len,
                        block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        pipeline_parallel_size=args.pipeline_parallel_size, data_parallel_size=args.data_parallel_size,
                        sequence_parallel=args.sequence_parallel, quantization=args.quantization,
                        quantization_group_size=args.quantization_group_size, quantized_cache=args.quantized_cache,
                        enable_expert_parallel=args.enable_expert_parallel, **lora_config(args))


def lora_config(args) -> dict:
    """The LoRA flags (serve only) as EngineConfig fields, checked."""
    if not getattr(args, "enable_lora", False):
        for flag in ("lora_modules", "lora_root", "lora_admin_key"):
            if getattr(args, flag, None):
                raise SystemExit(f"tpserve: error: --{flag.replace('_', '-')} needs --enable-lora")
        return {}
    positive("--max-loras", args.max_loras)
    positive("--max-runtime-loras", args.max_runtime_loras)
    if args.lora_root is not None and not os.path.isdir(args.lora_root):
        raise SystemExit(f"tpserve: error: --lora-root {args.lora_root!r} is not a folder")
    positive("--max-lora-rank", args.max_lora_rank)
    cpu = args.max_cpu_loras if args.max_cpu_loras is not None else args.max_loras
    positive("--max-cpu-loras", cpu)
    if cpu < args.max_loras:
        raise SystemExit(f"tpserve: error: --max-cpu-loras ({cpu}) must be at least --max-loras ({args.max_loras}): "
                         "every adapter of a step needs a slot")
    return dict(enable_lora=True, max_cpu_loras=cpu, max_lora_rank=args.max_lora_rank)


def describe_cache(runner, engine) -> str:
    """The pool at start, as vLLM prints it: blocks, tokens, and how many max-length sequences fit at once."""
    tokens = runner.num_blocks * runner.block_size
    sched, caching = engine.lanes[0].scheduler, engine.replicas.pools[0].enable_prefix_caching
    return (f"KV cache {runner.kv_cache_bytes() / 2**20:.0f} MiB per rank: {runner.num_blocks} blocks of "
            f"{runner.block_size} tokens = {tokens} tokens; maximum concurrency at {runner.max_model_len} tokens per "
            f"sequence: {tokens / runner.max_model_len:.2f}x; prefix caching "
            f"{'on' if caching else 'off'}; {sched.max_num_batched_tokens} tokens per step "
            f"({_cap_text(sched)} prefill tokens while decoding)")


def serve(args) -> int:
    import uvicorn

    from server.api.app import ServerState, build_app
    from server.api.embeddings import pooling_config
    from server.api.responses import ResponseStore
    from server.engine.spec_decode.proposers import parse_speculative_config
    from server.engine.supervisor import Supervisor, watch_steps
    from server.engine.core import Engine
    from server.engine.thread import EngineThread
    from server.cli.launcher import kill_workers, launch, torchrun_worker_signals, under_torchrun
    from server.engine.tokenizer import load_tokenizer
    from sharding.cpu import kernels

    api_key = args.api_key or envs.API_KEY.get()
    cfg = engine_config(args)
    if not 0 < args.responses_store_key_share <= 1:
        raise SystemExit(f"tpserve: error: --responses-store-key-share must be in (0, 1] (got "
                         f"{args.responses_store_key_share})")
    if not args.grammar_compile_timeout > 0:
        raise SystemExit(f"tpserve: error: --grammar-compile-timeout must be above 0 (got {args.grammar_compile_timeout})")
    for flag in ("grammar_compile_workers", "grammar_compile_queue"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"tpserve: error: --{flag.replace('_', '-')} must be 1 or more (got {getattr(args, flag)})")
    from transformers import AutoConfig

    speculative = parse_speculative_config(args.speculative_config)  # refused before any rank starts
    tokenizer = None  # a --tokenizer that does not fit is refused before any rank starts (on rank 0)
    if args.tokenizer is not None and (not under_torchrun() or os.environ.get("RANK", "0") == "0"):
        tokenizer = load_tokenizer(cfg.model, args.tokenizer)
    if speculative is not None and speculative.method == "draft_model" and os.path.isdir(cfg.model):
        from server.engine.spec_decode.draft_model import check_draft  # (the draft's vocabulary, before any rank starts)

        check_draft(speculative.model, AutoConfig.from_pretrained(cfg.model), tokenizer or load_tokenizer(cfg.model))
    name = args.served_model_name or os.path.basename(os.path.normpath(cfg.model))
    loras = None
    if cfg.enable_lora:  # every adapter checked against the base checkpoint before any rank starts
        from loaders.gguf_file import open_checkpoint
        from server.engine.lora_registry import LoraRegistry, parse_lora_modules
        from sharding.layers.lora import supports_lora
        from sharding.models import model_class

        with open_checkpoint(cfg.model) as ckpt:
            if not supports_lora(model_class(ckpt.architecture)):
                raise ValueError(f"--enable-lora: LoRA adapters are not supported for {ckpt.architecture} yet")
        keys = {k.strip() for k in (api_key or "").split(",") if k.strip()}
        if args.lora_admin_key is not None and args.lora_admin_key not in keys:
            raise SystemExit("tpserve: error: --lora-admin-key must be one of the --api-key keys (TPSERVE_API_KEY)")
        loras = LoraRegistry(cfg.model, name, args.max_loras, cfg.max_cpu_loras, cfg.max_lora_rank,
                             root=args.lora_root, max_runtime=args.max_runtime_loras, admin_key=args.lora_admin_key)
        for lora_name, path, base in parse_lora_modules(args.lora_modules):
            loras.register(loras.check(lora_name, path, base))
    pooling = None
    if os.path.isdir(cfg.model):  # checked before any rank starts: a pipeline this server cannot pool is refused
        try:
            pooling = pooling_config(cfg.model, AutoConfig.from_pretrained(cfg.model), args.pooling,
                                     args.normalize_embeddings)
        except (OSError, KeyError) as e:
            raise ValueError(f"cannot read the model's config or its sentence-transformers files: {e}") from None
    torchrun_worker_signals()
    compute = EngineThread()  # every torch call of this process runs there: loading now, the engine loop later
    runner, dist, workers = compute.call(launch, cfg, args.tensor_parallel_size, args.numa)
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.model)
    if pooling is None:
        pooling = pooling_config(cfg.model, runner.config, args.pooling, args.normalize_embeddings)
    exit_code = {"code": 0}
    server_ref: dict = {}

    def fatal(reason: str) -> None:
        """A rank died or hung: fail everything in flight, then stop the whole server non-zero."""
        logger.error("fatal: %s; stopping", reason)
        exit_code["code"] = 1

        def stop_later() -> None:
            time.sleep(1.0)  # let in-flight streams receive their error event
            kill_workers(workers)
            srv = server_ref.get("server")
            if srv is not None:
                srv.should_exit = True
            time.sleep(args.shutdown_timeout + 5)
            os._exit(1)  # uvicorn did not stop in time
        threading.Thread(target=stop_later, daemon=True).start()

    engine = Engine(runner, tokenizer, args.max_num_batched_tokens, args.enable_prefix_caching, on_fatal=fatal,
                    max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding,
                    speculative=speculative)
    engine.grammars.compile_timeout = args.grammar_compile_timeout
    engine.grammars.workers, engine.grammars.per_owner = args.grammar_compile_workers, args.grammar_compile_queue
    if loras is not None:
        engine.enable_lora(loras)
    state = ServerState(engine, tokenizer, name, runner.vocab_size, api_key=api_key, metrics_key=args.metrics_key,
                        max_queued_requests=args.max_queued_requests, max_body_bytes=args.max_body_bytes,
                        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                        pooling=pooling, responses=ResponseStore(args.responses_store_max_bytes,
                                                                 args.responses_store_max_count,
                                                                 key_share=args.responses_store_key_share),
                        loras=loras)
    engine.step_listeners.append(lambda dt, _: state.metrics.step_seconds.observe(dt))
    log_parsers(state, args)
    state.metrics.show_placements(dist.placements)
    supervisor = None
    if workers.procs:  # ranks this process spawned: a dead or hung replica is isolated and (by default) restarted
        supervisor = Supervisor(engine, runner, workers, cfg, restart=args.restart_failed_ranks,
                                max_restarts=args.max_rank_restarts, window_s=args.rank_restart_window)
        state.supervisor = supervisor
    else:
        workers.on_death = lambda rank, msg: engine.fail(msg)
    if engine.loras is not None:  # a wait for a replica's LoRA load reports ends when the replica is taken down
        engine.loras.gone = lambda r: engine.dead is not None or (supervisor is not None and r in supervisor.handling)
    workers.watch()
    engine.start(compute)
    watch_steps(engine, args.step_timeout, supervisor.on_hang if supervisor is not None else None)
    app = build_app(state)

    class DrainingServer(uvicorn.Server):
        """First SIGTERM/SIGINT: drain (503 for new work) until idle or --shutdown-timeout, then stop; a second
        signal stops at once. (uvicorn's own handler would re-raise the signal after shutdown, killing this process
        before it can stop the other ranks.)"""

        def handle_exit(self, sig, frame) -> None:
            if state.draining or exit_code["code"]:
                self.should_exit = self.force_exit = True
                return
            state.draining = True
            logger.info("draining: waiting up to %.0f s for %d request(s) in flight", args.shutdown_timeout,
                        engine.replicas.num_running + engine.num_waiting)

            def wait() -> None:
                deadline = time.monotonic() + args.shutdown_timeout
                while time.monotonic() < deadline and (engine.replicas.num_running or engine.num_waiting):
                    time.sleep(0.05)
                time.sleep(0.2)  # let the last responses flush
                self.should_exit = True

            threading.Thread(target=wait, daemon=True).start()

    server = DrainingServer(http_config(app, args))
    server_ref["server"] = server
    print(f"tpserve: {describe_cache(runner, engine)}", flush=True)
    layout = (f"tensor parallel size {args.tensor_parallel_size}" + (
        f", pipeline parallel size {args.pipeline_parallel_size}" if args.pipeline_parallel_size > 1 else "") + (
        f", data parallel size {args.data_parallel_size}" if args.data_parallel_size > 1 else "") + (
        f", {runner.cfg.quantization} weights" if runner.cfg.quantization else "") + (
        f", {runner.cfg.dtype} activations" if runner.cfg.dtype != args.dtype else "") + (
        f", {kernels.describe()}" if dist.device.type == "cpu" else ""))  # see cpu_precision, sharding/cpu/variants.py
    total = time.monotonic() - STARTED
    logger.info("started in %.1f s: %s, the rest %.1f s (imports, tokenizer, the other ranks)", total,
                runner.phases.summary(), max(total - sum(runner.phases.seconds.values()), 0.0))
    if engine.speculator is not None:
        print(f"tpserve: {engine.speculator.cfg.describe()}", flush=True)
    placements = describe_placements(dist.placements)
    if placements:
        print(f"tpserve: {placements}", flush=True)
    print(f"tpserve: serving {name} on http://{args.host}:{args.port} ({layout})", flush=True)
    exposed = open_without_key(args.host, bool(state.api_keys))
    if exposed:
        logger.warning("%s", exposed)
    try:
        server.run()
    finally:
        if supervisor is not None:
            supervisor.close()
        state.cpu.close()  # (tokenizing that waits is dropped: its clients are gone)
        engine.stop()
        live = [r for r in range(dist.layout.dp) if r not in engine.replicas.down]
        if engine.dead is None and dist.global_world_size > 1 and live:
            try:  # on the engine thread, which owns the collectives (free once the loop has stopped)
                compute.submit(runner.stop_workers, live).result(timeout=10)
            except Exception:  # noqa: BLE001 - a rank already gone, or the loop never came back
                exit_code["code"] = exit_code["code"] or 1
        workers.close(timeout=10)
        dist.shutdown()
    if engine.dead is not None:
        exit_code["code"] = 1
    return exit_code["code"]


def http_config(app, args):
    """uvicorn's configuration of the API server (tests/server/test_hostile_http.py serves the same): its h11 protocol
    with the header and body deadlines and the shedding of half-open connections (server/api/connections.py); no
    WebSocket (no route speaks it)."""
    import uvicorn

    from server.api.connections import guarded_protocol

    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                          timeout_graceful_shutdown=5, limit_concurrency=args.max_connections,
                          timeout_keep_alive=args.timeout_keep_alive, ws="none",
                          http=guarded_protocol(args.timeout_header, args.timeout_body))


def generate(args) -> int:
    from server.llm import LLM
    from server.engine.sampler import SamplingParams

    prompts = list(args.prompt) or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise SystemExit("tpserve: error: give --prompt (repeatable) or prompts on standard input, one per line")
    cfg = engine_config(args)
    llm = LLM(cfg.model, args.tensor_parallel_size, cfg.dtype, cfg.max_num_seqs, cfg.max_model_len,
              block_size=cfg.block_size, kv_cache_memory=cfg.kv_cache_memory,
              gpu_memory_utilization=cfg.gpu_memory_utilization, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=args.enable_prefix_caching,
              max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding,
              pipeline_parallel_size=cfg.pipeline_parallel_size, data_parallel_size=cfg.data_parallel_size,
              sequence_parallel=cfg.sequence_parallel, quantization=cfg.quantization,
              quantization_group_size=cfg.quantization_group_size, quantized_cache=cfg.quantized_cache,
              speculative_config=args.speculative_config, enable_expert_parallel=cfg.enable_expert_parallel,
              tokenizer=args.tokenizer)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        if args.chat:
            outs = [llm.chat([{"role": "user", "content": p}], params) for p in prompts]
        else:
            outs = llm.generate(prompts, params)
        for p, o in zip(prompts, outs):
            if args.json:
                print(json.dumps({"prompt": p, "text": o.text, "token_ids": o.token_ids,
                                  "finish_reason": o.finish_reason}))
            else:
                print(o.text)
    finally:
        llm.close()
    return 0


def open_without_key(host: str, keyed: bool) -> str | None:
    """The start's warning when the HTTP port listens beyond this host's loopback with no API key, else None."""
    import ipaddress

    if keyed:
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:  # a name
        if host == "localhost":
            return None
    where = "every interface" if host in ("0.0.0.0", "::", "") else host
    return (f"listening on {where} without --api-key: anyone who can reach this port can use the server; set "
            "--api-key (or TPSERVE_API_KEY), or --host 127.0.0.1 to serve this host only")


def describe_placements(placements: dict[int, dict[str, str]]) -> str | None:
    """The start line's account of where the ranks run, when any is bound to a NUMA node (None: none is)."""
    if not any(p["numa_nodes"] for p in placements.values()):
        return None
    hosts = {p["host"] for p in placements.values()}
    return "NUMA placement: " + "; ".join(
        f"rank {r}" + (f" on {p['host']}" if len(hosts) > 1 else "")
        + (f" node {p['numa_nodes']}" if p["numa_nodes"] else " unbound")
        + f", CPUs {p['cpus']}, {p['threads']} threads" for r, p in sorted(placements.items()))


def positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0 seconds (got {text})")
    return value


def log_parsers(state, args) -> None:
    """The start line of the output parsers: which tool format serves calls (`auto`: the one the template teaches)."""
    parsers = state.parsers
    if not state.tools_in_template:
        if args.tool_call_parser not in (None, "auto"):
            logger.warning("--tool-call-parser %s is not used: the chat template does not describe tools, so the "
                           "generic JSON format serves them (docs/reasoning-and-tools.md)", args.tool_call_parser)
        else:
            logger.info("tool calls: the chat template does not describe tools; the generic JSON format serves them")
    elif args.tool_call_parser == "auto":
        if parsers.tool_name is None:
            raise SystemExit("tpserve: error: --tool-call-parser auto: the chat template renders tools in no format "
                             f"this server reads; name one of {', '.join(TOOL_PARSER_NAMES)}")
        logger.info("tool calls: %s format (--tool-call-parser auto, from the chat template)", parsers.tool_name)
    elif args.tool_call_parser:
        logger.info("tool calls: %s format", args.tool_call_parser)
    if args.reasoning_parser:
        logger.info("reasoning: %s parser (reasoning_content apart from content)", args.reasoning_parser)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tpserve", description="A readable tensor-parallel LLM server")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1",
                   help="where the HTTP API listens (default 127.0.0.1: this host only; 0.0.0.0 for every interface, "
                        "with --api-key; docs/deployment.md)")
    s.add_argument("--port", type=int, default=envs.PORT.get(),
                   help="HTTP port (default: TPSERVE_PORT, else 8000; the Docker image's healthcheck probes the same)")
    s.add_argument("--served-model-name", default=None, help="the model id clients use (default: folder name)")
    s.add_argument("--metrics-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /metrics (default: open)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 (or TPSERVE_API_KEY); several keys "
                        "comma-separated, and a stored response is visible only to the key that made it")
    s.add_argument("--responses-store-max-bytes", type=parse_bytes, default=64 * 1024 * 1024, metavar="SIZE",
                   help="bound of the stored /v1/responses (their JSON), least recently used evicted (default 64M)")
    s.add_argument("--responses-store-max-count", type=int, default=10_000,
                   help="most stored /v1/responses, least recently used evicted (default 10000)")
    s.add_argument("--responses-store-key-share", type=float, default=DEFAULT_STORE_KEY_SHARE, metavar="FRACTION",
                   help="the share of both bounds one API key's stored responses may fill (default %(default)s; with "
                        "several --api-key keys only): past it, that key's own least recently used are evicted")
    s.add_argument("--max-queued-requests", type=int, default=256, help="waiting sequences before answering 429")
    s.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="largest request body (413 above)")
    s.add_argument("--tool-call-parser", choices=[*TOOL_PARSER_NAMES, "auto"], default=None,
                   help='read tool calls out of the answer for tool_choice "auto", in the format of the model\'s '
                        "family (vLLM's names; auto: the one the chat template teaches, named at start); without it, "
                        '"auto" is refused and "required" or a named function still force a call. A template '
                        "without tool support gets the generic JSON format, with or without this flag")
    s.add_argument("--reasoning-parser", choices=list(REASONING_PARSER_NAMES), default=None,
                   help="return the model's reasoning apart from its answer (message.reasoning_content, a Responses "
                        "reasoning item), in its family's markup: qwen3 and deepseek_r1 <think>...</think>, gpt_oss "
                        "harmony channels; structured outputs and forced calls then constrain only what follows it")
    s.add_argument("--grammar-compile-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="longest a structured-output grammar may take to compile before the request is refused "
                        "(default 10), counted from when a compile thread takes it up")
    s.add_argument("--grammar-compile-workers", type=int, default=DEFAULT_COMPILE_WORKERS, metavar="N",
                   help="threads compiling structured-output grammars (default %(default)s); one API key's compiles "
                        "hold at most N-1 of them, so another key's always finds one")
    s.add_argument("--grammar-compile-queue", type=int, default=32, metavar="N",
                   help="grammar compiles one API key (or, without keys, one client address) may have unfinished, "
                        "queued or running, before its next is answered 429 (default 32)")
    s.add_argument("--pooling", choices=["last", "mean", "cls"], default=None,
                   help="/v1/embeddings pooling (default: a sentence-transformers config in the model folder, else "
                        "last token)")
    s.add_argument("--no-normalize-embeddings", dest="normalize_embeddings", action="store_false", default=None,
                   help="return /v1/embeddings vectors without L2 normalization")
    s.add_argument("--max-connections", type=int, default=1024,
                   help="open connections; past it the one waiting longest for its request is closed, and when all "
                        "are busy requests get 503 (/health excepted)")
    s.add_argument("--timeout-header", type=positive_seconds, default=10.0, metavar="SECONDS",
                   help="a request's line and headers must arrive within this, else the connection is closed "
                        "(default 10)")
    s.add_argument("--timeout-body", type=positive_seconds, default=30.0, metavar="SECONDS",
                   help="a request's body must arrive within this after its headers, else 408 (default 30)")
    s.add_argument("--timeout-keep-alive", type=positive_seconds, default=5.0, metavar="SECONDS",
                   help="an idle connection is closed after this (default 5)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to finish requests on SIGTERM")
    s.add_argument("--step-timeout", type=float, default=120.0,
                   help="seconds without a step result before the ranks are declared hung: their replica's ranks are "
                        "killed and restarted (see --restart-failed-ranks), else the server stops")
    s.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters of the base model, picked by a request's `model` (docs/lora.md)")
    s.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="adapters to serve: name=path (a local PEFT folder) or JSON "
                        "{\"name\": ..., \"path\": ..., \"base_model_name\": ...}")
    s.add_argument("--max-loras", type=int, default=1, help="distinct adapters in one step (default 1)")
    s.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted (default 16)")
    s.add_argument("--lora-root", default=None, metavar="DIR",
                   help="the folder POST /v1/load_lora_adapter may load adapters from (symlinks resolved, relative "
                        "paths taken from it); without it, runtime loading is refused (docs/lora.md)")
    s.add_argument("--max-runtime-loras", type=int, default=MAX_RUNTIME_LORAS, metavar="N",
                   help="adapters one API key (without --api-key: the server) may have loaded at runtime at once "
                        "(default %(default)s)")
    s.add_argument("--lora-admin-key", default=None, metavar="KEY",
                   help="one of the --api-key keys that may unload any adapter, including --lora-modules ones (the "
                        "others unload only what they loaded)")
    s.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept loaded on the ranks; the least recently used one is evicted and read again "
                        "when needed (default: --max-loras)")
    s.add_argument("--restart-failed-ranks", action=argparse.BooleanOptionalAction, default=True,
                   help="start a replica's ranks again when one of them dies or hangs; its requests continue on the "
                        "other replicas or wait for it (default on; ranks started by torchrun are left to torchrun)")
    s.add_argument("--max-rank-restarts", type=int, default=3, metavar="N",
                   help="a replica that fails more than N times within --rank-restart-window is not restarted: the "
                        "server exits non-zero (default 3)")
    s.add_argument("--rank-restart-window", type=float, default=600.0, metavar="SECONDS",
                   help="the window --max-rank-restarts counts failures in (default 600)")
    s.add_argument("--numa", choices=numa.MODES, default=None,
                   help="where this host's CPU ranks run: auto binds each to a NUMA node (or an equal share of one) "
                        "when the host has several and the ranks are a multiple of them; distribute spreads them "
                        "over the nodes whatever the counts; off leaves them to the scheduler (default: "
                        "TPSERVE_NUMA, else auto; docs/numa.md)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g = sub.add_parser("generate", help="generate offline (no HTTP)")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable); else stdin, one per line")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    sub.add_parser("prepare", help="convert the embedded default model into the cache folder and print its path")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO if rank == "0" else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
    try:
        if args.cmd == "serve":
            return serve(args)
        if args.cmd == "generate":
            return generate(args)
        from loaders.default_model import ensure_default_model

        print(ensure_default_model())
        return 0
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # bad input, or a rank that failed to start
        print(f"tpserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
