#!/usr/bin/env bash
# The main job: redis-server and redis-benchmark, unmodified, under `smcr run` (LD_PRELOAD of
# the smcr library): their TCP connections become SMC-R connections on our userspace RoCE v2
# engine. Prints redis-benchmark's rates, then how many connections went over SMC-R (from the
# library's per-connection log) and how few bytes their TCP sockets carried, what `smc-stat`
# showed meanwhile (sockets, link groups, fallback reasons), then the same benchmark over plain
# TCP for comparison.
#
# As root the SMC-R TCP option (eBPF) is used, as between real hosts (`smcr run` installs it
# under /sys/fs/bpf/smcr; `smcr bpf uninstall` removes it). Without root, both ends are
# started with --assume (each knows the other runs smcr).
#
# usage: bash scripts/demo.sh [REQUESTS]   (default 100000 per test)
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:-100000}"
if [ "$(id -u)" -eq 0 ]; then
  bash scripts/setup.sh >/dev/null
  mode=()
else
  command -v redis-server >/dev/null || { echo "demo: redis-server missing: run as root once (scripts/setup.sh installs it)" >&2; exit 1; }
  mode=(--assume)
fi
cargo build --release --locked -q -p preload -p smcr --lib --bin smcr --bin smc-stat
smcr=target/release/smcr
stat=target/release/smc-stat
addr=127.0.0.2
port=$((16000 + $$ % 1000))
work=$(mktemp -d /tmp/smcr-demo.XXXXXX)
log=$work/smcr.log
# The processes' stats areas, where smc-stat reads them (default /dev/shm/smcr).
export SMCR_STATS_DIR=$work/stats
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

wait_port() {
  for _ in $(seq 100); do
    (exec 3<>/dev/tcp/$addr/$1) 2>/dev/null && return 0
    sleep 0.1
  done
  echo "demo: redis-server did not start on $addr:$1" >&2
  exit 1
}

echo "== redis over SMC-R: redis-server and redis-benchmark under smcr run ${mode[*]}"
"$smcr" run "${mode[@]}" --log "$log" -- redis-server --bind $addr --port $port \
  --save "" --appendonly no --dir "$work" >"$work/server.out" &
pids+=($!)
wait_port $port
# The probe above was a plain client (a TCP fallback, logged by the server once it is
# negotiated); count from here on.
sleep 0.5
: >"$log"
"$smcr" run "${mode[@]}" --log "$log" -- redis-benchmark -h $addr -p $port -q \
  -t set,get,incr,lpush,lpop,mset -n "$n" -c 50 &
bench=$!
# While the benchmark runs (as soon as its 50 clients are connected; each test takes well
# under a second over SMC-R): what their TCP sockets carried (the CLC handshake only), and
# what smc-stat shows.
tcp_conns=0
tcp_bytes=0
echo "(the benchmark ended before a look)" >"$work/stat.txt"
: >"$work/links.txt"
while kill -0 $bench 2>/dev/null; do
  if [ "$(ss -tnH state established "( sport = :$port )" | wc -l)" -ge 50 ]; then
    "$stat" >"$work/stat.txt"
    "$stat" -R >"$work/links.txt"
    tcp_bytes=$(ss -tinH state established "( sport = :$port )" | grep -o 'bytes_received:[0-9]*' | cut -d: -f2 | sort -n | tail -1 || true)
    tcp_conns=$(ss -tnH state established "( sport = :$port )" | wc -l)
    break
  fi
  sleep 0.02
done
wait $bench
client=$(grep -c 'connect.*): SMC-R' "$log" || true)
server=$(grep -c 'accept.*): SMC-R' "$log" || true)
tcp=$(grep -c 'TCP:' "$log" || true)
echo "SMC-R connections: $client from redis-benchmark, $server accepted by redis-server; $tcp fell back to TCP"
echo "while running: $tcp_conns server TCP sockets, each received at most ${tcp_bytes:-0} bytes over TCP (the CLC handshake); the payload went by RDMA WRITE"
if [ "$tcp" -gt 0 ]; then
  grep 'TCP:' "$log" | sed 's/^/  /' | head -5
fi
echo "-- smc-stat while the benchmark ran ($(($(wc -l <"$work/stat.txt") - 1)) sockets; the first ones):"
head -4 "$work/stat.txt"
echo "-- smc-stat -R (link groups):"
cat "$work/links.txt"
echo "-- smc-stat --fallback (redis-server: the start-up probe above was a plain client):"
"$stat" --fallback --pid "${pids[0]}" || true
kill "${pids[0]}"; wait "${pids[0]}" 2>/dev/null || true; pids=()

echo "== the same over plain TCP (no smcr)"
redis-server --bind $addr --port $((port + 1)) --save "" --appendonly no --dir "$work" >/dev/null &
pids+=($!)
wait_port $((port + 1))
redis-benchmark -h $addr -p $((port + 1)) -q -t set,get,incr,lpush,lpop,mset -n "$n" -c 50
[ "$client" -ge 50 ] && [ "$server" -ge 50 ] || { echo "demo: the benchmark did not run over SMC-R" >&2; exit 1; }
