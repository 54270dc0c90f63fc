import socket, sys, os, errno
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
c.sendall(b"before fork")
assert c.recv(100) == b"before fork"
# Child 1 only closes the inherited socket (like redis's BGSAVE child): the parent's
# connection must not notice.
pid = os.fork()
if pid == 0:
    c.close()
    os._exit(0)
assert os.waitpid(pid, 0)[1] == 0
# Child 2 uses it: a clear error, never silent loss.
pid = os.fork()
if pid == 0:
    try:
        c.send(b"from the child")
        os._exit(1)
    except OSError as e:
        os._exit(0 if e.errno == errno.EIO else 2)
assert os.waitpid(pid, 0)[1] == 0, "child did not get EIO"
c.sendall(b"after fork")
got = b""
while len(got) < 10:
    got += c.recv(100)
assert got == b"after fork", got
c.shutdown(socket.SHUT_WR)
assert c.recv(10) == b""
print("OK", flush=True)
