import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
print("READY", flush=True)
for _ in range(int(sys.argv[3]) if len(sys.argv) > 3 else 1):
    c, a = s.accept()
    total = 0
    while True:
        d = c.recv(65536)
        if not d:
            break
        total += len(d)
        c.sendall(d)
    c.close()
print("SERVED", total, flush=True)
