#!/usr/bin/env python3
"""The workspace's crates and the directions their dependencies may take (issue 40).

usage: crate_deps.py [--enforce] | --self-test

Checks, from `cargo metadata` and `cargo tree`:
* every workspace crate is in ALLOWED, and each of its dependencies on another workspace
  crate (normal or dev) is one ALLOWED names: dependencies point down the layers, so there is
  no cycle between crates;
* `libsmcr_preload.so` (package preload) links none of the command-line tools' crates
  (TOOLS_ONLY) in its normal dependency tree;
* the protocol crate is pure: `#![forbid(unsafe_code)]`, and outside its test modules no
  threads, clocks, files or sockets of its own (PURE_FORBIDDEN).
Prints what it finds; with --enforce, exits 1 on any breach.
"""
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Layers, bottom up: codecs and the engine; the protocol; the system parts (kernel programs,
# stats area); the runtime and socket API; its front ends and the demos; the bench harness.
ALLOWED = {
    "clc": set(),
    "cdc": set(),
    "llc": {"clc"},
    "rdma": set(),
    "smcr-proto": {"clc", "llc", "cdc"},
    "smcr-bpf": {"rdma"},
    "smcr-stats": {"clc", "rdma", "smcr-proto"},
    "smcr": {"clc", "llc", "cdc", "rdma", "smcr-proto", "smcr-bpf", "smcr-stats"},
    "preload": {"smcr", "smcr-tools"},  # smcr-tools: dev (tests read smc-stat's output)
    "smcr-tools": {"smcr", "clc", "rdma", "smcr-stats", "smcr-bpf"},
    "examples": {"smcr", "rdma"},
    "smcr-bench": {"smcr", "smcr-tools", "examples", "rdma", "clc", "llc", "cdc"},
}

# Only the command-line tools may pull these (argument parsing, JSON, editing TOML in place).
TOOLS_ONLY = {"clap", "clap_complete", "clap_mangen", "serde_json", "toml_edit"}

# The protocol's code outside tests: no threads, no clock reads, no files, no sockets.
PURE_CRATE = "proto"
PURE_FORBIDDEN = [
    r"\bstd::thread\b",
    r"\bthread::spawn\b",
    r"\bInstant::now\b",
    r"\bSystemTime::now\b",
    r"\bstd::fs\b",
    r"\bstd::net::(TcpStream|TcpListener|UdpSocket)\b",
    r"\bstd::process\b",
    r"\bunsafe\b",
]


def cargo(*args):
    return subprocess.run(
        ["cargo", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def check_edges(meta):
    """Workspace-internal dependencies against ALLOWED."""
    bad = []
    names = {p["name"] for p in meta["packages"]}
    for p in meta["packages"]:
        if p["name"] not in ALLOWED:
            bad.append(f"{p['name']}: not in ALLOWED; say which layer it is in")
            continue
        for d in p["dependencies"]:
            if d["name"] in names and d["name"] not in ALLOWED[p["name"]]:
                kind = d["kind"] or "normal"
                bad.append(f"{p['name']} -> {d['name']} ({kind}): not allowed")
    return bad


def cycles(edges):
    """Cycles in a graph {node: set(nodes)} (ALLOWED must be acyclic itself)."""
    seen, on, found = set(), [], []

    def visit(n):
        if n in on:
            found.append(on[on.index(n):] + [n])
            return
        if n in seen:
            return
        seen.add(n)
        on.append(n)
        for m in sorted(edges.get(n, ())):
            visit(m)
        on.pop()

    for n in sorted(edges):
        visit(n)
    return found


def check_preload_tree():
    out = cargo("tree", "-p", "preload", "-e", "normal", "--prefix", "none", "--locked")
    pulled = {line.split()[0] for line in out.splitlines() if line.strip()}
    return [f"preload links {c} (only the tools may)" for c in sorted(pulled & TOOLS_ONLY)]


def without_tests(txt):
    """Source up to a trailing `#[cfg(test)] mod tests`, with // comments removed."""
    m = re.search(r"#\[cfg\(test\)\]\s*mod\s+tests\b", txt)
    if m:
        txt = txt[: m.start()]
    return re.sub(r"//[^\n]*", "", txt)


def check_pure(src=None):
    bad = []
    src = src or os.path.join(ROOT, PURE_CRATE, "src")
    lib = open(os.path.join(src, "lib.rs")).read()
    if "#![forbid(unsafe_code)]" not in lib:
        bad.append(f"{PURE_CRATE}/src/lib.rs: no #![forbid(unsafe_code)]")
    for d, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs") or f == "tests.rs":
                continue
            p = os.path.join(d, f)
            txt = without_tests(open(p).read())
            for pat in PURE_FORBIDDEN:
                for m in re.finditer(pat, txt):
                    line = txt[: m.start()].count("\n") + 1
                    bad.append(f"{os.path.relpath(p, ROOT)}:{line}: {m.group(0)} in the protocol")
    return bad


def self_test():
    """Each check finds what it is for, on made-up input."""
    import tempfile

    meta = {"packages": [
        {"name": "smcr-proto", "dependencies": [{"name": "rdma", "kind": None}]},
        {"name": "rdma", "dependencies": []},
        {"name": "newcomer", "dependencies": []},
    ]}
    bad = check_edges(meta)
    assert any("smcr-proto -> rdma" in b for b in bad), bad
    assert any("newcomer: not in ALLOWED" in b for b in bad), bad
    assert cycles({"a": {"b"}, "b": {"a"}}) and not cycles(ALLOWED)
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "lib.rs"), "w").write(
            "#![forbid(unsafe_code)]\n// std::thread in a comment is fine\n"
            "fn f() { std::thread::sleep(x); }\n#[cfg(test)]\nmod tests { fn g() { Instant::now(); } }\n")
        bad = check_pure(d)
        assert len(bad) == 1 and "std::thread" in bad[0] and "lib.rs:3" in bad[0], bad
        open(os.path.join(d, "lib.rs"), "w").write("fn f() {}\n")
        assert any("forbid(unsafe_code)" in b for b in check_pure(d))
    print("crate_deps: self-test passed")
    return 0


def main():
    if "--self-test" in sys.argv[1:]:
        return self_test()
    enforce = "--enforce" in sys.argv[1:]
    meta = json.loads(cargo("metadata", "--format-version", "1", "--no-deps", "--locked"))
    bad = check_edges(meta)
    for c in cycles(ALLOWED):
        bad.append("ALLOWED has a cycle: " + " -> ".join(c))
    bad += check_preload_tree()
    bad += check_pure()
    for b in bad:
        print("crate_deps:", b)
    if not bad:
        n = len(meta["packages"])
        print(f"crate_deps: {n} crates, dependencies point down; preload links no tool crate; "
              f"{PURE_CRATE} is pure")
    return 1 if bad and enforce else 0


if __name__ == "__main__":
    sys.exit(main())
