"""Opens two connections (blocking connects) to an iterative server before using either,
then uses them in turn: the second waits in the server's backlog while the first is served.
As over TCP, both connects return at once and both exchanges complete."""
import socket, sys, time

host, port = sys.argv[1], int(sys.argv[2])
t0 = time.monotonic()
a = socket.create_connection((host, port))
b = socket.create_connection((host, port))
took = time.monotonic() - t0
if took > 5:
    print(f"FAIL: two connects took {took:.1f} s", flush=True)
    sys.exit(1)
for name, s in (("a", a), ("b", b)):
    msg = name.encode() * 100_000
    s.sendall(msg)
    s.shutdown(socket.SHUT_WR)
    got = b""
    while True:
        d = s.recv(65536)
        if not d:
            break
        got += d
    if got != msg:
        print(f"FAIL: connection {name} echoed {len(got)} bytes", flush=True)
        sys.exit(1)
    s.close()
print("OK", flush=True)
