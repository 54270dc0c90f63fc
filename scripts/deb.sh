#!/usr/bin/env bash
# Builds a Debian package of smcr (issue 26): the files of scripts/install.sh under /usr
# (lib/libsmcr.so, bin/smcr, bin/smc-stat, man pages, completions, docs with the example
# /etc/smcr.toml), stripped, man pages compressed. dpkg then installs and removes it:
#   dpkg -i target/debian/smcr_VERSION_ARCH.deb     then LD_PRELOAD=libsmcr.so PROGRAM
#   dpkg -r smcr                                    also removes the BPF programs (prerm)
# /usr/lib is searched by the loader already: no ld.so.conf entry; postinst and postrm run
# ldconfig. The option program is not installed by the package: `smcr bpf install` (or the
# first `smcr run` as root) does it, as after scripts/install.sh.
#
# usage: bash scripts/deb.sh [--from DIR] [--lib FILE] [--out DIR]
#   --from DIR, --lib FILE   as for scripts/install.sh (default: build them, release)
#   --out DIR                where the .deb goes (default target/debian)
set -euo pipefail
cd "$(dirname "$0")/.."

out=target/debian from=() lib=()
while [ $# -gt 0 ]; do
  case "$1" in
    --from) from=(--from "${2:?--from needs a directory}"); shift 2 ;;
    --lib) lib=(--lib "${2:?--lib needs a file}"); shift 2 ;;
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "deb.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
command -v dpkg-deb >/dev/null || { echo "deb.sh: dpkg-deb not found (Debian's dpkg)" >&2; exit 1; }

version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
arch=$(dpkg --print-architecture)
stage=$(mktemp -d)
chmod 0755 "$stage"
trap 'rm -rf -- "$stage"' EXIT
bash scripts/install.sh --prefix "$stage/usr" --no-ldconfig "${from[@]}" "${lib[@]}" >/dev/null
# install.sh's record of what it put there: dpkg keeps its own.
rm -rf -- "$stage/usr/share/smcr"
strip --strip-unneeded "$stage/usr/lib/libsmcr.so" "$stage/usr/bin/smcr" "$stage/usr/bin/smc-stat"
gzip -9n "$stage"/usr/share/man/man1/*.1

mkdir -p "$stage/DEBIAN"
cat > "$stage/DEBIAN/control" <<EOF
Package: smcr
Version: $version
Architecture: $arch
Maintainer: smcr developers <smcr@localhost>
Section: net
Priority: optional
Depends: libc6 (>= 2.36)
Recommends: redis-tools
Installed-Size: $(du -sk "$stage/usr" | cut -f1)
Description: transparent SMC-R for unmodified TCP programs
 LD_PRELOAD=libsmcr.so turns a program's TCP connections into SMC-R (RFC 7609,
 as Linux speaks it) over a userspace RoCE v2 engine, or shared memory between
 processes of one host, falling back to TCP with a named reason. smcr run is the
 launcher (like smc-tools' smc_run); smc-stat and smcr stats|linkgroup|device
 show connections, link groups and fallbacks. Needs Linux with BPF and cgroup v2;
 root once for the TCP option program (smcr bpf install).
EOF
cat > "$stage/DEBIAN/postinst" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = configure ]; then ldconfig; fi
EOF
# Removing the package removes the BPF programs too (marked sockets carry on as plain TCP).
cat > "$stage/DEBIAN/prerm" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = remove ] && [ -x /usr/bin/smcr ]; then /usr/bin/smcr bpf uninstall >/dev/null 2>&1 || true; fi
EOF
cat > "$stage/DEBIAN/postrm" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = remove ]; then ldconfig; fi
EOF
chmod 0755 "$stage/DEBIAN/postinst" "$stage/DEBIAN/prerm" "$stage/DEBIAN/postrm"
mkdir -p "$out"
deb="$out/smcr_${version}_${arch}.deb"
dpkg-deb --root-owner-group -Zxz --build "$stage" "$deb" >/dev/null
echo "$deb"
