#!/bin/sh
# One container, one GPU: the preload daemon and the vLLM engine side by side (the NVIDIA device plugin gives each
# container its own GPU, so two containers could never share the daemon's memory). The daemon starts first and
# stays; the engine is restarted here when it exits (a crash, or `kill` after a config change), with a back-off
# from 2 s doubling to 60 s while it keeps failing fast, and maps the daemon's weights again instead of reading
# disk. If the daemon dies, the engine is stopped and the container exits 1 (Kubernetes restarts the pod).
# SIGTERM (pod deletion) stops the engine, then the daemon (which removes its socket and memory), each given
# STOP_GRACE_S seconds before SIGKILL.
# Inputs (env): MODEL (required), WEIGHT_ARGS (args that change the weights: both sides), ENGINE_ARGS, PRELOAD_ARGS,
# SOCKET_DIR, HEALTH_PORT, STOP_GRACE_S. The *_ARGS are split on spaces (no quoting inside them, no globbing).
set -u
set -f
: "${MODEL:?MODEL must name the model directory}"
WEIGHT_ARGS=${WEIGHT_ARGS:-} ENGINE_ARGS=${ENGINE_ARGS:-} PRELOAD_ARGS=${PRELOAD_ARGS:-}
SOCKET_DIR=${SOCKET_DIR:-/run/fastload/sock} HEALTH_PORT=${HEALTH_PORT:-8099} STOP_GRACE_S=${STOP_GRACE_S:-30}
log() { echo "supervise: $*" >&2; }
alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }
stop_pid() {  # TERM, then KILL after STOP_GRACE_S
  alive "$1" || return 0
  kill -TERM "$1" 2>/dev/null
  i=0; while alive "$1" && [ "$i" -lt "$STOP_GRACE_S" ]; do sleep 1; i=$((i + 1)); done
  alive "$1" && { log "pid $1 ignored SIGTERM for $STOP_GRACE_S s: SIGKILL"; kill -KILL "$1" 2>/dev/null; }
  wait "$1" 2>/dev/null
}
vllm-fastload preload --model "$MODEL" $WEIGHT_ARGS $PRELOAD_ARGS --weight-cache-socket-dir "$SOCKET_DIR" \
    --weight-cache-health-port "$HEALTH_PORT" &
DAEMON=$!
ENGINE=
STOPPING=
on_term() { STOPPING=1; }
trap on_term TERM INT
healthy() { python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$HEALTH_PORT/health', timeout=2)" 2>/dev/null; }
waited=0
until healthy; do
  [ -n "$STOPPING" ] && { stop_pid "$DAEMON"; exit 0; }
  alive "$DAEMON" || { wait "$DAEMON"; log "preload daemon exited ($?) before it was ready"; exit 1; }
  sleep 2; waited=$((waited + 2))
  [ $((waited % 60)) -eq 0 ] && log "still waiting for the preload daemon's /health on 127.0.0.1:$HEALTH_PORT (${waited} s)"
done
log "preload daemon ready (pid $DAEMON)"
backoff=2
while :; do
  vllm serve "$MODEL" $WEIGHT_ARGS $ENGINE_ARGS --load-format ipc_cache \
      --model-loader-extra-config "{\"socket_dir\": \"$SOCKET_DIR\", \"state_timeout_s\": 600}" &
  ENGINE=$!
  started=$(date +%s)
  while alive "$ENGINE" && alive "$DAEMON" && [ -z "$STOPPING" ]; do sleep 1; done
  if [ -n "$STOPPING" ]; then stop_pid "$ENGINE"; stop_pid "$DAEMON"; exit 0; fi
  if ! alive "$DAEMON"; then
    wait "$DAEMON"; code=$?
    log "preload daemon exited ($code) while the engine ran; stopping the engine"
    stop_pid "$ENGINE"; exit 1
  fi
  wait "$ENGINE"; code=$?
  [ $(( $(date +%s) - started )) -ge 60 ] && backoff=2  # it had run a while: not a crash loop
  log "engine exited ($code); restarting it against the running daemon in $backoff s"
  i=0; while [ "$i" -lt "$backoff" ] && [ -z "$STOPPING" ]; do sleep 1; i=$((i + 1)); done
  [ -n "$STOPPING" ] && { stop_pid "$DAEMON"; exit 0; }
  backoff=$((backoff * 2)); [ "$backoff" -gt 60 ] && backoff=60
done
