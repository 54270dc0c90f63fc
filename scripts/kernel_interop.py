#!/usr/bin/env python3
"""Our side of the kernel interop suite (scripts/kernel-interop.sh), and its capture checks.

  kernel_interop.py client ADDR PORT   scenario against the kernel's `smcbench server`
  kernel_interop.py server ADDR PORT   a server speaking smcbench's protocol, for its clients
  kernel_interop.py echo ADDR PORT N   one echo of N bytes (the decline checks)
  kernel_interop.py wire CAPTURE.pcap  what went over the wire, as KEY=COUNT lines

smcbench's protocol: a 16-byte header (magic 'KPB1', mode 'E' echo or 'S' sink, message size,
flags), then echo: messages of SIZE bytes, each sent back once complete; sink: bytes until
EOF, answered with their count (8 bytes, little-endian).

The client prints `STEP <name> OK|FAIL <detail>` per step; between steps it asks the
orchestrator for things only it can do (in the guest) with `ASK <what>` and waits for a line
on stdin. Run under `smcr run` (LD_PRELOAD): the sockets are plain Python sockets.
"""
import os
import socket
import struct
import subprocess
import sys
import threading
import time

MAGIC = 0x4B504231


def pattern(seed, n):
    b = bytes(((seed * 131 + i * 7) ^ (i >> 8)) & 0xFF for i in range(256))
    return (b * (n // 256 + 1))[:n]


def readn(s, n):
    buf = bytearray()
    while len(buf) < n:
        x = s.recv(n - len(buf))
        if not x:
            return None
        buf += x
    return bytes(buf)


def echo(addr, port, total, size, seed=1):
    """Sends `total` bytes in `size`-byte messages, each checked when it comes back."""
    s = socket.create_connection((addr, port), timeout=60)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(struct.pack("<IIII", MAGIC, ord("E"), size, 0))
    done = 0
    i = 0
    while done < total:
        msg = pattern(seed + i, size)
        s.sendall(msg)
        got = readn(s, size)
        if got != msg:
            s.close()
            raise ValueError(f"echo differs after {done} bytes")
        done += size
        i += 1
    s.close()
    return done


def sink(addr, port, total, chunk=65536):
    s = socket.create_connection((addr, port), timeout=60)
    s.sendall(struct.pack("<IIII", MAGIC, ord("S"), chunk, 0))
    data = pattern(7, chunk)
    sent = 0
    t0 = time.time()
    while sent < total:
        s.sendall(data)
        sent += len(data)
    s.shutdown(socket.SHUT_WR)
    got = readn(s, 8)
    dt = time.time() - t0
    s.close()
    acked = struct.unpack("<Q", got)[0] if got else -1
    return sent, acked, dt


def smc_stat(*args):
    exe = os.environ.get("SMC_STAT")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    r = subprocess.run([exe, "--pid", str(os.getpid()), *args], env=env,
                       capture_output=True, text=True)
    return r.stdout + r.stderr


def link_groups():
    """Our link groups as smc-stat --links shows them (rows after the header)."""
    out = smc_stat("--links")
    return [ln for ln in out.splitlines()[1:] if ln.strip()]


def active(rows):
    """The rows whose link state column is ACTIVE."""
    return [r for r in rows if "ACTIVE" in r.split()]


def step(name, ok, detail=""):
    ok = bool(ok)
    print(f"STEP {name} {'OK' if ok else 'FAIL'} {detail}".rstrip(), flush=True)
    return ok


def ask(what):
    print(f"ASK {what}", flush=True)
    line = sys.stdin.readline()
    return line.strip()


def run_step(name, f):
    try:
        ok, detail = f()
    except Exception as e:  # a failed step must not stop the others
        ok, detail = False, f"{type(e).__name__}: {e}"
    return step(name, ok, detail)


def wait_for(cond, secs):
    end = time.time() + secs
    while time.time() < end:
        if cond():
            return True
        time.sleep(0.2)
    return cond()


def client(addr, port):
    linger = float(os.environ.get("SMCR_LGR_LINGER", "600"))
    ok = True
    mib = 1 << 20

    ok &= run_step("first-contact-echo-1MiB", lambda: (echo(addr, port, mib, 65536, 1) == mib, ""))
    ok &= run_step("reuse-echo-1MiB", lambda: (echo(addr, port, mib, 65536, 2) == mib, ""))

    def parallel():
        errs = []

        def one(k):
            try:
                echo(addr, port, 256 * 1024, 16384, 10 + k)
            except Exception as e:
                errs.append(f"{k}: {e}")
        ts = [threading.Thread(target=one, args=(k,)) for k in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return not errs, "; ".join(errs)
    ok &= run_step("parallel-8-echo", parallel)

    def bulk():
        sent, acked, dt = sink(addr, port, 16 * mib)
        return sent == acked, f"sent={sent} acked={acked} {sent * 8 / dt / 1e6:.0f} Mbit/s"
    ok &= run_step("bulk-to-kernel-16MiB", bulk)

    def counters():
        # smc-stat --devices: the engine saw the kernel's datagrams (numbered by its IP-ID
        # counter) and dropped none of them for a bad ICRC.
        import json
        doc = json.loads(smc_stat("--json"))
        c = doc["devices"][0]["counters"] if doc.get("devices") else {}
        return (c.get("rx_foreign_ip_id", 0) > 0 and c.get("rx_icrc_errors") == 0
                and c.get("rx_packets", 0) > 0), json.dumps(c)
    ok &= run_step("device-counters", counters)

    # Idle: TEST LINK from both ends (ours after SMCR_TESTLINK_TIME, the kernel's after its
    # smcr_testlink_time), the link staying up.
    time.sleep(float(os.environ.get("IDLE_S", "4")))
    ok &= run_step("idle-link-stays-up", lambda: (
        active(link_groups()), " | ".join(link_groups())))
    # Our linger ends: we delete the group (DELETE LINK to the kernel).
    ok &= run_step("our-delete-link-after-linger", lambda: (
        wait_for(lambda: not link_groups(), linger + 10), " | ".join(link_groups())))
    # The kernel tears its side down (it answers our DELETE LINK and retransmits its answer
    # until its retries run out); a connection meanwhile is declined (ERR_REGBUF).
    reply = ask("kernel-lgr-gone")
    ok &= step("kernel-group-gone-after-our-delete", reply == "GO", reply)
    ok &= run_step("new-group-after-our-delete", lambda: (
        echo(addr, port, 256 * 1024, 65536, 3) == 256 * 1024, ""))
    # The kernel deletes the group (smc module reloaded: DELETE LINK from its side).
    reply = ask("kernel-delete-link")
    ok &= step("kernel-delete-link-done", reply == "GO", reply)
    ok &= run_step("group-gone-after-kernel-delete", lambda: (
        wait_for(lambda: not active(link_groups()), 15),
        " | ".join(link_groups())))
    ok &= run_step("new-group-after-kernel-delete", lambda: (
        echo(addr, port, 256 * 1024, 65536, 4) == 256 * 1024, ""))
    print(smc_stat("--fallback"), flush=True)
    print("DONE", flush=True)
    return 0 if ok else 1


class Echo:
    """An open echo connection: each exchange sends a patterned message and checks it back."""

    def __init__(self, addr, port, size):
        self.s = socket.create_connection((addr, port), timeout=60)
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.s.sendall(struct.pack("<IIII", MAGIC, ord("E"), size, 0))
        self.size, self.i = size, 0

    def run(self, total):
        done = 0
        while done < total:
            msg = pattern(1000 + self.i, self.size)
            self.s.sendall(msg)
            if readn(self.s, self.size) != msg:
                raise ValueError(f"echo differs after {done} bytes")
            done += self.size
            self.i += 1
        return done


def twolinks(addr, port):
    """Two links with the kernel (we list an alternate address), then the first path cut while
    two connections carry data: both go on over the second link, every byte checked."""
    ok = True
    mib = 1 << 20
    a = Echo(addr, port, 65536)
    ok &= run_step("first-contact-echo", lambda: (a.run(mib) == mib, ""))
    reply = ask("two-links")
    ok &= step("kernel-has-two-links", reply == "GO", reply)
    b = Echo(addr, port, 65536)
    ok &= run_step("second-connection-echo", lambda: (b.run(mib) == mib, ""))
    reply = ask("cut-first-path")
    ok &= step("first-path-cut", reply == "GO", reply)
    for name, c in (("a", a), ("b", b)):
        ok &= run_step(f"echo-{name}-after-the-cut", lambda c=c: (c.run(4 * mib) == 4 * mib, ""))
    import json
    doc = json.loads(smc_stat("--json"))
    t = doc["processes"][0]["totals"] if doc.get("processes") else {}
    ok &= step("our-failover-counted", t.get("link_failovers", 0) >= 1, json.dumps(t))
    ok &= step("group-still-active", bool(active(link_groups())), " | ".join(link_groups()))
    a.s.close()
    b.s.close()
    print("DONE", flush=True)
    return 0 if ok else 1


def serve_conn(c, peer):
    c.settimeout(120)
    try:
        h = readn(c, 16)
        if not h:
            return
        magic, mode, size, _ = struct.unpack("<IIII", h)
        if magic != MAGIC:
            print(f"[{peer}] bad header", flush=True)
            return
        if mode == ord("E"):
            n = 0
            while True:
                m = readn(c, size or 1)
                if m is None:
                    break
                c.sendall(m)
                n += 1
            print(f"[{peer}] echo done: {n} messages of {size}", flush=True)
        else:
            total = 0
            while True:
                b = c.recv(1 << 20)
                if not b:
                    break
                total += len(b)
            c.sendall(struct.pack("<Q", total))
            print(f"[{peer}] sink done: {total} bytes", flush=True)
    except Exception as e:
        print(f"[{peer}] error: {type(e).__name__}: {e}", flush=True)
    finally:
        c.close()


def server(addr, port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    s.listen(64)
    print(f"listening on {addr}:{port}", flush=True)
    while True:
        c, pa = s.accept()
        threading.Thread(target=serve_conn, args=(c, f"{pa[0]}:{pa[1]}"), daemon=True).start()


def commands():
    """Serves the orchestrator's questions about this server process on stdin."""
    for line in sys.stdin:
        q = line.strip()
        if q == "groups":
            print("GROUPS " + str(len(active(link_groups()))), flush=True)
        elif q == "stat":
            print(smc_stat("--links") + smc_stat("--fallback"), flush=True)
            print("END", flush=True)
        elif q == "exit":
            os._exit(0)


# ------------------------------------------------------------------ capture checks
LLC = {0x01: "CONFIRM_LINK", 0x02: "ADD_LINK", 0x03: "ADD_LINK_CONT", 0x04: "DELETE_LINK",
       0x06: "CONFIRM_RKEY", 0x08: "CONFIRM_RKEY_CONT", 0x07: "TEST_LINK", 0x09: "DELETE_RKEY"}


def wire(path, ours, kernel):
    """Counts per direction (`ours` = our addresses, comma-separated): option 254 in SYNs, CLC messages and
    decline codes, LLC requests/responses by type, CDCs with peer_conn_closed, RDMA WRITEs."""
    d = open(path, "rb").read()
    le = d[:4] == b"\xd4\xc3\xb2\xa1"
    e = "<" if le else ">"
    link = struct.unpack(e + "I", d[20:24])[0]
    off = 24
    n = {}
    lost_path = False

    def bump(k):
        n[k] = n.get(k, 0) + 1
    while off + 16 <= len(d):
        cl = struct.unpack(e + "I", d[off + 8:off + 12])[0]
        f = d[off + 16:off + 16 + cl]
        off += 16 + cl
        f = f[14:] if link == 1 else f
        if len(f) < 20 or f[0] >> 4 != 4:
            continue
        ihl = (f[0] & 15) * 4
        src = socket.inet_ntoa(f[12:16])
        who = "ours" if src in ours.split(",") else "kernel" if src == kernel else None
        if who is None:
            continue
        p = f[ihl:]
        if f[9] == 6:
            doff = (p[12] >> 4) * 4
            flags = p[13]
            if flags & 0x02:  # SYN: option 254, ExID E2D4 + magic C3D9
                opts = p[20:doff]
                if b"\xfe\x06\xe2\xd4\xc3\xd9" in opts:
                    bump(f"{who}.syn_opt254")
            pl = p[doff:]
            if pl[:4] == b"\xe2\xd4\xc3\xd9" and len(pl) >= 8:
                kind = {1: "proposal", 2: "accept", 3: "confirm", 4: "decline"}.get(pl[4], "?")
                bump(f"{who}.clc_{kind}")
                if kind == "decline" and len(pl) >= 20:
                    bump(f"{who}.decline_{pl[16:20].hex()}")
        elif f[9] == 17 and struct.unpack(">H", p[2:4])[0] == 4791:
            r = p[8:]
            op = r[0]
            if op in (0x04, 0x05):  # SEND_ONLY (+imm): an LLC message or a CDC
                t = r[12]
                if t == 0xFE:
                    bump(f"{who}.cdc")
                    if r[12 + 25] & 0x40:
                        bump(f"{who}.cdc_peer_conn_closed")
                elif (t & 0x1F) in LLC:
                    resp = "resp" if r[12 + 3] & 0x80 else "req"
                    bump(f"{who}.llc_{LLC[t & 0x1F]}_{resp}")
                    if who == "ours" and LLC[t & 0x1F] == "DELETE_LINK" and resp == "req":
                        lost_path = True
            elif op in (0x06, 0x07, 0x08, 0x0A, 0x0B):
                bump(f"{who}.rdma_write")
                if lost_path:  # after our DELETE LINK: which link (our address) they went to
                    bump(f"{who}.rdma_write_after_delete_to_{socket.inet_ntoa(f[16:20])}")
            elif op == 0x11:
                bump(f"{who}.ack")
    for k in sorted(n):
        print(f"{k}={n[k]}")


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "client":
        sys.exit(client(sys.argv[2], int(sys.argv[3])))
    elif cmd == "twolinks":
        sys.exit(twolinks(sys.argv[2], int(sys.argv[3])))
    elif cmd == "server":
        threading.Thread(target=commands, daemon=True).start()
        server(sys.argv[2], int(sys.argv[3]))
    elif cmd == "echo":
        n = int(sys.argv[4])
        got = echo(sys.argv[2], int(sys.argv[3]), n, 65536, 5)
        print(f"ECHO OK {got}" if got == n else "ECHO FAIL", flush=True)
    elif cmd == "wire":
        wire(sys.argv[2], sys.argv[3], sys.argv[4])
