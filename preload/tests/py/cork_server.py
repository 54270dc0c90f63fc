# An event loop that answers and then stays away: after each reply it sleeps (a call the shim
# does not see) before its next epoll_wait. What it wrote while corked must still leave.
#   cork_server.py ADDR PORT SLEEP_S ROUNDS
import select, socket, sys, time

addr, port, pause, rounds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind((addr, port))
ls.listen(8)
print("READY", flush=True)
c, _ = ls.accept()
c.setblocking(False)
ep = select.epoll()
ep.register(c.fileno(), select.EPOLLIN)
answered = 0
while answered < rounds:
    for fd, ev in ep.poll():
        d = c.recv(4096)
        if not d:
            sys.exit("EOF before the last round")
        c.send(b"re:" + d)
        answered += 1
        time.sleep(pause)
c.close()
print(f"ANSWERED {answered}", flush=True)
