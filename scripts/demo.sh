#!/usr/bin/env bash
# The main job: redis-server and redis-benchmark, unmodified, under `smcr run` (LD_PRELOAD of
# the smcr library), run as a user runs them: both on 127.0.0.1 (redis's default), as an
# unprivileged user (`nobody` when started as root), with `ulimit -n 1024`. Their TCP
# connections become SMC-R connections on our userspace RoCE v2 engine (same host: shared
# memory). Prints redis-benchmark's rates, then how many connections went over SMC-R (from the
# library's per-connection log) and how few bytes their TCP sockets carried, what `smc-stat`
# showed meanwhile (sockets, link groups, fallback reasons), then the same benchmark over plain
# TCP for comparison.
#
# As root the demo first does the administrator's one-time step, `smcr bpf install` (the TCP
# option program that signals SMC-R in SYN/SYN-ACK and the steering program that shares RoCE
# port 4791 between processes; `smcr bpf uninstall` removes both). Without root, an installed
# option program is used if there is one, else both ends start with --assume (each knows the
# other runs smcr).
#
# usage: bash scripts/demo.sh [REQUESTS]   (default 100000 per test)
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:-100000}"
cargo_build() { cargo build --release --locked -q -p preload -p smcr-tools --lib --bin smcr --bin smc-stat; }
work=$(mktemp -d /tmp/smcr-demo.XXXXXX)
chmod 755 "$work"
if [ "$(id -u)" -eq 0 ]; then
  bash scripts/setup.sh >/dev/null
  cargo_build
  target/release/smcr bpf install >/dev/null
  # The programs run as nobody: the library and the tools go where nobody can read them.
  user=nobody
  as=(setpriv --reuid=nobody --regid=nogroup --clear-groups --)
else
  user=$(id -un)
  command -v redis-server >/dev/null || { echo "demo: redis-server missing: run as root once (scripts/setup.sh installs it)" >&2; exit 1; }
  cargo_build
  as=()
fi
cp target/release/libsmcr_preload.so target/release/smcr target/release/smc-stat "$work/"
chmod 755 "$work"/libsmcr_preload.so "$work/smcr" "$work/smc-stat"
smcr=$work/smcr
stat=$work/smc-stat
mode=()
if ! "$smcr" bpf status >/dev/null 2>&1; then
  mode=(--assume)
fi
addr=127.0.0.1
port=$((16000 + $$ % 1000))
log=$work/smcr.log
: >"$log"
chmod 666 "$log"
# The processes' stats areas, where smc-stat reads them (default /dev/shm/smcr).
export SMCR_STATS_DIR=$work/stats
mkdir -p "$SMCR_STATS_DIR"
chmod 1777 "$SMCR_STATS_DIR"
data=$work/data
mkdir -p "$data"
[ ${#as[@]} -eq 0 ] || chown nobody:nogroup "$data"
# As a distribution starts a service: its user, `ulimit -n 1024` (exec: the background job's
# pid is the program's).
run() { exec prlimit --nofile=1024:1024 -- "${as[@]}" "$@"; }
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

echo "== redis over SMC-R: redis-server and redis-benchmark on $addr under smcr run ${mode[*]} (as $user, ulimit -n 1024)"
(run "$smcr" run "${mode[@]}" --log "$log" -- redis-server --bind $addr --port $port \
  --save "" --appendonly no --dir "$data" >"$work/server.out") &
pids+=($!)
wait_port $port
# The probe above was a plain client (a TCP fallback, logged by the server once it is
# negotiated); count from here on.
sleep 0.5
: >"$log"
(run "$smcr" run "${mode[@]}" --log "$log" -- redis-benchmark -h $addr -p $port -q \
  -t set,get,incr,lpush,lpop,mset -n "$n" -c 50) &
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
    "$stat" --links >"$work/links.txt"
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
echo "-- smc-stat --links (link groups):"
cat "$work/links.txt"
echo "-- smc-stat --fallback (redis-server: the start-up probe above was a plain client):"
"$stat" --fallback --pid "${pids[0]}" || true
kill "${pids[0]}"; wait "${pids[0]}" 2>/dev/null || true; pids=()

echo "== the same over plain TCP (no smcr)"
(run redis-server --bind $addr --port $((port + 1)) --save "" --appendonly no --dir "$data" >/dev/null) &
pids+=($!)
wait_port $((port + 1))
(run redis-benchmark -h $addr -p $((port + 1)) -q -t set,get,incr,lpush,lpop,mset -n "$n" -c 50)
[ "$client" -ge 50 ] && [ "$server" -ge 50 ] || { echo "demo: the benchmark did not run over SMC-R" >&2; exit 1; }
