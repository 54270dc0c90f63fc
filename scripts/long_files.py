#!/usr/bin/env python3
"""Source files longer than a room should be (issue 40: none over 800 lines outside tests).

usage: long_files.py [--max N (800)] [--enforce] [ROOT (.)]
Counts each .rs file's lines up to its first `#[cfg(test)]` (a test module at the end does
not count), leaving out tests/ directories, files named tests.rs, fuzz/ and target/. Prints
the files over the limit; with --enforce, exits 1 when there is one.
"""
import os
import sys


def code_lines(path):
    n = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("#[cfg(test)]"):
                break
            n += 1
    return n


def long_files(root, limit):
    out = []
    for dp, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("target", "tests", "fuzz", ".git")]
        for f in files:
            if f.endswith(".rs") and f != "tests.rs":
                p = os.path.join(dp, f)
                n = code_lines(p)
                if n > limit:
                    out.append((n, os.path.relpath(p, root)))
    return sorted(out, reverse=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    limit = 800
    if "--max" in args:
        limit = int(args[args.index("--max") + 1])
        del args[args.index("--max") : args.index("--max") + 2]
    enforce = "--enforce" in args
    roots = [a for a in args if not a.startswith("--")] or ["."]
    found = [x for r in roots for x in long_files(r, limit)]
    for n, p in found:
        print(f"{p}: {n} lines outside tests (more than {limit})")
    if not found:
        print(f"no source file over {limit} lines outside tests")
    sys.exit(1 if found and enforce else 0)
