#!/usr/bin/env bash
# Install, start the embedded cluster (store, prefill worker, decode worker, router) with the
# default model, serve one chat request through it, and keep serving until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. scripts/python.sh  # the interpreter install.sh installed into (./.venv on a PEP 668 Python)
PORT=${PDSERVE_PORT:-50051}
HTTP_PORT=${PDSERVE_HTTP_PORT:-8000}
log=$(mktemp -t pdserve-serve.XXXXXX)
"$PYTHON" -m pdserve.cli serve --port "$PORT" --http-port "$HTTP_PORT" >"$log" 2>&1 &
serve_pid=$!
trap 'kill -TERM $serve_pid 2>/dev/null; wait $serve_pid 2>/dev/null' EXIT INT TERM
echo "starting pdserve (log: $log) ..."
until grep -q "pdserve ready on" "$log"; do
  if ! kill -0 $serve_pid 2>/dev/null; then cat "$log"; exit 1; fi
  sleep 0.5
done
echo "ready on 127.0.0.1:$PORT; asking it something:"
"$PYTHON" -m pdserve.cli generate --chat --max-tokens 64 --address "127.0.0.1:$PORT" \
  "What are three good reasons to split LLM prefill and decode onto different machines?"
echo
case "$PYTHON" in
  .venv/*) activate=". .venv/bin/activate && " ;;  # `pdserve` is on PATH once activated
  *) activate="" ;;
esac
echo "Still serving on 127.0.0.1:$PORT: try  ${activate}pdserve generate --chat \"Hello\"  in another shell,"
echo "or the OpenAI-compatible API:  curl http://127.0.0.1:${HTTP_PORT}/v1/chat/completions \\"
echo "  -H 'content-type: application/json' -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}], \"max_tokens\": 32, \"temperature\": 0}'"
echo "Ctrl-C stops it."
wait $serve_pid
