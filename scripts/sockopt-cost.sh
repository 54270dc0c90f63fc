#!/usr/bin/env bash
# What the option program's cgroup socket-option programs cost every setsockopt/getsockopt of
# the host (docs/performance.md): a C loop of 2 million calls each, pinned to one CPU, with the
# programs attached and, as root with --detach, with them detached for the run (their link
# pins removed, then `smcr bpf install` again; marking fails meanwhile: run it on a quiet host).
# usage: bash scripts/sockopt-cost.sh [--detach] [--runs N] [--cpu C]
set -euo pipefail
cd "$(dirname "$0")/.."
detach=0 runs=3 cpu=1
while [ $# -gt 0 ]; do
  case "$1" in
    --detach) detach=1; shift ;;
    --runs) runs=${2:?}; shift 2 ;;
    --cpu) cpu=${2:?}; shift 2 ;;
    *) echo "sockopt-cost.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
out="${CARGO_TARGET_DIR:-target}/sockopt-cost"
mkdir -p "$out"
cat > "$out/loop.c" <<'C'
#include <stdio.h>
#include <time.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
int main(void) {
  int s = socket(AF_INET, SOCK_STREAM, 0), one = 1, v, n = 2000000;
  struct tcp_info ti; socklen_t l;
  double t = now();
  for (int i = 0; i < n; i++) setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, 4);
  double a = (now() - t) / n * 1e9;
  t = now();
  for (int i = 0; i < n; i++) { l = sizeof ti; getsockopt(s, IPPROTO_TCP, TCP_INFO, &ti, &l); }
  double b = (now() - t) / n * 1e9;
  t = now();
  for (int i = 0; i < n; i++) { l = 4; getsockopt(s, SOL_SOCKET, SO_RCVBUF, &v, &l); }
  double c = (now() - t) / n * 1e9;
  printf("setsockopt(TCP_NODELAY) %.0f ns  getsockopt(TCP_INFO) %.0f ns  getsockopt(SO_RCVBUF) %.0f ns\n", a, b, c);
  return 0;
}
C
cc -O2 -o "$out/loop" "$out/loop.c"
run() { for _ in $(seq "$runs"); do taskset -c "$cpu" "$out/loop"; done; }
echo "== with the socket-option programs attached (as installed now)"
run
if [ "$detach" -eq 1 ]; then
  dir=/sys/fs/bpf/smcr
  [ "$(id -u)" -eq 0 ] || { echo "--detach needs root" >&2; exit 1; }
  smcr=${SMCR:-target/release/smcr}
  [ -x "$smcr" ] || cargo build --release --locked -q -p smcr-tools --bin smcr
  rm -f "$dir/sk_opt_set_link_v1" "$dir/sk_opt_get_link_v1"
  trap '"$smcr" bpf install --only option >/dev/null' EXIT
  echo "== without them"
  run
fi
