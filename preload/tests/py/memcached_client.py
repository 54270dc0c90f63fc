# A memcached client of the text protocol (preload/tests/distro.rs and hardened.rs), as small
# programs write one. Usage: memcached_client.py HOST PORT N ROUNDS TIMEOUT|none. N connections
# (blocking, or with a socket timeout of TIMEOUT seconds as python-memcached sets one: then
# CPython connects without blocking and polls before every send and receive), each in a
# thread doing ROUNDS `set` of a 1 KiB value then `get` of it, every reply checked and timed;
# then the server's own `stats` (`stats cmd_set=… get_hits=… …`), the slowest reply
# (`slowest S`), `done`, and the connections stay open until a line on stdin (the test
# samples meanwhile).
import socket, sys, threading, time
host, port, n, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
timeout = None if sys.argv[5] == "none" else float(sys.argv[5])
socks, files = [], []
for i in range(n):
    try:
        s = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        sys.exit("ERROR connect %d of %d: %r" % (i + 1, n, e))
    socks.append(s)
    files.append(s.makefile("rb"))
print("connected", n, flush=True)
errors = []
slowest = [0.0]

def expect(f, want, what):
    got = f.readline() if want.endswith(b"\r\n") else f.read(len(want))
    if got != want:
        raise OSError("%s: expected %r, got %r" % (what, want[:60], got[:60]))

def work(i):
    s, f = socks[i], files[i]
    r = 0
    try:
        for r in range(rounds):
            key = b"c%d-r%d" % (i, r)
            val = (b"%04d:%05d;" % (i, r) * 103)[:1024]
            t = time.monotonic()
            s.sendall(b"set %s 0 0 %d\r\n%s\r\n" % (key, len(val), val))
            expect(f, b"STORED\r\n", "set " + key.decode())
            t2 = time.monotonic()
            s.sendall(b"get %s\r\n" % key)
            expect(f, b"VALUE %s 0 %d\r\n" % (key, len(val)), "get " + key.decode())
            expect(f, val + b"\r\n", "value of " + key.decode())
            expect(f, b"END\r\n", "end of get " + key.decode())
            slowest[0] = max(slowest[0], t2 - t, time.monotonic() - t2)
    except (OSError, ValueError) as e:
        errors.append("connection %d, round %d: %r" % (i + 1, r, e))

threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
for t in threads:
    t.start()
for t in threads:
    t.join()
if errors:
    sys.exit("ERROR %d of %d connections failed; first: %s" % (len(errors), n, errors[0]))
socks[0].sendall(b"stats\r\n")
stats = {}
while True:
    line = files[0].readline()
    if not line or line == b"END\r\n":
        break
    f = line.split()
    if len(f) == 3 and f[0] == b"STAT":
        stats[f[1].decode()] = f[2].decode()
keys = ["cmd_set", "cmd_get", "get_hits", "get_misses", "curr_connections", "total_connections"]
print("stats " + " ".join("%s=%s" % (k, stats.get(k, "?")) for k in keys), flush=True)
print("slowest %.3f" % slowest[0], flush=True)
print("done", n * rounds * 2, "commands", flush=True)
sys.stdin.readline()
for s in socks:
    s.close()
print("closed", flush=True)
