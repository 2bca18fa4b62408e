#!/usr/bin/env bash
# Run on the GPU device machine (after ../shared/gpu/README.md's staging). Usage:
#   bash benchmarks/device.sh tests        # GPU tests (tests/gpu) and unit tests, log to $OUT/gpu-tests.log
#   bash benchmarks/device.sh gpu          # GPU tests of the streamer only (tests/gpu without the ipc ones)
#   bash benchmarks/device.sh ipctests [K]    # ipc_cache on CUDA (tests/gpu/test_ipc_{cache,reload}_gpu.py [-k K]), logs in $OUT/pytest
#   bash benchmarks/device.sh ipcprobe [GiB]  # legacy CUDA IPC vs VMM fds -> $OUT/ipc-probe.md
#   bash benchmarks/device.sh bench [TP]   # 16 GB 8B-shaped model: auto, built-in runai, ours, the peers -> $OUT/bench-tpN (COLD=1: a cold page cache, load_bench --cold -> $OUT/bench-tpN-cold)
#   bash benchmarks/device.sh pinprobe     # no staging needed: page-locking vs model construction (pin_probe.py)
#   bash benchmarks/device.sh streamprobe  # no staging needed (carry .whl with liburing): the direct path alone, read-path variants (stream_probe.py; VARIANTS, ROUNDS) -> $OUT/stream-probe.{md,json}
#   bash benchmarks/device.sh profile      # where "Model loading took" goes (ipc_cache zero_copy and copy, ours, auto; PROFILE, PROFILE_SHAPE) -> $OUT/profile-*
#   bash benchmarks/device.sh sleep        # sleep mode with our loaders (tests/gpu/test_sleep_gpu.py)
#   bash benchmarks/device.sh sleepbench   # sleep / wake / reload seconds on the 16 GB model (sleep_bench.py) -> $OUT/sleep-8b
#   bash benchmarks/device.sh content      # content digest cost on the 16 GB model: inspect, ours hashed, daemon -> $OUT/
#   bash benchmarks/device.sh zoo [MODELS]  # model-zoo parity (zoo_bench.py): auto, ours, ipc_cache both modes -> $OUT/zoo
#   bash benchmarks/device.sh candidates   # TP=1: the default reader (pinned), unpinned, spaced events and instanttensor in REPEATS (3) interleaved rounds, after the candidates' GPU tests -> $OUT/bench-tp1
#   bash benchmarks/device.sh target       # issue 28's TP=1 target in one call: ours and instanttensor BUFFERED, REPEATS (3) interleaved rounds, then tp1_target.py's verdict -> $OUT/target-tp1
#   bash benchmarks/device.sh usagestats   # the target's two loaders with and without vLLM's usage reporter (its py-cpuinfo child runs beside the load), REPEATS (3) interleaved rounds, tp1_target.py's verdict of each pair -> $OUT/usage-tp1
#   bash benchmarks/device.sh cmd 'CMD'    # CMD with this checkout's plugin installed and the staged vLLM on the path
set -uo pipefail
if [ "${1:-}" = pinprobe ]; then
  PYTHONPATH=$PWD/src python3 benchmarks/pin_probe.py; exit $?
fi
if [ "${1:-}" = streamprobe ]; then
  # the image's torch and safetensors suffice; liburing (the io_uring reader) comes from the carried .whl
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/streamprobe-site .whl/liburing-*.whl || exit 3
  OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
  PYTHONPATH=/tmp/streamprobe-site:$PWD/src PYTHONUNBUFFERED=1 python3 benchmarks/stream_probe.py \
    --model /root/models/llama3-8b-shape --make 8b --variants "${VARIANTS:-torch,driver}" --rounds "${ROUNDS:-5}" \
    --out "$OUT/stream-probe.json" 2>&1 | tee "$OUT/stream-probe.md"; exit ${PIPESTATUS[0]}
fi
ls /root/site/vllm >/dev/null || exit 3
export PYTHONPATH=/root/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# (re)install this checkout's plugin so its entry point is the one vLLM finds
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade --target /root/site . >/dev/null 2>&1 || echo "plugin install failed"
# the wheels carried in .whl: the peers (instanttensor, fastsafetensors for cp312; load_bench runs them if
# importable) and this package's liburing (the io_uring reader), which the staged bundle does not hold
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .whl/*.whl >/dev/null 2>&1 || echo "peer wheels install failed"
fi
PYTHONPATH=/root/site python3 -c "import liburing" 2>/dev/null || echo "WARNING: liburing cannot be imported: no io_uring reader here (its GPU tests skip, auto reads with the pread threads); carry its cp312 wheel in .whl (pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 liburing -d .whl)"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
case "${1:-tests}" in
  cmd)
    bash -c "$2"; exit $? ;;
  tests)
    python3 -m pytest -v -rs -x tests/gpu tests/unit 2>&1 | tee "$OUT/gpu-tests.log"; exit ${PIPESTATUS[0]} ;;
  gpu)
    # the streamer's GPU tests (zoo through both read paths, greedy ids = auto at TP 1 and 2), not the ipc ones
    FASTLOAD_GPU_MODELS=/root/models python3 -m pytest -v -rs --tb=short tests/gpu \
      --ignore=tests/gpu/test_ipc_cache_gpu.py --ignore=tests/gpu/test_sleep_gpu.py 2>&1 | tee "$OUT/gpu-tests.log"; exit ${PIPESTATUS[0]} ;;
  probe)
    python3 benchmarks/make_model.py /root/models/llama3-8b-shape --shape 8b >/dev/null
    cat /root/models/llama3-8b-shape/*.safetensors > /dev/null
    python3 benchmarks/reader_probe.py /root/models/llama3-8b-shape ${2:-} 2>&1 | tee "$OUT/probe.md"; exit ${PIPESTATUS[0]} ;;
  ipctests)
    # engine/daemon logs of every test land in $OUT/pytest (they come back even when the call is cut short)
    FASTLOAD_GPU_MODELS=/root/models python3 -m pytest -v -rs --tb=short --basetemp="$OUT/pytest" \
      tests/gpu/test_ipc_cache_gpu.py tests/gpu/test_ipc_reload_gpu.py ${2:+-k "$2"} 2>&1 | tee "$OUT/ipc-tests.log"; exit ${PIPESTATUS[0]} ;;
  ipcprobe)
    python3 benchmarks/ipc_probe.py --gib ${2:-4} 2>&1 | tee "$OUT/ipc-probe.md"; exit ${PIPESTATUS[0]} ;;
  profile)
    # where "Model loading took" goes (load_profile.py: spans, samples, GC pauses, imports), per load format;
    # PROFILE="ipc ipc-copy runai auto ipc-nofreeze runai-nofreeze" picks the runs (a name may repeat); a run
    # name ending in -first also freezes the heap just before LLM() (load_profile.py --freeze-first)
    # PROFILE_SHAPE picks make_model.py's shape (default 8b, the 16 GB model; deep: 22k tensors, issue 28)
    shape=${PROFILE_SHAPE:-8b}; M=/root/models/$([ "$shape" = 8b ] && echo llama3-8b-shape || echo "$shape")
    python3 benchmarks/make_model.py $M --shape $shape >/dev/null; cat $M/*.safetensors > /dev/null
    n=0
    for d in ${PROFILE:-ipc ipc-copy runai auto}; do
      n=$((n + 1)); first=()
      case $d in *-first) first=(--freeze-first); d=${d%-first} ;; esac
      case $d in
        ipc) args=(--load-format ipc_cache --daemon) ;;
        ipc-copy) args=(--load-format ipc_cache --daemon --extra '{"mode": "copy"}') ;;
        ipc-nofreeze) args=(--load-format ipc_cache --daemon --extra '{"freeze_gc": false}') ;;
        runai) args=(--load-format runai_streamer) ;;
        runai-nofreeze) args=(--load-format runai_streamer --extra '{"freeze_gc": false}') ;;
        auto) args=(--load-format auto) ;;
        *) echo "PROFILE: unknown run '$d' (ipc ipc-copy ipc-nofreeze runai runai-nofreeze auto, each also -first)"
           exit 2 ;;
      esac
      tag=$n-$d${first:+-first}
      python3 benchmarks/load_profile.py --model $M "${args[@]}" "${first[@]}" --out "$OUT/profile-$tag" \
        > "$OUT/profile-$tag.log" 2>&1
      echo "== $tag"; grep -h "Model loading took\|fastload: " "$OUT/profile-$tag.log" | cut -c1-300
      head -c ${PROFILE_HEAD:-2500} "$OUT/profile-$tag/profile.txt"
    done; exit 0 ;;
  sleepbench)
    # sleep mode on the 16 GB model: sleep / wake / reload seconds per loader, greedy ids after each wake
    python3 benchmarks/sleep_bench.py --model /root/models/llama3-8b-shape --make 8b --out "$OUT/sleep-8b" 2>&1 | tail -20; exit ${PIPESTATUS[0]} ;;
  sleep)
    FASTLOAD_GPU_MODELS=/root/models python3 -m pytest -v -rs -s --tb=short --basetemp="$OUT/pytest-sleep" \
      tests/gpu/test_sleep_gpu.py 2>&1 | tee "$OUT/sleep-tests.log"; exit ${PIPESTATUS[0]} ;;
  content)
    # what "content_hash": true costs (issue 15, item 7): the GPU test, inspect --content-digest (warm page cache),
    # ours with and without hashing and the preload daemon's start with and without hashing, in one call
    M=/root/models/llama3-8b-shape
    python3 -m pytest -v -rs --tb=short tests/gpu/test_content_gpu.py 2>&1 | tee "$OUT/content-tests.log"
    python3 benchmarks/make_model.py $M --shape 8b >/dev/null; cat $M/*.safetensors > /dev/null
    for i in 1 2; do python3 -m vllm_fastload.cli inspect $M --no-fingerprint --content-digest --json \
      > "$OUT/inspect-$i.json"; done
    python3 benchmarks/load_bench.py --model $M --tp 1 --loaders runai_fastload,runai_fastload_hashed,ipc_zero_copy \
      --out "$OUT/bench-content-plain" 2>&1 | tee "$OUT/bench-content-plain.log"
    python3 benchmarks/load_bench.py --model $M --tp 1 --loaders ipc_zero_copy --daemon-extra '{"content_hash": true}' \
      --out "$OUT/bench-content-daemon" 2>&1 | tee "$OUT/bench-content-daemon.log"; exit ${PIPESTATUS[0]} ;;
  zoo)
    # every GPU zoo row (MODELS: comma-separated names, default every -small entry of model_zoo.py), LANES models
    # side by side, each engine GMU of the GPU with a fixed KV_BYTES cache (no memory profile to upset); LOADERS
    # picks the loaders
    models=${2:-$(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); from model_zoo import ZOO; print(",".join(k for k in ZOO if "-small" in k))')}
    VLLM_USE_DEEP_GEMM=0 python3 benchmarks/zoo_bench.py --models "$models" \
      --loaders "${LOADERS:-auto,runai_streamer,ipc_zero_copy,ipc_copy}" --lanes "${LANES:-4}" --gmu "${GMU:-0.1}" \
      --kv-bytes "${KV_BYTES:-2147483648}" --models-dir /root/models/zoo --out "$OUT/zoo" 2>&1 | tee "$OUT/zoo.log"
    exit ${PIPESTATUS[0]} ;;
  candidates)
    # the TP=1 read path's default (the loading thread pinned, FASTLOAD_URING_IOWQ_AFF) against it unpinned (uringnoa),
    # the opt-in candidates (FASTLOAD_H2D_EVENT_EVERY; FASTLOAD_URING_IOWQ_WORKERS through LOADERS=...uringw) and
    # instanttensor in one call: their GPU tests first (the zoo bit-exact with spaced events, the timeline on CUDA)
    python3 -m pytest -q -rs tests/gpu/test_direct_gpu.py -k "timeline or event_every or affinity" 2>&1 \
      | tee "$OUT/candidates-tests.log" | tail -3
    [ "${PIPESTATUS[0]}" = 0 ] || echo "WARNING: the candidates' GPU tests failed: $OUT/candidates-tests.log"
    # (in rounds, REPEATS of them, so that a drift of the machine falls on every loader alike)
    python3 benchmarks/load_bench.py --model /root/models/llama3-8b-shape --make 8b --tp 1 --interleave \
      --repeats "${REPEATS:-3}" --loaders "${LOADERS:-runai_fastload_uring,runai_fastload_uringnoa,runai_fastload_uringe2,instanttensor_buffered}" \
      --out "$OUT/bench-tp1" 2>&1 | tail -40; exit ${PIPESTATUS[0]} ;;
  target)
    python3 benchmarks/load_bench.py --model /root/models/llama3-8b-shape --make 8b --tp 1 --interleave \
      --repeats "${REPEATS:-3}" --loaders runai_fastload,instanttensor_buffered --out "$OUT/target-tp1" 2>&1 | tail -12
    python3 benchmarks/tp1_target.py "$OUT/target-tp1/results.json"; exit $? ;;
  usagestats)
    python3 benchmarks/load_bench.py --model /root/models/llama3-8b-shape --make 8b --tp 1 --interleave \
      --repeats "${REPEATS:-3}" --out "$OUT/usage-tp1" \
      --loaders runai_fastload,instanttensor_buffered,runai_fastload_nostats,instanttensor_buffered_nostats 2>&1 | tail -14
    python3 benchmarks/tp1_target.py "$OUT/usage-tp1/results.json"
    python3 benchmarks/tp1_target.py --ours runai_fastload_nostats --peer instanttensor_buffered_nostats \
      "$OUT/usage-tp1/results.json"; exit $? ;;
  bench)
    # a cold run writes beside a warm one of the same call, not over it
    tag=bench-tp${2:-1}$([ "${COLD:-0}" = 1 ] && echo -cold)
    python3 benchmarks/load_bench.py --model /root/models/llama3-8b-shape --make 8b --tp "${2:-1}" $([ "${COLD:-0}" = 1 ] && echo --cold) \
      --extra "${EXTRA:-{\}}" --loaders "${LOADERS:-auto,runai_builtin,runai_fastload,instanttensor,instanttensor_buffered,fastsafetensors,ipc_zero_copy,ipc_copy}" --out "$OUT/$tag" 2>&1 | tee "$OUT/$tag.log"; exit ${PIPESTATUS[0]} ;;
esac
