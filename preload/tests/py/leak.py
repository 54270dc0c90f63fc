# Descriptor and thread accounting across many SMC-R connections.
#   leak.py server ADDR PORT N   - echo N connections (one at a time), then report
#   leak.py client ADDR PORT N   - N x (connect, echo 16 bytes, close), every other one with a
#                                  timeout (non-blocking connect + poll), then report
# Each side takes its baseline from /proc/self/fd and /proc/self/task once WARM connections
# are done (the engine and the link group exist by then, and connection teardown, which
# finishes in the background, has settled), and exits non-zero if either grew by the end.
# After its report each side waits for its standard input to close: the test closes both once
# both reported, so that neither counts while the other's exit tears their link group down
# (the poller thread then parks as a spare, which is not a leak).
import os, socket, sys, time

WARM = 10

def fds():
    out = {}
    for f in os.listdir("/proc/self/fd"):
        try:
            out[int(f)] = os.readlink(f"/proc/self/fd/{f}")
        except OSError:
            pass
    return out

def threads():
    # Not the library's parked spare threads: a finished handshake worker's thread parks there
    # until the reserve holds its target (rdma/src/thread.rs, never more), so their number
    # depends on when workers finished, not on how many connections came and went.
    out = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                out += f.read().strip() != "smcr-spare"
        except OSError:
            pass
    return out

def counts():
    return len(fds()), threads()

def settle(limit=None, stable=0.3):
    # Waits until the counts stop changing for `stable` seconds (or drop to `limit`), at most
    # 5 s.
    deadline = time.time() + 5
    last, stable_since = counts(), time.time()
    while time.time() < deadline:
        time.sleep(0.05)
        now = counts()
        if limit and now[0] <= limit[0] and now[1] <= limit[1]:
            return now
        if now != last:
            last, stable_since = now, time.time()
        elif time.time() - stable_since > stable and not limit:
            return now
    return counts()

role, addr, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
base, before = None, None

def warmed(i):
    global base, before
    if i == WARM - 1:
        base = settle()
        before = fds()

if role == "server":
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    s.listen(128)
    print("READY", flush=True)
    for i in range(n + WARM):
        c, _ = s.accept()
        while True:
            d = c.recv(4096)
            if not d:
                break
            c.sendall(d)
        c.close()
        warmed(i)
    # Counted with the listener still open, as at the baseline.
else:
    for i in range(n + WARM):
        c = socket.socket()
        if i % 2:
            c.settimeout(5)
        c.connect((addr, port))
        c.sendall(b"0123456789abcdef")
        got = b""
        while len(got) < 16:
            got += c.recv(16)
        assert got == b"0123456789abcdef"
        c.close()
        warmed(i)
end = settle(base)
print(f"{role}: fds {base[0]} -> {end[0]}, threads {base[1]} -> {end[1]}", flush=True)
if end[0] > base[0]:
    now = fds()
    print("new descriptors:", {k: v for k, v in now.items() if before.get(k) != v}, flush=True)
sys.stdin.read()
if role == "server":
    s.close()
sys.exit(0 if end[0] <= base[0] and end[1] <= base[1] else 1)
