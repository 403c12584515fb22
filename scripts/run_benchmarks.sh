#!/usr/bin/env bash
# Every benchmark behind BENCHMARKS.md, in one run (~70 min on 2 cores), then the summary plot.
# Builds llama.cpp's own tools first (scripts/build_llama_cpp.sh, ~12 min once). bench_baseline's llama.cpp row and
# bench_servers' third row need llama-cpp-python in the venv (skipped without it):
# `.venv/bin/pip install llama-cpp-python==0.3.36 diskcache jinja2 sse-starlette starlette-context pydantic-settings`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p results
uptime
$PY scripts/bench_linear.py --output results/linear_fp32.json
$PY scripts/bench_linear.py --dtype bfloat16 --rows 1,8,32 --output results/linear_bf16.json
$PY scripts/bench_baseline.py --repeats 3 --output results/baseline_fp32.json
$PY scripts/bench_baseline.py --only transformers --only tpserve --dtype bfloat16 --repeats 3 \
    --output results/baseline_bf16.json
$PY scripts/bench_serving.py --tag tp1_auto
TPSERVE_THREADS=1 $PY scripts/bench_serving.py --tag tp1_t1
$PY scripts/bench_serving.py --tag tp1_bf16 --dtype bfloat16
$PY scripts/bench_serving.py --tag tp2 --tp 2
PYTHON=$PY scripts/build_llama_cpp.sh
$PY scripts/bench_servers.py --rounds 2
$PY scripts/bench_servers.py --rounds 2 --precision int8
$PY scripts/bench_servers.py --rounds 2 --precision int4
$PY scripts/bench_servers.py --rounds 2 --precision bf16
$PY scripts/bench_quant.py --rounds 3 --served
$PY scripts/bench_quant.py --linears --rows 1,8,32,512
$PY scripts/bench_quant_accuracy.py
$PY scripts/bench_tp.py --steps 12 --repeats 2 --rounds 2 --output results/tp_0.9b.json
$PY scripts/bench_tp.py --size 1gb --load-only --configs 1x2,2x1 --rounds 2 --output results/tp_1gb.json
$PY scripts/bench_allreduce.py --three
$PY scripts/bench_compile.py --rounds 3
$PY scripts/bench_compile.py --mode freezing --batches 1 --rounds 2
$PY scripts/plot_benchmarks.py
uptime
