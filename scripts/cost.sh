#!/usr/bin/env bash
# CPU, system calls and context switches per request (redis-benchmark GET, -c 50: -P 1, -P 16,
# -d 1024) and per GB (iperf3), across two network namespaces joined by a veth, with both ends
# under the shim or plain TCP (issue 27: what bounds the figures the bench reports). CPU is the
# machine's busy time from /proc/stat (user, nice, system, irq, softirq: both programs and the
# kernel's work for them); system calls and context switches are perf's, system-wide.
#
# usage: sudo bash scripts/cost.sh [smcr|tcp] [MTU]     (smcr: target/release/libsmcr_preload.so)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-smcr}; mtu=${2:-1500}; export mode
lib=$(readlink -f target/release/libsmcr_preload.so)
for t in redis-server redis-benchmark iperf3 perf; do
  command -v $t >/dev/null || { echo "cost: needs $t (scripts/setup.sh installs it)" >&2; exit 1; }
done
a=smcr-cost-a; b=smcr-cost-b
cleanup() { pkill -f "redis-server 10.79.0.2" 2>/dev/null || true; ip netns del $a 2>/dev/null || true; ip netns del $b 2>/dev/null || true; }
trap cleanup EXIT
cleanup
ip netns add $a; ip netns add $b
ip link add scva netns $a type veth peer scvb netns $b
ip -n $a addr add 10.79.0.1/24 dev scva; ip -n $b addr add 10.79.0.2/24 dev scvb
for n in $a $b; do ip -n $n link set lo up; done
ip -n $a link set scva mtu "$mtu" up; ip -n $b link set scvb mtu "$mtu" up
if [ "$mode" = tcp ]; then E=(env); else
  E=(env LD_PRELOAD="$lib" SMCR_NEGOTIATION=assume SMCR_CONFIG=off SMCR_STATS_DIR=off); fi
busy() { awk '/^cpu /{print $2+$3+$4+$7+$8}' /proc/stat; }
hz=$(getconf CLK_TCK)
out=$(mktemp -d)
ip netns exec $b "${E[@]}" redis-server --bind 10.79.0.2 --port 6399 --save '' --appendonly no --protected-mode no >/dev/null 2>&1 &
sleep 0.7
for args in "-n 300000" "-n 1000000 -P 16" "-n 300000 -d 1024"; do
  n=$(awk '{print $2}' <<< "$args")
  b0=$(busy)
  # shellcheck disable=SC2086
  perf stat -a -x, -e context-switches,raw_syscalls:sys_enter -o "$out/ps.csv" -- \
    ip netns exec $a "${E[@]}" redis-benchmark -h 10.79.0.2 -p 6399 -t get -c 50 $args -q > "$out/rb" 2>&1
  b1=$(busy)
  rate=$(tr '\r' '\n' < "$out/rb" | grep -o 'GET: [0-9.]* requests' | tail -1 | awk '{print $2}')
  awk -F, -v n="$n" -v a="$args" -v r="$rate" -v cpu=$((b1 - b0)) -v hz="$hz" \
    '/context-switches/{c=$1} /sys_enter/{s=$1} END {printf "%s redis GET %-17s %9.0f req/s  CPU %.2f us/req  syscalls %.2f/req  context switches %.2f/req\n", ENVIRON["mode"], a, r, cpu/hz*1e6/n, s/n, c/n}' "$out/ps.csv"
done
pkill -f "redis-server 10.79.0.2" || true
ip netns exec $b "${E[@]}" iperf3 -s -1 -B 10.79.0.2 -p 5301 >/dev/null 2>&1 &
sleep 0.5
b0=$(busy)
perf stat -a -x, -e context-switches,raw_syscalls:sys_enter -o "$out/ps.csv" -- \
  ip netns exec $a "${E[@]}" iperf3 -c 10.79.0.2 -p 5301 -t 4 -f g > "$out/ip" 2>&1
b1=$(busy)
g=$(grep receiver "$out/ip" | awk '{print $(NF-2)}')
awk -F, -v g="$g" -v cpu=$((b1 - b0)) -v hz="$hz" \
  '/context-switches/{c=$1} /sys_enter/{s=$1} END {gb=g*4/8; printf "%s iperf3 %.1f Gbit/s  CPU %.3f s/GB  syscalls %.0f/GB  context switches %.0f/GB\n", ENVIRON["mode"], g, cpu/hz/gb, s/gb, c/gb}' "$out/ps.csv"
wait
rm -rf "$out"
