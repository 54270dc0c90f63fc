#!/usr/bin/env bash
# The main job for now: SmcStream over SMC-R between two network namespaces — capability by the
# TCP option (eBPF), CLC handshake over TCP, one link group on our RoCE v2 engine, 1 GiB with a
# CRC check, an echo and 10 000 ping-pongs. Needs root; without it, runs the two-process RDMA
# demo. (Becomes redis-server under LD_PRELOAD=libsmcr.so once the shim exists, issue 5.)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -eq 0 ]; then
  cargo run --release --locked -q -p examples --bin smc-demo -- two-ns "${1:-1073741824}"
else
  echo "demo: not root, so no namespaces or BPF: running the RDMA engine demo instead" >&2
  cargo run --release --locked -q -p examples --bin rdma-demo -- "${1:-1073741824}"
fi
