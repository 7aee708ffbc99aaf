#!/usr/bin/env bash
# A user's own launcher for a vLLM-CPU + in-process LMCache + Mooncake store stack: a Mooncake master, two
# standalone contributors (mooncake_client) that hold the data, vLLM with LMCacheConnectorV1 whose remote
# tier is mooncakestore://, and a cache-less baseline vLLM; every service in its own session (setsid), its
# pid in a pidfile, its output in a log file. kvdrill does not run this; tests/real/test_attach_mooncake.py
# runs it on its "other machine" (a network namespace with its own sshd), where Mooncake's listeners that
# bind 0.0.0.0 whatever their flags stay inside that namespace, then attaches kvdrill with a stack file.
# Environment: VENV (the stack venv), MODEL (model dir), SHIM (kvdrill's vllm_shims directory: on CPU the
# in-process connector needs its CPU shim, defect D11), DIR (state: pidfiles, logs, LMCache config), HOST
# (the address the HTTP APIs answer on), ports P_RPC P_METRICS P_META P_A_RPC P_A_HTTP P_B_RPC P_B_HTTP
# P_ENGINE P_BASELINE.
set -euo pipefail
mkdir -p "$DIR/logs"

start() {  # start NAME ARGV...: detached, in its own session; the pid is the service's (setsid execs)
  local name=$1; shift
  setsid "$@" >>"$DIR/logs/$name.log" 2>&1 < /dev/null &
  echo $! > "$DIR/$name.pid"
}

# the commands live in NAME.argv (one argument per line), so the stack file's cmdline and start command are
# the very same words
argv() { mapfile -t ARGV < "$DIR/$1.argv"; }

export MC_TCP_BIND_ADDRESS=127.0.0.1
argv mooncake-master; start mooncake-master "${ARGV[@]}"
argv store-a; start store-a "${ARGV[@]}"
argv store-b; start store-b "${ARGV[@]}"

VLLM_ENV=(LD_PRELOAD="$VENV/lib/libiomp5.so" VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1
  VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1)
argv baseline; env "${VLLM_ENV[@]}" setsid "${ARGV[@]}" >>"$DIR/logs/baseline.log" 2>&1 < /dev/null &
echo $! > "$DIR/baseline.pid"
argv engine
env "${VLLM_ENV[@]}" VLLM_SERVER_DEV_MODE=1 LMCACHE_CONFIG_FILE="$DIR/lmcache.yaml" LMCACHE_DISABLE_BANNER=1 \
  PYTHONHASHSEED=0 PYTHONPATH="$SHIM" setsid "${ARGV[@]}" >>"$DIR/logs/engine.log" 2>&1 < /dev/null &
echo $! > "$DIR/engine.pid"
