#!/usr/bin/env bash
# A multi-node Ray cluster on this machine, bound to 127.0.0.1, for trying loomray.
#
#   cluster/local.sh start [NODES]   head + NODES-1 worker raylets (default 3 nodes)
#   cluster/local.sh status          nodes as Ray sees them, and our processes
#   cluster/local.sh stop            stop exactly what `start` started
#
# Then:  export RAY_ADDRESS=$(cat ${LOOMRAY_RUN_DIR:-/tmp/loomray-local}/address)
#
# Environment:
#   LOOMRAY_RUN_DIR     state, logs and Ray's temp dir (default /tmp/loomray-local;
#                       keep it short: Ray's unix socket paths live under it)
#   LOOMRAY_RAY_PORT    GCS port (default 6390, not Ray's 6379, to stay out of the way)
#   LOOMRAY_STORE       if set, `start` also runs `loomray supervise` against it
#   LOOMRAY_FAST_FAILOVER=0   keep Ray's default health checks (a dead node is then
#                       noticed after ~15 s instead of ~1.5 s)
#   PYTHON              interpreter with loomray installed (default: python3)
#
# The nodes are held by one daemon process (cluster/local_daemon.py, built on
# loomray.testing.cluster.local_cluster) rather than `ray start`: on one machine
# `ray start --address=127.0.0.1:...` cannot join a loopback-only head (see
# docs/ray-notes.md). `stop` signals only that daemon (and, after a grace
# period, processes naming our run dir); it never runs `ray stop`, which would
# kill every Ray process of this user on the machine.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUN_DIR="${LOOMRAY_RUN_DIR:-/tmp/loomray-local}"
PORT="${LOOMRAY_RAY_PORT:-6390}"
PYTHON="${PYTHON:-python3}"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0

die() { echo "local.sh: $*" >&2; exit 1; }

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Pids whose command line names our Ray temp dir (raylets, GCS, agents; workers rename themselves).
stragglers() { ps -eo pid=,args= | awk -v dir="$RUN_DIR/ray/" 'index($0, dir) && !/awk/ {print $1}'; }

start() {
  local nodes="${1:-3}"
  [[ "$nodes" =~ ^[1-9][0-9]*$ ]] || die "NODES must be a positive number, got '$nodes'"
  alive "$RUN_DIR/daemon.pid" && die "a cluster from $RUN_DIR is already running (cluster/local.sh stop first)"
  mkdir -p "$RUN_DIR"
  rm -f "$RUN_DIR/address"
  nohup "$PYTHON" "$HERE/local_daemon.py" "$RUN_DIR" "$nodes" "$PORT" > "$RUN_DIR/daemon.log" 2>&1 &
  echo $! > "$RUN_DIR/daemon.pid"
  for _ in $(seq 1 1200); do
    [ -s "$RUN_DIR/address" ] && break
    alive "$RUN_DIR/daemon.pid" || { tail -20 "$RUN_DIR/daemon.log" >&2; die "the cluster failed to start"; }
    sleep 0.1
  done
  [ -s "$RUN_DIR/address" ] || { stop; die "the cluster did not come up within 120 s"; }
  local address
  address="$(cat "$RUN_DIR/address")"
  if [ -n "${LOOMRAY_STORE:-}" ]; then
    nohup loomray supervise --store "$LOOMRAY_STORE" --address "$address" > "$RUN_DIR/supervise.log" 2>&1 &
    echo $! > "$RUN_DIR/supervise.pid"
  fi
  echo "cluster up: $nodes node(s) at $address (state in $RUN_DIR)"
  echo "  export RAY_ADDRESS=$address"
}

status() {
  if ! alive "$RUN_DIR/daemon.pid"; then echo "no cluster from $RUN_DIR is running"; return 1; fi
  echo "address: $(cat "$RUN_DIR/address" 2>/dev/null || echo 'starting...')  daemon pid: $(cat "$RUN_DIR/daemon.pid")"
  RAY_ADDRESS="$(cat "$RUN_DIR/address")" "$PYTHON" - <<'EOF' || true
import ray
ray.init(log_to_driver=False, logging_level="ERROR")
for n in sorted(ray.nodes(), key=lambda n: n["NodeID"]):
    res = {k: v for k, v in n["Resources"].items() if not k.startswith("node:")}
    print(f"  {'alive' if n['Alive'] else 'dead '} {n['NodeID'][:12]} {n['NodeManagerAddress']} {res}")
EOF
}

stop() {
  if alive "$RUN_DIR/supervise.pid"; then kill "$(cat "$RUN_DIR/supervise.pid")" || true; fi
  rm -f "$RUN_DIR/supervise.pid"
  if alive "$RUN_DIR/daemon.pid"; then
    kill -TERM "$(cat "$RUN_DIR/daemon.pid")"
    # The daemon stops every node and waits for their processes (up to ~15 s).
    for _ in $(seq 1 300); do alive "$RUN_DIR/daemon.pid" || break; sleep 0.1; done
  fi
  local left
  left="$(stragglers)"
  if [ -n "$left" ]; then
    echo "killing leftover processes of $RUN_DIR: $(echo $left)" >&2
    # shellcheck disable=SC2086
    kill -KILL $left 2>/dev/null || true
  fi
  rm -f "$RUN_DIR/daemon.pid" "$RUN_DIR/address"
  echo "stopped the cluster of $RUN_DIR"
}

case "${1:-}" in
  start) shift; start "$@" ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start [NODES] | status | stop" >&2; exit 2 ;;
esac
