#!/usr/bin/env bash
# The soak command (issue 8): redis-server and its clients (redis-cli, redis-benchmark) under the
# shim, across two network namespaces; a known data set (100 000 keys soak:<i>, values 1..4096
# bytes derived from i and the seed) loaded through the shim; then random faults on the veth
# (nftables: drop, optionally duplication, of RoCE v2 packets or of all) while redis-benchmark
# runs in a loop for N minutes and a verifier reads back samples every 10 s; at the end, with
# the faults removed, every key is read back and compared byte for byte. Prints a summary
# (packets dropped, requests, req/s over time, errors, SMC-R connections and fallbacks) and fails
# on any error, wrong key or connection that did not use SMC-R (setups whose first link did not
# come up under the faults and went on as TCP, TIMEOUT_CL, are counted and allowed: their data
# is checked like the rest).
#
# With --flap the namespaces get a second veth pair, every process an alternate address on
# it (SMCR_ALT_ADDRS), and the first path goes down for 10 s every 30 s: connections move to
# the second link and the groups heal (docs/failover.md).
#
# usage: sudo bash scripts/soak.sh [--minutes N (5)] [--loss PCT (1)] [--dup PCT (0)]
#                                  [--faults roce|all] [--seed N] [--keys N] [--flap]
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" -eq 0 ] || { echo "soak: needs root (network namespaces, nftables, the TCP option program)" >&2; exit 1; }
bash scripts/setup.sh >/dev/null
cargo build --release --locked -q -p preload -p smcr-bench --lib --bin bench
exec target/release/bench soak "$@"
