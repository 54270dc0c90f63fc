# An SMC-R socket across exec, and sendfile() onto it (Python's socket.sendfile is os.sendfile).
import hashlib, os, socket, subprocess, sys, tempfile, threading

c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
fd = c.fileno()

# close-on-exec as the program sets it, while the descriptor itself never crosses exec.
assert not os.get_inheritable(fd)
os.set_inheritable(fd, True)
assert os.get_inheritable(fd), "the program's FD_CLOEXEC view was lost"
child = subprocess.run(
    [sys.executable, "-c",
     "import os, sys\n"
     "try:\n"
     "    os.fstat(int(sys.argv[1])); print('OPEN')\n"
     "except OSError:\n"
     "    print('CLOSED')\n", str(fd)],
    pass_fds=(fd,), capture_output=True, text=True)
assert child.stdout.strip() == "CLOSED", "an SMC-R descriptor leaked into the exec'd image: " + child.stdout
os.set_inheritable(fd, False)
assert not os.get_inheritable(fd)
d = os.dup(fd)  # F_DUPFD_CLOEXEC
assert not os.get_inheritable(d)
os.close(d)
d = os.dup2(fd, 200)  # dup2 clears close-on-exec
assert os.get_inheritable(d), "dup2() clears close-on-exec"
os.close(d)

# sendfile: a 1 MiB file, then a slice by offset and count; the echo comes back intact.
data = os.urandom(1 << 20)
with tempfile.TemporaryFile() as f:
    f.write(data)
    f.flush()
    want = data + data[1000:6000]
    got = bytearray()

    def reader():
        while len(got) < len(want):
            b = c.recv(65536)
            if not b:
                break
            got.extend(b)

    t = threading.Thread(target=reader)
    t.start()
    f.seek(0)
    assert c.sendfile(f) == len(data)
    assert f.tell() == len(data), "the file position must advance by what was sent"
    assert c.sendfile(f, offset=1000, count=5000) == 5000
    t.join()
assert hashlib.sha256(got).digest() == hashlib.sha256(want).digest(), "echo differs"
c.shutdown(socket.SHUT_WR)
assert c.recv(10) == b""
print("OK", flush=True)
