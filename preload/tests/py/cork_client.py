# Asks ROUNDS times, GAP_S apart (the server is back in its loop by then), and prints the
# longest wait for an answer.
#   cork_client.py ADDR PORT ROUNDS GAP_S
import socket, sys, time

addr, port, rounds, gap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
s = socket.create_connection((addr, port))
longest = 0.0
for i in range(rounds):
    if i:
        time.sleep(gap)
    msg = f"q{i}".encode()
    t = time.monotonic()
    s.sendall(msg)
    got = b""
    while len(got) < len(msg) + 3:
        d = s.recv(4096)
        if not d:
            sys.exit("EOF")
        got += d
    assert got == b"re:" + msg, got
    w = time.monotonic() - t
    print(f"WAIT {i} {w:.6f}", file=sys.stderr, flush=True)
    longest = max(longest, w)
print(f"LONGEST {longest:.6f}", flush=True)
