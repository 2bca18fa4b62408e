#!/bin/sh
# One container, one GPU: the preload daemon and the vLLM engine side by side (the NVIDIA device plugin gives each
# container its own GPU, so two containers could never share the daemon's memory). The daemon starts first and
# stays; the engine is restarted here when it exits (a crash, or `kill` after a config change), and maps the
# daemon's weights again instead of reading disk. If the daemon dies, the container exits and Kubernetes restarts
# the pod. SIGTERM (pod deletion) stops the engine, then the daemon (which removes its socket and memory).
# Inputs (env): MODEL, WEIGHT_ARGS (args that change the weights: both sides), ENGINE_ARGS, PRELOAD_ARGS,
# SOCKET_DIR, HEALTH_PORT.
set -u
: "${MODEL:?}" "${SOCKET_DIR:=/run/fastload/sock}" "${HEALTH_PORT:=8099}"
vllm-fastload preload --model "$MODEL" $WEIGHT_ARGS $PRELOAD_ARGS --weight-cache-socket-dir "$SOCKET_DIR" \
    --weight-cache-health-port "$HEALTH_PORT" &
DAEMON=$!
ENGINE=
stop() { [ -n "$ENGINE" ] && kill -TERM "$ENGINE" 2>/dev/null; wait "$ENGINE" 2>/dev/null
         kill -TERM "$DAEMON" 2>/dev/null; wait "$DAEMON"; exit 0; }
trap stop TERM INT
until python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$HEALTH_PORT/health', timeout=2)" 2>/dev/null; do
  kill -0 "$DAEMON" 2>/dev/null || { echo "supervise: preload daemon exited before it was ready" >&2; exit 1; }
  sleep 2
done
while kill -0 "$DAEMON" 2>/dev/null; do
  vllm serve "$MODEL" $WEIGHT_ARGS $ENGINE_ARGS --load-format ipc_cache \
      --model-loader-extra-config "{\"socket_dir\": \"$SOCKET_DIR\", \"state_timeout_s\": 600}" &
  ENGINE=$!
  wait "$ENGINE"; code=$?
  echo "supervise: engine exited ($code); restarting it against the running daemon" >&2
  sleep 2
done
echo "supervise: preload daemon exited; stopping" >&2
exit 1
