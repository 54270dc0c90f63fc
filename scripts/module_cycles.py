#!/usr/bin/env python3
"""Import cycles between a crate's top-level modules (issue 25: dependencies point down).

usage: module_cycles.py CRATE_SRC [--enforce]
Reads every .rs file under CRATE_SRC (tests after #[cfg(test)] left out), collects the
`crate::module` paths each top-level module uses in code (comments, test modules left out; also inside `use crate::{a, b::c}` groups),
and prints the strongly connected components of more than one module. A `crate::Name` that
lib.rs re-exports (`pub use module::{Name, ..}`, `pub use module::*`) counts as a use of the
module it comes from. With --enforce, exits 1 when there is one.
"""
import os
import re
import sys


IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip_comments(txt):
    """Source without // comments (doc comments name paths that are not imports)."""
    return re.sub(r"//[^\n]*", "", txt)


def pub_items(root, mod):
    """Names a top-level module declares pub (for glob re-exports)."""
    names = set()
    for p in (os.path.join(root, mod + ".rs"), os.path.join(root, mod, "mod.rs")):
        if os.path.exists(p):
            txt = strip_comments(open(p).read())
            names |= set(re.findall(
                r"pub\s+(?:unsafe\s+)?(?:struct|enum|fn|type|trait|const|static|mod|union)\s+(" + IDENT + ")", txt))
    return names


def reexports(root):
    """Name -> top-level module, for the items lib.rs (or main.rs) re-exports from a module."""
    out = {}
    for f in ("lib.rs", "main.rs"):
        p = os.path.join(root, f)
        if not os.path.exists(p):
            continue
        txt = strip_comments(open(p).read())
        for vis, body in re.findall(r"pub(\([a-z]+\))?\s+use\s+([^;]+);", txt):
            body = re.sub(r"\s*([:,{}])\s*", r"\1", re.sub(r"\s+", " ", body).strip())
            body = body.removeprefix("crate::").removeprefix("self::")
            m = re.match(r"(" + IDENT + r")::(.*)$", body)
            if not m:
                continue
            mod, rest = m.groups()
            if rest == "*":
                for name in pub_items(root, mod):
                    out.setdefault(name, mod)
                continue
            rest = rest.strip("{}")
            for item in rest.split(","):
                if not item:
                    continue
                alias = re.search(r" as (" + IDENT + r")$", item)
                name = alias.group(1) if alias else item.split("::")[-1].strip()
                out[name] = mod
    return out


def graph(root):
    exported = reexports(root)
    mods = {}
    for dp, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".rs") or f == "tests.rs" or "/tests" in dp.removeprefix(root):
                continue  # test modules may reach anywhere
            p = os.path.join(dp, f)
            top = os.path.relpath(p, root).split("/")[0].removesuffix(".rs")
            if top in ("lib", "main", "bin"):
                continue
            txt = strip_comments(re.split(r"#\[cfg\(test\)\]", open(p).read())[0])
            refs = set(re.findall(r"crate::(" + IDENT + ")", txt))
            for grp in re.findall(r"crate::\{([^}]*)\}", txt):
                refs |= set(re.findall(r"(?:^|[,\s{])(" + IDENT + r")(?=::|\s*,|\s*$|\s*\})", grp))
            refs = {exported.get(r, r) if r not in mods_of(root) else r for r in refs}
            mods.setdefault(top, set()).update(refs - {top})
    return {m: {r for r in rs if r in mods} for m, rs in mods.items()}


def mods_of(root):
    """The crate's top-level module names."""
    return {e.removesuffix(".rs") for e in os.listdir(root) if e.endswith(".rs") or os.path.isdir(os.path.join(root, e))}


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


def self_test():
    """A re-export cycle, a doc-comment path and a test module: only the first is a cycle."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        files = {
            "lib.rs": "mod a;\nmod b;\nmod c;\npub use a::{Alpha, helper as renamed, base};\npub use c::*;\n",
            "a.rs": "use crate::b::Beta;\npub struct Alpha;\n",
            "b.rs": "pub struct Beta(crate::Alpha);\n/// [`crate::Gamma`]\nfn f() {}\n",
            "c.rs": "pub struct Gamma;\n#[cfg(test)]\nmod t { use crate::renamed; }\n",
            "c/tests.rs": "use crate::Alpha;\n",
        }
        for name, body in files.items():
            os.makedirs(os.path.dirname(os.path.join(d, name)), exist_ok=True)
            open(os.path.join(d, name), "w").write(body)
        edges = graph(d)
        assert edges["a"] == {"b"} and edges["b"] == {"a"}, edges
        assert edges["c"] == set(), edges
        assert cycles(edges) == [["a", "b"]], cycles(edges)
        ex = reexports(d)
        assert ex["renamed"] == "a" and ex["base"] == "a" and ex["Gamma"] == "c", ex
    print("module_cycles: self-test passed")


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        self_test()
        sys.exit(0)
    src = sys.argv[1]
    found = cycles(graph(src))
    for c in found:
        print(f"{src}: import cycle between modules: {' '.join(c)}")
    if not found:
        print(f"{src}: no import cycles between modules")
    sys.exit(1 if found and "--enforce" in sys.argv else 0)
