#!/usr/bin/env bash
# Fuzzes every decoder for a fixed time each: CLC, LLC, CDC and RoCE v2 packets, the same-host
# ring over shared memory and the entries a same-host peer puts in it, sock_diag dumps, and
# (stateful) packets into a connected queue pair and LLC messages into a link.
#   bash scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]    (default 60 s, all targets)
# Runs on stable Rust (`cargo fuzz run -s none`), installs cargo-fuzz if missing, seeds the
# corpora from the kernel capture, prints executions per target, and fails on any finding
# (the crashing input is left in fuzz/artifacts/TARGET/).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(clc_message llc_message cdc_message roce_packet shm_ring samehost_entries sock_diag qp_and_link)
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked --version 0.13.2
python3 scripts/fuzz_seeds.py fuzz/corpus >/dev/null
cd fuzz
cargo fuzz build -s none 2>&1 | tail -1
status=0
for t in "${targets[@]}"; do
  log=$(mktemp)
  if cargo fuzz run -s none "$t" -- -max_total_time="$secs" -print_final_stats=1 >"$log" 2>&1; then
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 || true)
    echo "fuzz $t: ok, $execs executions in ${secs}s ($cov)"
  else
    echo "fuzz $t: FINDING — see fuzz/artifacts/$t/"; tail -40 "$log"; status=1
  fi
  rm -f "$log"
done
exit $status
