#!/usr/bin/env bash
# Issue 17's table in one run: the bundled 34-turn transcript (generated replies) and the
# 130-turn SGD session (teacher-forced), each under `clm` (budget 1024) and `prefix` (the
# full history every turn, the server's prompt cache on), through one llama-server.
#
#   bash docs/bench_remote.sh [OUT]      (default OUT: docs/bench)
#
# Needs the llama-server binary that `make test-remote` builds (CLM_LLAMA_SERVER, or the
# cache path below). The server and the client get one thread each, on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-docs/bench}"
SERVER="${CLM_LLAMA_SERVER:-$HOME/.cache/clm-middleware/llama-server-0.3.36/bin/llama-server}"
CLM="${CLM:-.venv/bin/clm}"
PORT="${PORT:-8091}"
GGUF="$(.venv/bin/python -c 'from clm_middleware.models.loading import _default_source; print(_default_source().path)')"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1

"$SERVER" --model "$GGUF" --host 127.0.0.1 --port "$PORT" --ctx-size 16384 --parallel 2 --threads 1 \
    --no-webui --no-repack >"${TMPDIR:-/tmp}/clm_bench_llama_server.log" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null || true' EXIT
for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    sleep 1
done
echo "commit $(git rev-parse --short HEAD)" >"$OUT/remote_run.txt"
"$CLM" bench examples/transcripts/lisbon_trip.jsonl --engine "openai:http://127.0.0.1:$PORT" \
    --modes prefix,clm --budget 1024 --max-new-tokens 32 \
    --markdown "$OUT/remote_lisbon.md" --report-dir "$OUT/remote_lisbon"
"$CLM" bench examples/retention/sgd_session_10.jsonl --engine "openai:http://127.0.0.1:$PORT" \
    --modes prefix,clm --budget 1024 --teacher-force \
    --markdown "$OUT/remote_sgd.md" --report-dir "$OUT/remote_sgd"
date -u +"finished %Y-%m-%dT%H:%MZ" >>"$OUT/remote_run.txt"
