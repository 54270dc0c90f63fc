"""Connects, sends N patterned bytes, prints their SHA-256, and ends the process with libc's
exit() at once: the socket is never closed by the program (as a C program that returns from
main with its connections open), and the last bytes are still on their way."""
import ctypes, hashlib, socket, sys

addr, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.create_connection((addr, port))
block = bytes((i * 7 + 3) & 0xFF for i in range(65536))
data = (block * (n // len(block) + 1))[:n]
s.sendall(data)
print("SENT", n, hashlib.sha256(data).hexdigest(), flush=True)
ctypes.CDLL(None).exit(0)
