#!/usr/bin/env bash
# The main job for now: two processes move 1 GiB with RDMA WRITE + SEND over smcr's own RoCE v2
# engine and verify it. (Becomes redis-server under LD_PRELOAD=libsmcr.so once the shim exists.)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo run --release --locked -q -p examples --bin rdma-demo -- "${1:-1073741824}"
