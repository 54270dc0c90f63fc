#!/usr/bin/env bash
# Installs what the tests need on a fresh Debian 12 machine (idempotent). Needs root for apt;
# without root it only reports what is missing.
set -euo pipefail
# nginx, wrk, postgresql, util-linux (setpriv, prlimit, nsenter, runuser), gunicorn, memcached,
# nodejs and openjdk-17-jdk-headless (javac, java; both are on this project's machines already:
# listed so that a plain Debian 12 gets them too): preload/tests/distro.rs.
# python3-seccomp (libseccomp for Debian's /usr/bin/python3), systemd (systemd-analyze: the
# syscall groups as this systemd defines them) and haproxy: scripts/unit-sandbox.py,
# preload/tests/hardened.rs (services under their Debian units' settings) and
# preload/tests/lockdown.rs; systemd's systemd-socket-activate, nodejs and wrk:
# preload/tests/handover.rs.
packages=(tshark tcpdump libibverbs-dev iproute2 nftables ethtool python3 gcc g++ binutils redis-server redis-tools iperf3 sockperf curl nginx wrk postgresql util-linux gunicorn memcached nodejs openjdk-17-jdk-headless python3-seccomp systemd haproxy)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all test dependencies present (${packages[*]})"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "setup: missing ${missing[*]}; run as root: apt-get install -y ${missing[*]}" >&2
  exit 0
fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# tshark asks whether non-root users may capture; the non-interactive default (no) is right here.
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup: done"
