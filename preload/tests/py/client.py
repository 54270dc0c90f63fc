import socket, sys, os, threading
addr = (sys.argv[1], int(sys.argv[2]))
if "--tfo-connect" in sys.argv:
    # TCP_FASTOPEN_CONNECT (30): SMC-R cannot honour it; like Linux's SMC, the shim keeps
    # the socket on TCP.
    c = socket.socket()
    c.setsockopt(socket.IPPROTO_TCP, 30, 1)
    c.connect(addr)
elif "--msg-fastopen" in sys.argv:
    # sendto with MSG_FASTOPEN connects with the first bytes in the SYN.
    c = socket.socket()
    first = b"fastopen"
    c.sendto(first, socket.MSG_FASTOPEN, addr)
    got = b""
    while len(got) < len(first):
        got += c.recv(100)
    assert got == first, got
else:
    c = socket.create_connection(addr)
if "--timeout" in sys.argv:
    # Python then sets O_NONBLOCK and waits in poll() before each recv/send: the readiness
    # of the application-facing socket must be exact.
    c.settimeout(5)
msgs = [b"hello", os.urandom(1 << 20), b"x" * 70000]
for m in msgs:
    # Send while reading the echo: more than both buffers is in flight.
    t = threading.Thread(target=c.sendall, args=(m,))
    t.start()
    got = bytearray()
    while len(got) < len(m):
        d = c.recv(len(m) - len(got))
        assert d, "EOF"
        got += d
    t.join()
    assert bytes(got) == m, "mismatch"
peer = c.getpeername()
c.shutdown(socket.SHUT_WR)
assert c.recv(10) == b""
print("peer", peer, "OK", flush=True)
c.close()
