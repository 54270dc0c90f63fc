#!/usr/bin/env bash
# The bench command (issue 7): real programs over plain TCP and smcr, side by side in one run —
# redis-benchmark (SET/GET, -c 50, -P 1, -P 16, -d 1024), sockperf ping-pong (64 B, 1 KiB;
# p50, p99; 64 B pinned to one core, to two, and beside busy loops), iperf3, connect+echo+close
# per second — on one host, across two network
# namespaces, and with smcr fallback (server shimmed, client plain). Prints the ratios,
# writes target/bench/bench-apps.json and .svg (a chart of the ratios), and fails if an smcr run
# did not really use SMC-R (the server's stats area says).
#
# usage: sudo bash scripts/bench.sh [--quick] [--only smcr-local,fallback,...] [--workloads ...]
#        [--mtu N]   (bench --help lists them)
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" -eq 0 ] || { echo "bench: needs root (network namespaces, the TCP option program)" >&2; exit 1; }
bash scripts/setup.sh >/dev/null
cargo build --release --locked -q -p preload -p smcr-bench --lib --bin bench
exec target/release/bench apps "$@"
