"""Accepts one connection, reads until EOF, prints what it got (length and SHA-256) and how
the stream ended (EOF or the error), then waits for a line on stdin before it exits."""
import hashlib, socket, sys

s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
print("READY", flush=True)
c, _ = s.accept()
h, total, end = hashlib.sha256(), 0, "EOF"
while True:
    try:
        d = c.recv(1 << 20)
    except OSError as e:
        end = f"ERROR {e.errno}"
        break
    if not d:
        break
    h.update(d)
    total += len(d)
print("GOT", total, h.hexdigest(), end, flush=True)
sys.stdin.readline()
