#!/usr/bin/env python3
"""Import cycles between a crate's top-level modules (issue 25: dependencies point down).

usage: module_cycles.py CRATE_SRC [--enforce]
Reads every .rs file under CRATE_SRC (tests after #[cfg(test)] left out), collects the
`crate::module` paths each top-level module uses (also inside `use crate::{a, b::c}` groups),
and prints the strongly connected components of more than one module. With --enforce, exits 1
when there is one.
"""
import os
import re
import sys


def graph(root):
    mods = {}
    for dp, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".rs"):
                continue
            p = os.path.join(dp, f)
            top = os.path.relpath(p, root).split("/")[0].removesuffix(".rs")
            if top in ("lib", "main", "bin"):
                continue
            txt = re.split(r"#\[cfg\(test\)\]", open(p).read())[0]
            refs = set(re.findall(r"crate::([a-z_][a-z0-9_]*)", txt))
            for grp in re.findall(r"crate::\{([^}]*)\}", txt):
                refs |= set(re.findall(r"(?:^|[,\s{])([a-z_][a-z0-9_]*)(?=::|\s*,|\s*$|\s*\})", grp))
            mods.setdefault(top, set()).update(refs - {top})
    return {m: {r for r in rs if r in mods} for m, rs in mods.items()}


def cycles(edges):
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


if __name__ == "__main__":
    src = sys.argv[1]
    found = cycles(graph(src))
    for c in found:
        print(f"{src}: import cycle between modules: {' '.join(c)}")
    if not found:
        print(f"{src}: no import cycles between modules")
    sys.exit(1 if found and "--enforce" in sys.argv else 0)
