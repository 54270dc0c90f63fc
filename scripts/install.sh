#!/usr/bin/env bash
# Installs smcr under a prefix, or removes it (issue 26):
#   LIBDIR/libsmcr.so          the preload library: LD_PRELOAD=libsmcr.so finds it by name;
#                              LIBDIR is /usr/lib for the default prefix: hardened systemd
#                              units map executable code only from their ExecPaths (Debian's:
#                              /usr/lib and /lib), so a library under /usr/local/lib would be
#                              dropped by the loader there (docs/running.md)
#   PREFIX/bin/smcr            the launcher (`smcr run`), `smcr bpf install|uninstall`
#   PREFIX/bin/smc-stat        connections, link groups, fallbacks
#   PREFIX/share/doc/smcr/     README, running, limitations
#   PREFIX/share/man/man1/     smcr.1, smcr-*.1 and smc-stat.1, and bash, zsh and fish
#                              completions under share/{bash-completion,zsh,fish}: made by
#                              `smcr generate` and `smc-stat --generate`
#   PREFIX/share/smcr/installed  what was installed (uninstall reads it)
# As root, a prefix whose lib directory the loader does not search gets an entry in
# /etc/ld.so.conf.d/smcr.conf; then ldconfig runs. Without root (or with --no-ldconfig), use
# LD_LIBRARY_PATH=PREFIX/lib, or `smcr run`, which finds the library itself.
#
# usage: bash scripts/install.sh [--prefix DIR] [--libdir DIR] [--from DIR] [--lib FILE] [--no-ldconfig]
#        bash scripts/install.sh --uninstall [--prefix DIR] [--keep-bpf] [--no-ldconfig]
#   --prefix DIR   where to install (default /usr/local)
#   --libdir DIR   where the library goes (default /usr/lib with the default prefix, else PREFIX/lib)
#   --from DIR     take `smcr` and `smc-stat` from DIR instead of building (release) them
#   --lib FILE     take the library from FILE (default: DIR/libsmcr_preload.so)
#   --uninstall    remove what the install put there; as root also the TCP option program and
#                  the steering program (`smcr bpf uninstall`) unless --keep-bpf
set -euo pipefail
cd "$(dirname "$0")/.."

prefix=/usr/local libdir= from= lib= ldconfig=1 uninstall=0 keep_bpf=0
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix=${2:?--prefix needs a directory}; shift 2 ;;
    --libdir) libdir=${2:?--libdir needs a directory}; shift 2 ;;
    --from) from=${2:?--from needs a directory}; shift 2 ;;
    --lib) lib=${2:?--lib needs a file}; shift 2 ;;
    --no-ldconfig) ldconfig=0; shift ;;
    --uninstall) uninstall=1; shift ;;
    --keep-bpf) keep_bpf=1; shift ;;
    -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$prefix" in /*) ;; *) prefix="$PWD/$prefix" ;; esac
if [ -z "$libdir" ]; then
  if [ "$prefix" = /usr/local ]; then libdir=/usr/lib; else libdir="$prefix/lib"; fi
fi
case "$libdir" in /*) ;; *) libdir="$PWD/$libdir" ;; esac
manifest="$prefix/share/smcr/installed"
conf=/etc/ld.so.conf.d/smcr.conf
is_root() { [ "$(id -u)" -eq 0 ]; }

if [ "$uninstall" -eq 1 ]; then
  [ -f "$manifest" ] || { echo "install.sh: nothing installed under $prefix ($manifest missing)" >&2; exit 1; }
  if [ "$keep_bpf" -eq 0 ] && is_root && [ -x "$prefix/bin/smcr" ]; then
    # Detaches the option and steering programs (marked sockets carry on as plain TCP).
    "$prefix/bin/smcr" bpf uninstall || echo "install.sh: smcr bpf uninstall failed; going on" >&2
  fi
  dirs=()
  while IFS=' ' read -r kind path; do
    case "$kind" in
      file) rm -f -- "$path" ;;
      dir) dirs+=("$path") ;;
    esac
  done < "$manifest"
  rm -f -- "$manifest"
  # The directories this install created, deepest first, if nothing else lives there now.
  for ((i = ${#dirs[@]} - 1; i >= 0; i--)); do rmdir -- "${dirs[$i]}" 2>/dev/null || true; done
  if [ "$ldconfig" -eq 1 ] && is_root; then ldconfig; fi
  echo "smcr removed from $prefix"
  exit 0
fi

if [ -z "$from" ]; then
  cargo build --release --locked -q -p preload --lib
  cargo build --release --locked -q -p smcr-tools --bin smcr --bin smc-stat
  from="${CARGO_TARGET_DIR:-target}/release"
fi
lib=${lib:-$from/libsmcr_preload.so}
for f in "$lib" "$from/smcr" "$from/smc-stat"; do
  [ -f "$f" ] || { echo "install.sh: $f not found (build first, or give --from/--lib)" >&2; exit 1; }
done
old=()
if [ -f "$manifest" ]; then
  echo "install.sh: smcr is installed under $prefix already: reinstalling over it"
  mapfile -t old < <(sed -n 's/^dir //p' "$manifest")
fi

# Every directory this install creates is recorded (uninstall removes it again if empty).
created=()
mkd() {
  local d=$1 missing=()
  while [ ! -d "$d" ]; do missing=("$d" "${missing[@]}"); d=$(dirname "$d"); done
  for d in "${missing[@]}"; do mkdir -- "$d"; created+=("$d"); done
}
files=()
put() { # MODE SRC DEST
  mkd "$(dirname "$3")"
  install -m "$1" -- "$2" "$3"
  files+=("$3")
}
put 0755 "$lib" "$libdir/libsmcr.so"
put 0755 "$from/smcr" "$prefix/bin/smcr"
put 0755 "$from/smc-stat" "$prefix/bin/smc-stat"
for d in README.md docs/running.md docs/limitations.md docs/smcr.toml.example; do
  put 0644 "$d" "$prefix/share/doc/smcr/$(basename "$d")"
done
# The man pages and shell completions, from the installed smcr's own command definition.
gen=$(mktemp -d)
trap 'rm -rf -- "$gen"' EXIT
"$prefix/bin/smcr" generate man "$gen/man" >/dev/null
for m in "$gen"/man/*.1; do put 0644 "$m" "$prefix/share/man/man1/$(basename "$m")"; done
for sh in bash zsh fish; do "$prefix/bin/smcr" generate completions "$sh" "$gen/comp" >/dev/null; done
put 0644 "$gen/comp/smcr.bash" "$prefix/share/bash-completion/completions/smcr"
put 0644 "$gen/comp/_smcr" "$prefix/share/zsh/site-functions/_smcr"
put 0644 "$gen/comp/smcr.fish" "$prefix/share/fish/vendor_completions.d/smcr.fish"
"$prefix/bin/smc-stat" --generate "$gen/stat" >/dev/null
put 0644 "$gen/stat/smc-stat.1" "$prefix/share/man/man1/smc-stat.1"
put 0644 "$gen/stat/smc-stat.bash" "$prefix/share/bash-completion/completions/smc-stat"
put 0644 "$gen/stat/_smc-stat" "$prefix/share/zsh/site-functions/_smc-stat"
put 0644 "$gen/stat/smc-stat.fish" "$prefix/share/fish/vendor_completions.d/smc-stat.fish"
mkd "$prefix/share/smcr"

# The loader: LD_PRELOAD=libsmcr.so (a bare name) is searched like dlopen's: LD_LIBRARY_PATH,
# then ld.so.cache (the directories of /etc/ld.so.conf*), then /lib and /usr/lib.
searched() { cat /etc/ld.so.conf /etc/ld.so.conf.d/*.conf 2>/dev/null | grep -qxF "$libdir"; }
if [ "$ldconfig" -eq 1 ] && is_root; then
  if ! searched && [ "$libdir" != /lib ] && [ "$libdir" != /usr/lib ]; then
    echo "$libdir" > "$conf"
    files+=("$conf")
  fi
  ldconfig
fi

{
  for d in "${old[@]}" "${created[@]}"; do echo "dir $d"; done
  for f in "${files[@]}"; do echo "file $f"; done
} | awk '!seen[$0]++' > "$manifest"

echo "smcr installed under $prefix:"
printf '  %s\n' "${files[@]}"
if [ "$ldconfig" -eq 1 ] && is_root; then
  echo "LD_PRELOAD=libsmcr.so finds the library by name (ld.so.cache)."
else
  echo "LD_PRELOAD=libsmcr.so needs LD_LIBRARY_PATH=$libdir (not root, or --no-ldconfig);"
  echo "\`$prefix/bin/smcr run -- PROGRAM\` finds the library itself."
fi
echo "Remove with: bash scripts/install.sh --uninstall --prefix $prefix"
