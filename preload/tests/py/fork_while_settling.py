"""A server that starts using an accepted connection (select: its negotiation begins on a
worker of this process) and forks at once; the child, which has no such worker, uses the
connection. It must not hang: it echoes (the parent settled it as TCP, the connection being
shared) or gets EIO (the parent runs it over SMC-R), and says which."""
import errno, os, select, socket, sys

ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind((sys.argv[1], int(sys.argv[2])))
ls.listen()
print("READY", flush=True)
c, _ = ls.accept()
select.select([c], [], [], 0)
pid = os.fork()
if pid == 0:
    try:
        d = c.recv(100)
        c.sendall(d)
        print("CHILD ECHO", flush=True)
    except OSError as e:
        print("CHILD", errno.errorcode.get(e.errno, e.errno), flush=True)
    os._exit(0)
c.close()
os.waitpid(pid, 0)
print("SERVED", flush=True)
