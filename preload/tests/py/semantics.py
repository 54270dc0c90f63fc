"""Linux TCP socket semantics, as an unmodified Python program (standard library only) sees
them: partial reads, MSG_PEEK, MSG_WAITALL, MSG_DONTWAIT and non-blocking sockets,
SO_RCVTIMEO/SO_SNDTIMEO, FIONREAD, EOF and half-close, resets, EPIPE and SIGPIPE, SO_ERROR,
addresses and options, threads sharing a socket, scatter/gather I/O, accept.

Both ends of every connection live in this one process (server on 127.0.0.2, client from
127.0.0.1). The expectations are what Linux TCP gives: run plainly, this script checks them;
run under LD_PRELOAD=libsmcr_preload.so (SMCR_NEGOTIATION=assume), the same script checks that
SMC-R sockets behave the same. No step relies on more buffering than the 16 KiB receive
buffer the shimmed run gets (SMCR_RMB_KIB=16): bigger transfers have a reader thread.

usage: semantics.py GROUP PORT
Prints one line per step and exits 1 at the first failure ("FAIL [group] step: detail"); on
success the last line is "OK semantics GROUP conns=N" (N: connections made).
"""

import array
import ctypes
import errno
import fcntl
import hashlib
import os
import signal
import socket
import struct
import sys
import termios
import threading
import time

HOST = "127.0.0.2"
ARRIVE = 3.0  # something that must happen happens within this (slow, shared machine)

group = "?"
port = 0
steps = 0
conns = 0
listener = None
keep = []  # sockets kept open until the end of the group


def fail(what, detail):
    print(f"FAIL [{group}] {what}: {detail}", flush=True)
    sys.stdout.flush()
    os._exit(1)


def ok(what):
    global steps
    steps += 1
    print(f"ok {steps} [{group}] {what}", flush=True)


def check(cond, what, detail=""):
    if not cond:
        fail(what, detail or "condition false")
    ok(what)


def expect_err(fn, errnos, what):
    """`fn()` must fail with one of `errnos`; returns the exception."""
    try:
        r = fn()
    except OSError as e:
        if e.errno in errnos:
            ok(f"{what} ({errno.errorcode.get(e.errno, e.errno)})")
            return e
        fail(what, f"expected {[errno.errorcode[n] for n in errnos]}, got {e!r}")
    fail(what, f"expected {[errno.errorcode[n] for n in errnos]}, the call returned {r!r}")


def pair():
    """A connected (client, server) pair of blocking sockets."""
    global listener, conns
    if listener is None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((HOST, port))
        listener.listen(16)
    c = socket.socket()
    c.connect((HOST, port))
    s, _ = listener.accept()
    conns += 1
    keep.extend([c, s])
    return c, s


def later(delay, fn, *args):
    """Runs fn(*args) on a thread after `delay` seconds."""

    def run():
        time.sleep(delay)
        fn(*args)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def recv_exact(s, n):
    """Blocking reads until n bytes (or EOF: fails)."""
    got = bytearray()
    while len(got) < n:
        d = s.recv(n - len(got))
        if not d:
            fail("recv_exact", f"EOF after {len(got)} of {n} bytes")
        got += d
    return bytes(got)


def recv_to_eof(s, bufsize=65536):
    got = bytearray()
    while True:
        d = s.recv(bufsize)
        if not d:
            return bytes(got)
        got += d


def fionread(s):
    buf = array.array("i", [0])
    fcntl.ioctl(s.fileno(), termios.FIONREAD, buf, True)
    return buf[0]


def timed(fn):
    t0 = time.monotonic()
    try:
        return fn(), time.monotonic() - t0, None
    except OSError as e:
        return None, time.monotonic() - t0, e


def joined(t, what, timeout=60):
    t.join(timeout)
    if t.is_alive():
        fail(what, f"thread still running after {timeout} s")


class Pattern:
    """A byte stream without short periods: byte i of the stream is R[i % len(R)]."""

    def __init__(self):
        self.r = os.urandom((1 << 20) + 7)
        self.rr = self.r + self.r

    def at(self, off, n):
        out = bytearray()
        while n > 0:
            o = off % len(self.r)
            k = min(n, len(self.r))
            out += self.rr[o:o + k]
            off += k
            n -= k
        return bytes(out)


# --- 1. partial reads --------------------------------------------------------------------------


def g_partial():
    c, s = pair()
    s.sendall(b"0123456789")
    time.sleep(0.2)
    d, dt, e = timed(lambda: c.recv(100))
    check(e is None and d == b"0123456789" and dt < 1.0,
          "recv(100) with 10 bytes there returns those 10 at once", f"{d!r} {e!r} after {dt:.3f}s")
    s.sendall(b"abcdefghij")
    time.sleep(0.2)
    check(c.recv(4) == b"abcd", "recv(4) with 10 bytes there returns 4")
    check(c.recv(100) == b"efghij", "the next recv(100) returns the remaining 6")
    later(0.4, s.sendall, b"late")
    d, dt, e = timed(lambda: c.recv(100))
    check(e is None and d == b"late" and dt >= 0.3,
          "a blocking recv with no data waits for the data", f"{d!r} {e!r} after {dt:.3f}s")
    # A large transfer read in small pieces: every recv returns 1..n bytes, nothing lost.
    p = Pattern()
    want = p.at(0, 300_000)
    t = threading.Thread(target=s.sendall, args=(want,))
    t.start()
    got = bytearray()
    sizes_ok = True
    while len(got) < len(want):
        d = c.recv(7000)
        if not 0 < len(d) <= 7000:
            sizes_ok = False
            break
        got += d
    joined(t, "sender")
    check(sizes_ok and bytes(got) == want, "300 kB read by recv(7000): sizes 1..7000, data intact")


# --- 2. MSG_PEEK -------------------------------------------------------------------------------


def g_peek():
    c, s = pair()
    data = b"peek-a-boo data"
    s.sendall(data)
    time.sleep(0.2)
    check(c.recv(100, socket.MSG_PEEK) == data, "MSG_PEEK returns the data")
    check(c.recv(100, socket.MSG_PEEK) == data, "a second MSG_PEEK returns the same data")
    check(c.recv(4, socket.MSG_PEEK) == data[:4], "MSG_PEEK of 4 returns the first 4 bytes")
    check(c.recv(100) == data, "the following recv returns the same bytes")
    expect_err(lambda: c.recv(100, socket.MSG_PEEK | socket.MSG_DONTWAIT), (errno.EAGAIN,),
               "MSG_PEEK|MSG_DONTWAIT with nothing there fails")
    later(0.4, s.sendall, b"later")
    d, dt, e = timed(lambda: c.recv(100, socket.MSG_PEEK))
    check(e is None and d == b"later" and dt >= 0.3, "a blocking MSG_PEEK waits for data",
          f"{d!r} {e!r} after {dt:.3f}s")
    check(c.recv(100) == b"later", "then recv returns the peeked bytes")
    s.sendall(b"one")
    time.sleep(0.2)
    check(c.recv(100, socket.MSG_PEEK) == b"one", "peek 'one'")
    s.sendall(b"two")
    time.sleep(0.2)
    check(c.recv(100, socket.MSG_PEEK) == b"onetwo", "a later peek sees what arrived meanwhile")
    check(c.recv(100) == b"onetwo", "recv returns both")


# --- 3. MSG_WAITALL ----------------------------------------------------------------------------


def g_waitall():
    c, s = pair()
    pieces = [bytes([65 + i]) * 1000 for i in range(5)]

    def trickle():
        for p in pieces:
            s.sendall(p)
            time.sleep(0.06)

    t = threading.Thread(target=trickle)
    t.start()
    d, dt, e = timed(lambda: c.recv(5000, socket.MSG_WAITALL))
    joined(t, "trickle")
    check(e is None and d == b"".join(pieces) and dt >= 0.2,
          "MSG_WAITALL waits for all 5000 bytes sent in 5 pieces",
          f"{len(d or b'')} bytes, {e!r}, after {dt:.3f}s")
    p = Pattern()
    big = p.at(0, 1 << 20)
    t = threading.Thread(target=s.sendall, args=(big,))
    t.start()
    d = c.recv(1 << 20, socket.MSG_WAITALL)
    joined(t, "sender")
    check(d == big, "MSG_WAITALL of 1 MiB returns exactly 1 MiB, intact", f"{len(d)} bytes")

    def then_eof():
        s.sendall(b"x" * 100)
        time.sleep(0.2)
        s.shutdown(socket.SHUT_WR)

    t = threading.Thread(target=then_eof)
    t.start()
    d, dt, e = timed(lambda: c.recv(1000, socket.MSG_WAITALL))
    joined(t, "then_eof")
    check(e is None and d == b"x" * 100, "MSG_WAITALL returns short at EOF",
          f"{len(d or b'')} bytes, {e!r}")
    check(c.recv(1000, socket.MSG_WAITALL) == b"", "then MSG_WAITALL returns b'' (EOF)")


# --- 4. MSG_DONTWAIT, non-blocking sockets -----------------------------------------------------


def g_dontwait():
    c, s = pair()
    expect_err(lambda: c.recv(100, socket.MSG_DONTWAIT), (errno.EAGAIN,),
               "MSG_DONTWAIT on a blocking socket with no data")
    s.sendall(b"now there is data")
    deadline = time.monotonic() + ARRIVE
    d = None
    while time.monotonic() < deadline:
        try:
            d = c.recv(100, socket.MSG_DONTWAIT)
            break
        except BlockingIOError:
            time.sleep(0.01)
    check(d == b"now there is data", "MSG_DONTWAIT returns data once it is there", repr(d))
    # The socket stayed blocking.
    later(0.4, s.sendall, b"blocking")
    d, dt, e = timed(lambda: c.recv(100))
    check(e is None and d == b"blocking" and dt >= 0.3, "the socket is still blocking",
          f"{d!r} {e!r} after {dt:.3f}s")
    c.setblocking(False)
    expect_err(lambda: c.recv(100), (errno.EAGAIN,), "setblocking(False): recv with no data")
    expect_err(lambda: os.read(c.fileno(), 100), (errno.EAGAIN,),
               "setblocking(False): os.read with no data")
    expect_err(lambda: c.recv_into(bytearray(10)), (errno.EAGAIN,),
               "setblocking(False): recv_into with no data")
    s.sendall(b"nb")
    deadline = time.monotonic() + ARRIVE
    d = None
    while time.monotonic() < deadline:
        try:
            d = c.recv(100)
            break
        except BlockingIOError:
            time.sleep(0.01)
    check(d == b"nb", "non-blocking recv returns data once it is there", repr(d))
    c.setblocking(True)
    later(0.4, s.sendall, b"blocking again")
    d, dt, e = timed(lambda: c.recv(100))
    check(e is None and d == b"blocking again" and dt >= 0.3,
          "setblocking(True): recv blocks again", f"{d!r} {e!r} after {dt:.3f}s")


def g_nonblock_send():
    c, s = pair()
    p = Pattern()
    c.setblocking(False)
    sent = 0
    counts = []
    chunk = 65536
    eagain = 0
    # Until EAGAIN (several times, with pauses: TCP may make room as acknowledgements arrive).
    while eagain < 3:
        try:
            n = c.send(p.at(sent, chunk))
        except BlockingIOError:
            eagain += 1
            time.sleep(0.1)
            continue
        if not 0 < n <= chunk:
            fail("non-blocking send", f"returned {n} for {chunk} bytes")
        counts.append(n)
        sent += n
        if sent > (256 << 20):
            fail("non-blocking send", "never EAGAIN after 256 MiB")
    partial = [n for n in counts if n < chunk]
    ok(f"non-blocking send: {sent} bytes accepted in {len(counts)} calls "
       f"({len(partial)} partial), then EAGAIN")
    # On a full connection each kind of send either fails with EAGAIN or takes part of its
    # buffer (TCP makes room as it frees memory); never more than was offered.
    for name, fn in (("send", lambda b: c.send(b)), ("os.write", lambda b: os.write(c.fileno(), b)),
                     ("sendmsg", lambda b: c.sendmsg([b[:1000], b[1000:]]))):
        try:
            n = fn(p.at(sent, chunk))
        except BlockingIOError:
            ok(f"non-blocking {name} on a full connection: EAGAIN")
            continue
        check(0 < n <= chunk, f"non-blocking {name} on a full connection: {n} of {chunk} bytes",
              str(n))
        sent += n
    c.setblocking(True)
    c.shutdown(socket.SHUT_WR)
    got = recv_to_eof(s)
    check(len(got) == sent, "the peer receives exactly what send accepted",
          f"{len(got)} received, {sent} accepted")
    check(hashlib.sha256(got).digest() == hashlib.sha256(p.at(0, sent)).digest(),
          "the peer receives the accepted bytes in order, none lost or repeated")
    # MSG_DONTWAIT send on a blocking socket, other direction: the peer stops reading.
    s.setblocking(True)
    sent = 0
    while True:
        try:
            n = s.send(p.at(sent, chunk), socket.MSG_DONTWAIT)
        except BlockingIOError:
            break
        sent += n
        if sent > (256 << 20):
            fail("MSG_DONTWAIT send", "never EAGAIN after 256 MiB")
    ok(f"MSG_DONTWAIT send on a blocking socket: {sent} bytes, then EAGAIN")
    s.shutdown(socket.SHUT_WR)
    got = recv_to_eof(c)
    check(len(got) == sent and got == p.at(0, sent),
          "the peer receives exactly what MSG_DONTWAIT sends accepted", f"{len(got)} vs {sent}")


# --- 5. SO_RCVTIMEO / SO_SNDTIMEO --------------------------------------------------------------

TV_200MS = struct.pack("ll", 0, 200000)


def g_rcvtimeo():
    c, s = pair()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, TV_200MS)
    check(c.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16) == TV_200MS,
          "SO_RCVTIMEO reads back as set")
    d, dt, e = timed(lambda: c.recv(100))
    check(isinstance(e, OSError) and e.errno == errno.EAGAIN and 0.15 <= dt <= 2.0,
          "recv with no data fails with EAGAIN after ~200 ms", f"{d!r} {e!r} after {dt:.3f}s")
    d, dt, e = timed(lambda: os.read(c.fileno(), 100))
    check(isinstance(e, OSError) and e.errno == errno.EAGAIN and 0.15 <= dt <= 2.0,
          "os.read with no data fails with EAGAIN after ~200 ms", f"{d!r} {e!r} after {dt:.3f}s")
    later(0.05, s.sendall, b"in time")
    d, dt, e = timed(lambda: c.recv(100))
    check(e is None and d == b"in time", "data within the timeout is returned",
          f"{d!r} {e!r} after {dt:.3f}s")
    s.sendall(b"0123456789")
    time.sleep(0.2)
    d, dt, e = timed(lambda: c.recv(100, socket.MSG_WAITALL))
    check(e is None and d == b"0123456789" and 0.15 <= dt <= 2.0,
          "MSG_WAITALL with a timeout returns the partial data when it expires",
          f"{d!r} {e!r} after {dt:.3f}s")
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
    later(0.4, s.sendall, b"no timeout")
    d, dt, e = timed(lambda: c.recv(100))
    check(e is None and d == b"no timeout" and dt >= 0.3,
          "SO_RCVTIMEO 0 turns the timeout off", f"{d!r} {e!r} after {dt:.3f}s")


def g_sndtimeo():
    c, s = pair()
    p = Pattern()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, TV_200MS)
    check(c.getsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, 16) == TV_200MS,
          "SO_SNDTIMEO reads back as set")
    sent = 0
    chunk = 65536
    partial = 0
    while True:
        n, dt, e = timed(lambda: c.send(p.at(sent, chunk)))
        if e is not None:
            break
        if not 0 < n <= chunk:
            fail("send with SO_SNDTIMEO", f"returned {n}")
        partial += n < chunk
        sent += n
        if sent > (256 << 20):
            fail("send with SO_SNDTIMEO", "never timed out after 256 MiB")
    check(e.errno == errno.EAGAIN and 0.15 <= dt <= 2.0,
          f"send on a full connection ({sent} bytes accepted, {partial} partial) fails with "
          "EAGAIN after ~200 ms", f"{e!r} after {dt:.3f}s")
    d, dt, e = timed(lambda: os.write(c.fileno(), b"more"))
    check(isinstance(e, OSError) and e.errno == errno.EAGAIN and 0.15 <= dt <= 2.0,
          "os.write on a full connection fails with EAGAIN after ~200 ms",
          f"{d!r} {e!r} after {dt:.3f}s")
    c.shutdown(socket.SHUT_WR)
    got = recv_to_eof(s)
    check(len(got) == sent and got == p.at(0, sent), "the peer receives exactly what was accepted",
          f"{len(got)} vs {sent}")


# --- 6. FIONREAD -------------------------------------------------------------------------------


def settle_fionread(sock, want):
    """FIONREAD until it reads `want` and stays there for 100 ms; returns the last value."""
    deadline = time.monotonic() + ARRIVE
    v, since = None, time.monotonic()
    while time.monotonic() < deadline:
        now = fionread(sock)
        if now != v:
            v, since = now, time.monotonic()
        elif v == want and time.monotonic() - since >= 0.1:
            return v
        time.sleep(0.01)
    return v


def g_fionread():
    c, s = pair()
    check(fionread(c) == 0, "FIONREAD is 0 on a fresh connection", str(fionread(c)))
    s.sendall(os.urandom(3000))
    v = settle_fionread(c, 3000)
    check(v == 3000, "FIONREAD reports the 3000 unread bytes", str(v))
    c.recv(1000)
    check(fionread(c) == 2000, "after reading 1000, FIONREAD reports 2000", str(fionread(c)))
    c.recv(100, socket.MSG_PEEK)
    check(fionread(c) == 2000, "MSG_PEEK does not change FIONREAD", str(fionread(c)))
    # (Less than the 16 KiB the shimmed run's receive buffer holds.)
    s.sendall(os.urandom(5000))
    v = settle_fionread(c, 7000)
    check(v == 7000, "FIONREAD counts later arrivals too (7000)", str(v))
    recv_exact(c, 7000)
    check(fionread(c) == 0, "FIONREAD is 0 once everything is read", str(fionread(c)))
    s.shutdown(socket.SHUT_WR)
    check(c.recv(10) == b"", "EOF")
    check(fionread(c) == 0, "FIONREAD is 0 at EOF", str(fionread(c)))


# --- 7. EOF, half-close ------------------------------------------------------------------------


def g_eof():
    c, s = pair()
    s.sendall(b"last words")
    s.shutdown(socket.SHUT_WR)
    check(recv_to_eof(c) == b"last words", "the data before the peer's SHUT_WR, then b''")
    for i in range(3):
        check(c.recv(100) == b"", f"recv after EOF returns b'' again ({i + 1})")
    check(os.read(c.fileno(), 100) == b"", "os.read after EOF returns b''")
    check(c.recv(100, socket.MSG_DONTWAIT) == b"", "MSG_DONTWAIT recv after EOF returns b''")
    check(c.recv(100, socket.MSG_PEEK) == b"", "MSG_PEEK after EOF returns b''")
    c.setblocking(False)
    check(c.recv(100) == b"", "non-blocking recv after EOF returns b''")
    c.setblocking(True)
    check(c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0, "SO_ERROR 0 after EOF")
    reply = b"reply after the peer's EOF" * 1000
    t = threading.Thread(target=c.sendall, args=(reply,), daemon=True)
    t.start()
    check(recv_exact(s, len(reply)) == reply, "half-close: we still send, the peer receives it")
    joined(t, "sender")
    c.shutdown(socket.SHUT_WR)
    check(s.recv(100) == b"", "and our SHUT_WR reaches the peer as EOF")


def g_shut_wr():
    c, s = pair()
    c.shutdown(socket.SHUT_WR)
    check(s.recv(100) == b"", "SHUT_WR: the peer reads EOF")
    expect_err(lambda: c.send(b"x", socket.MSG_NOSIGNAL), (errno.EPIPE,),
               "send after our own SHUT_WR: EPIPE")
    s.sendall(b"still flowing")
    check(recv_exact(c, 13) == b"still flowing", "SHUT_WR: we still receive")


def g_shut_rd():
    c, s = pair()
    # A timeout, so that a recv that would wait fails instead of hanging the script.
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 2, 0))
    c.shutdown(socket.SHUT_RD)
    d, dt, e = timed(lambda: c.recv(100))
    check(e is None and d == b"" and dt < 1.0, "recv after our own SHUT_RD returns b'' at once",
          f"{d!r} {e!r} after {dt:.3f}s")
    c.sendall(b"we still send")
    check(recv_exact(s, 13) == b"we still send", "SHUT_RD: we still send")


def g_shut_rdwr():
    c, s = pair()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 2, 0))
    c.shutdown(socket.SHUT_RDWR)
    check(s.recv(100) == b"", "SHUT_RDWR: the peer reads EOF")
    d, dt, e = timed(lambda: c.recv(100))
    check(e is None and d == b"" and dt < 1.0, "recv after our own SHUT_RDWR returns b'' at once",
          f"{d!r} {e!r} after {dt:.3f}s")
    expect_err(lambda: c.send(b"x", socket.MSG_NOSIGNAL), (errno.EPIPE,),
               "send after our own SHUT_RDWR: EPIPE")


# --- 8. resets, EPIPE, SIGPIPE -----------------------------------------------------------------


def reset_conn(how):
    """A connection whose server end was closed with an RST (`how`: unread data or linger 0);
    returns the client end."""
    c, s = pair()
    if how == "unread":
        c.sendall(b"unread by the peer")
        # Blocks until the bytes are there; leaves them unread.
        check(s.recv(100, socket.MSG_PEEK) == b"unread by the peer", "the peer has unread data")
    else:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    keep.remove(s)
    s.close()
    time.sleep(0.3)
    return c


def g_reset():
    c = reset_conn("unread")
    expect_err(lambda: c.recv(100), (errno.ECONNRESET,),
               "peer closed with unread data: recv raises ConnectionResetError")
    expect_err(lambda: c.send(b"x", socket.MSG_NOSIGNAL), (errno.EPIPE,),
               "send after the reset was reported: EPIPE")


def g_reset_linger():
    c = reset_conn("linger0")
    expect_err(lambda: c.recv(100), (errno.ECONNRESET,),
               "peer closed with SO_LINGER {1, 0}: recv raises ConnectionResetError")
    expect_err(lambda: c.send(b"x", socket.MSG_NOSIGNAL), (errno.EPIPE,),
               "send after the reset was reported: EPIPE")


def g_reset_once():
    # Linux reports a reset once (by recv, send or SO_ERROR): the socket is closed afterwards,
    # reads give EOF, writes EPIPE.
    c = reset_conn("unread")
    expect_err(lambda: c.recv(100), (errno.ECONNRESET,), "reset reported by recv")
    d, _, e = timed(lambda: c.recv(100))
    check(e is None and d == b"", "recv after the reset was reported returns b'' (EOF)",
          f"{d!r} {e!r}")
    c = reset_conn("unread")
    check(c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNRESET,
          "after a reset SO_ERROR is ECONNRESET")
    check(c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0, "then 0 (collected)")
    d, _, e = timed(lambda: c.recv(100))
    check(e is None and d == b"", "a reset collected by SO_ERROR: recv returns b''",
          f"{d!r} {e!r}")


def g_reset_send():
    # The first call after a reset reports it, whichever it is: a send gets ECONNRESET.
    for how, what in (("unread", "with unread data"), ("linger0", "with SO_LINGER {1, 0}")):
        c = reset_conn(how)
        expect_err(lambda: c.send(b"x", socket.MSG_NOSIGNAL), (errno.ECONNRESET,),
                   f"peer closed {what}: the first send raises ConnectionResetError")
        expect_err(lambda: c.send(b"x", socket.MSG_NOSIGNAL), (errno.EPIPE,),
                   "the next send: EPIPE")


def g_epipe():
    c, s = pair()
    keep.remove(s)
    s.close()
    check(c.recv(100) == b"", "the peer closed: EOF")
    # TCP: the first sends may still go out (the peer answers them with a reset); then EPIPE.
    deadline = time.monotonic() + ARRIVE
    err = None
    sends = 0
    while time.monotonic() < deadline:
        try:
            c.send(b"x", socket.MSG_NOSIGNAL)
            sends += 1
            time.sleep(0.05)
        except OSError as e:
            err = e
            break
    check(err is not None and err.errno == errno.EPIPE,
          f"send with MSG_NOSIGNAL after the peer closed: BrokenPipeError ({sends} sends first)",
          repr(err))
    got = []
    old = signal.signal(signal.SIGPIPE, lambda sig, frame: got.append(sig))
    try:
        expect_err(lambda: c.send(b"x"), (errno.EPIPE,), "send without MSG_NOSIGNAL: EPIPE")
        for _ in range(100):
            if got:
                break
            time.sleep(0.01)
        check(got == [signal.SIGPIPE], "and SIGPIPE was raised", repr(got))
        got.clear()
        expect_err(lambda: os.write(c.fileno(), b"x"), (errno.EPIPE,), "os.write: EPIPE")
        for _ in range(100):
            if got:
                break
            time.sleep(0.01)
        check(got == [signal.SIGPIPE], "and SIGPIPE was raised", repr(got))
        got.clear()
        expect_err(lambda: c.sendmsg([b"x"], [], socket.MSG_NOSIGNAL), (errno.EPIPE,),
                   "sendmsg with MSG_NOSIGNAL: EPIPE")
        time.sleep(0.1)
        check(got == [], "and no SIGPIPE", repr(got))
    finally:
        signal.signal(signal.SIGPIPE, old)


# --- 9. SO_ERROR -------------------------------------------------------------------------------


def g_so_error():
    c, s = pair()
    check(c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0, "SO_ERROR 0 (client)")
    check(s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0, "SO_ERROR 0 (server)")
    c.sendall(b"ping")
    check(recv_exact(s, 4) == b"ping", "data")
    s.sendall(b"pong")
    check(recv_exact(c, 4) == b"pong", "data back")
    check(c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0, "SO_ERROR 0 after traffic")
    check(s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0, "SO_ERROR 0 after traffic (server)")
    c.setblocking(False)
    expect_err(lambda: c.recv(10), (errno.EAGAIN,), "EAGAIN")
    check(c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0, "SO_ERROR 0 after an EAGAIN")
    c.setblocking(True)


# --- 10. addresses, options --------------------------------------------------------------------


def g_names():
    c, s = pair()
    cname, cpeer = c.getsockname(), c.getpeername()
    sname, speer = s.getsockname(), s.getpeername()
    check(cpeer == (HOST, port), "client getpeername is the server's address", repr(cpeer))
    check(cname[0] == "127.0.0.1" and cname[1] > 0, "client getsockname is 127.0.0.1:ephemeral",
          repr(cname))
    check(sname == (HOST, port), "server getsockname", repr(sname))
    check(speer == cname, "server getpeername is the client's address", repr(speer))
    c2 = socket.socket()
    c2.connect((HOST, port))
    s2, addr = listener.accept()
    global conns
    conns += 1
    keep.extend([c2, s2])
    check(addr == c2.getsockname(), "accept's address is the client's", f"{addr} {c2.getsockname()}")
    for sock, who in ((c, "client"), (s, "server")):
        g = lambda: sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        check(g() == 0, f"TCP_NODELAY off by default ({who})", str(g()))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        check(g() == 1, f"TCP_NODELAY set reads back 1 ({who})", str(g()))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
        check(g() == 0, f"TCP_NODELAY cleared reads back 0 ({who})", str(g()))
    c.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    check(c.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1, "SO_KEEPALIVE round-trips")
    check(c.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) == socket.SOCK_STREAM, "SO_TYPE")
    check(c.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN) == socket.AF_INET, "SO_DOMAIN")
    check(c.getsockopt(socket.SOL_SOCKET, socket.SO_PROTOCOL) == socket.IPPROTO_TCP,
          "SO_PROTOCOL")
    # socket.socket(fileno=...) works out family, type and protocol from the descriptor.
    d = socket.socket(fileno=os.dup(c.fileno()))
    check((d.family, d.type, d.proto) == (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP),
          "socket(fileno=dup) sees AF_INET/SOCK_STREAM/TCP", repr(d))
    check(d.getpeername() == cpeer, "and the same peer")
    d.sendall(b"via dup")
    check(recv_exact(s, 7) == b"via dup", "data through the duplicate")
    d.close()
    c.sendall(b"after")
    check(recv_exact(s, 5) == b"after", "the original still works after the duplicate closed")


# --- 11. threads -------------------------------------------------------------------------------


def g_threads():
    c1, s1 = pair()
    c2, s2 = pair()
    p = Pattern()
    big = p.at(0, 4 << 20)
    errors = []

    def guard(fn):
        def run():
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                errors.append(f"{fn.__name__}: {e!r}")

        return run

    def echo(s):
        while True:
            d = s.recv(65536)
            if not d:
                s.shutdown(socket.SHUT_WR)
                return
            s.sendall(d)

    def sender():
        at = 0
        while at < len(big):
            at += c1.send(big[at:at + 50000])
        c1.shutdown(socket.SHUT_WR)

    got = bytearray()

    def receiver():
        while True:
            d = c1.recv(65536)
            if not d:
                return
            got.extend(d)

    other = {"rounds": 0}

    def third():
        for i in range(300):
            m = struct.pack("!I", i) * (1 + i % 50)
            c2.sendall(m)
            if recv_exact(c2, len(m)) != m:
                raise AssertionError(f"round {i} mismatch")
            other["rounds"] += 1
        c2.shutdown(socket.SHUT_WR)
        if c2.recv(10) != b"":
            raise AssertionError("no EOF")

    ts = [threading.Thread(target=guard(f), name=n)
          for f, n in ((lambda: echo(s1), "echo1"), (lambda: echo(s2), "echo2"), (sender, "sender"),
                       (receiver, "receiver"), (third, "third"))]
    for t in ts:
        t.start()
    for t in ts:
        joined(t, t.name, 120)
    check(not errors, "no thread failed", "; ".join(errors))
    check(len(got) == len(big), "the receiving thread got all 4 MiB the sending thread sent",
          f"{len(got)} bytes")
    check(hashlib.sha256(got).digest() == hashlib.sha256(big).digest(), "intact")
    check(other["rounds"] == 300, "the third thread's 300 round trips on another socket")


# --- 12. sendmsg/recvmsg, readv/writev ---------------------------------------------------------


def g_vectors():
    c, s = pair()
    n = c.sendmsg([b"abc", b"", b"defgh", b"ij"])
    check(n == 10, "sendmsg of 3+0+5+2 bytes returns 10", str(n))
    b1, b2 = bytearray(4), bytearray(6)
    r = s.recvmsg_into([b1, b2], 0, socket.MSG_WAITALL)
    check(r == (10, [], 0, None), "recvmsg_into([4, 6]) returns (10, [], 0, None)", repr(r))
    check(bytes(b1) == b"abcd" and bytes(b2) == b"efghij", "scattered in order", f"{b1} {b2}")
    c.sendmsg([b"0123", b"456789"])
    time.sleep(0.2)
    b1, b2 = bytearray(3), bytearray(100)
    r = s.recvmsg_into([b1, b2])
    check(r[0] == 10 and bytes(b1) == b"012" and bytes(b2[:7]) == b"3456789",
          "recvmsg_into with more room than data: 3 in the first buffer, 7 in the second",
          f"{r!r} {b1} {b2[:8]}")
    c.sendall(b"hello recvmsg")
    time.sleep(0.2)
    r = s.recvmsg(100)
    check(r == (b"hello recvmsg", [], 0, None), "recvmsg(100)", repr(r))
    n = os.writev(c.fileno(), [b"xy", b"", b"zzzzz"])
    check(n == 7, "os.writev returns 7", str(n))
    time.sleep(0.2)
    b1, b2 = bytearray(2), bytearray(10)
    n = os.readv(s.fileno(), [b1, b2])
    check(n == 7 and bytes(b1) == b"xy" and bytes(b2[:5]) == b"zzzzz", "os.readv scatters 2 + 5",
          f"{n} {b1} {b2}")
    # Both directions, larger than any buffer: blocking writev/sendmsg write everything.
    p = Pattern()
    parts = [p.at(i * 100_000, 100_000) for i in range(3)]
    got = bytearray()

    def drain(k):
        while len(got) < k:
            b = bytearray(65536)
            m = s.recv_into(b)
            got.extend(b[:m])

    t = threading.Thread(target=drain, args=(300_000,), daemon=True)
    t.start()
    n = os.writev(c.fileno(), parts)
    check(n == 300_000, "blocking os.writev of 3 x 100 kB returns 300000 (all written)", str(n))
    joined(t, "drain")
    check(bytes(got) == b"".join(parts), "and the peer got them in order")
    got.clear()
    t = threading.Thread(target=drain, args=(300_000,), daemon=True)
    t.start()
    n = c.sendmsg(parts)
    check(n == 300_000, "blocking sendmsg of 3 x 100 kB returns 300000 (all written)", str(n))
    joined(t, "drain")
    check(bytes(got) == b"".join(parts), "and the peer got them in order")


def g_blocking_send():
    c, s = pair()
    p = Pattern()
    big = p.at(0, 1 << 20)
    got = []

    t = threading.Thread(target=lambda: got.append(recv_to_eof(s)))
    t.start()
    n1 = c.send(big)
    n2 = os.write(c.fileno(), big)
    n3 = c.sendmsg([big])
    c.shutdown(socket.SHUT_WR)
    joined(t, "drain")
    want = big[:n1] + big[:n2] + big[:n3]
    check(got[0] == want, "the peer got exactly what the sends returned",
          f"{len(got[0])} bytes, {len(want)} sent")
    check(n1 == len(big), "a blocking send of 1 MiB returns 1 MiB (Linux sends it all)", str(n1))
    check(n2 == len(big), "a blocking os.write of 1 MiB returns 1 MiB", str(n2))
    check(n3 == len(big), "a blocking sendmsg of 1 MiB returns 1 MiB", str(n3))


# --- 14. accept --------------------------------------------------------------------------------


class Interrupted(Exception):
    pass


def g_accept():
    global conns
    pair()
    lst = listener
    # Connections are established (negotiated, under the shim) before anyone accepts them:
    # this thread connects five times before its first accept.
    cs = []
    t0 = time.monotonic()
    for _ in range(5):
        c = socket.socket()
        c.connect((HOST, port))
        cs.append(c)
        keep.append(c)
    took = time.monotonic() - t0
    check(took < ARRIVE, "five connects complete while nobody accepts", f"{took:.2f} s")
    by_addr = {c.getsockname(): c for c in cs}
    seen = {}
    for _ in range(5):
        s, a = lst.accept()
        keep.append(s)
        conns += 1
        seen[a] = s
    check(set(seen) == set(by_addr), "accept returns each of them with its peer's address",
          f"{sorted(seen)} vs {sorted(by_addr)}")
    for a, s in seen.items():
        by_addr[a].sendall(b"to " + str(a[1]).encode())
        want = b"to " + str(a[1]).encode()
        check(recv_exact(s, len(want)) == want, f"the accepted socket of {a[1]} is its peer's")
    check(not os.get_inheritable(s.fileno()), "accept4(SOCK_CLOEXEC): close-on-exec")

    # A thread already blocked in accept gets a connection made afterwards.
    got = {}

    def acceptor():
        s, a = lst.accept()
        got["a"] = a
        keep.append(s)

    t = threading.Thread(target=acceptor)
    t.start()
    time.sleep(0.2)
    c = socket.socket()
    c.connect((HOST, port))
    keep.append(c)
    joined(t, "the blocked accept", ARRIVE)
    conns += 1
    check(got.get("a") == c.getsockname(), "a blocked accept returns the next connection",
          repr(got))

    lst.setblocking(False)
    expect_err(lst.accept, (errno.EAGAIN,), "a non-blocking accept with nothing waiting")
    lst.setblocking(True)

    # accept(2) as libc exports it, with a 4-byte address buffer: truncated, full length back.
    libc = ctypes.CDLL(None, use_errno=True)
    c = socket.socket()
    c.connect((HOST, port))
    keep.append(c)
    buf = ctypes.create_string_buffer(b"\xee" * 16, 16)
    ln = ctypes.c_uint32(4)
    fd = libc.accept(lst.fileno(), buf, ctypes.byref(ln))
    check(fd >= 0, "accept(fd, addr, len=4)", f"errno {ctypes.get_errno()}")
    s = socket.socket(fileno=fd)
    keep.append(s)
    conns += 1
    want = struct.pack("=H", socket.AF_INET) + struct.pack("!H", c.getsockname()[1])
    check(buf.raw[:4] == want and buf.raw[4:] == b"\xee" * 12 and ln.value == 16,
          "the address is cut to 4 bytes, the length says 16", f"{buf.raw!r} {ln.value}")

    # A signal interrupts a blocking accept (the handler runs, here it raises).
    def on_alarm(signum, frame):
        raise Interrupted()

    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        lst.accept()
        fail("a signal interrupts a blocking accept", "accept returned")
    except Interrupted:
        ok("a signal interrupts a blocking accept")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)

    # listen() again (another backlog) is allowed; shutdown() wakes a thread blocked in accept.
    lst.listen(32)
    ok("listen() again on a listening socket")
    res = {}

    def blocked():
        try:
            lst.accept()
            res["r"] = "returned"
        except OSError as e:
            res["r"] = e.errno

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.3)
    lst.shutdown(socket.SHUT_RDWR)
    joined(t, "the blocked accept", 10)
    check(res.get("r") == errno.EINVAL, "shutdown() makes a blocked accept fail with EINVAL",
          repr(res))


# --- 15. the accepted socket's first call ------------------------------------------------------


def g_first_use():
    # Under the shim the server's side of a connection settles when the program first uses
    # the accepted socket; whatever that first call is, the result is TCP's.
    c, s = pair()
    s.shutdown(socket.SHUT_WR)
    check(c.recv(100) == b"", "shutdown(SHUT_WR) as the first call: the peer reads EOF")
    expect_err(lambda: s.send(b"x", socket.MSG_NOSIGNAL), (errno.EPIPE,),
               "send after that SHUT_WR: EPIPE")
    c.sendall(b"towards the half-closed end")
    check(recv_exact(s, 27) == b"towards the half-closed end", "the half-closed end still reads")

    c, s = pair()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 2, 0))
    s.shutdown(socket.SHUT_RD)
    d, dt, e = timed(lambda: s.recv(100))
    check(e is None and d == b"" and dt < 1.0, "shutdown(SHUT_RD) first: recv returns b''",
          f"{d!r} {e!r} after {dt:.3f}s")
    s.sendall(b"sent after SHUT_RD")
    check(recv_exact(c, 18) == b"sent after SHUT_RD", "and it still sends")

    c, s = pair()
    s.shutdown(socket.SHUT_RDWR)
    check(c.recv(100) == b"", "shutdown(SHUT_RDWR) first: the peer reads EOF")

    c, s = pair()
    spare = socket.socket()
    keep.append(spare)
    os.dup2(s.fileno(), spare.fileno())
    s.close()
    c.sendall(b"through dup2")
    check(os.read(spare.fileno(), 100) == b"through dup2", "dup2 first, original closed: reads")
    os.write(spare.fileno(), b"back through dup2")
    check(recv_exact(c, 17) == b"back through dup2", "and writes")

    c, s = pair()
    d2 = s.dup()
    keep.append(d2)
    s.close()
    d2.sendall(b"from a dup")
    check(recv_exact(c, 10) == b"from a dup", "dup first, original closed: writes")
    c.close()
    check(d2.recv(100) == b"", "and sees the peer's EOF")

    c, s = pair()
    s.setblocking(False)
    expect_err(lambda: s.recv(100), (errno.EAGAIN,), "a non-blocking recv first: EAGAIN")
    c.sendall(b"later")
    s.setblocking(True)
    check(recv_exact(s, 5) == b"later", "then the data")


GROUPS = {
    "partial": g_partial,
    "peek": g_peek,
    "waitall": g_waitall,
    "dontwait": g_dontwait,
    "nonblock_send": g_nonblock_send,
    "rcvtimeo": g_rcvtimeo,
    "sndtimeo": g_sndtimeo,
    "fionread": g_fionread,
    "eof": g_eof,
    "shut_wr": g_shut_wr,
    "shut_rd": g_shut_rd,
    "shut_rdwr": g_shut_rdwr,
    "reset": g_reset,
    "reset_linger": g_reset_linger,
    "reset_once": g_reset_once,
    "reset_send": g_reset_send,
    "epipe": g_epipe,
    "so_error": g_so_error,
    "names": g_names,
    "threads": g_threads,
    "vectors": g_vectors,
    "blocking_send": g_blocking_send,
    "accept": g_accept,
    "first_use": g_first_use,
}


def main():
    global group, port
    if len(sys.argv) != 3 or sys.argv[1] not in GROUPS:
        print(f"usage: semantics.py {{{','.join(GROUPS)}}} PORT", file=sys.stderr)
        sys.exit(2)
    group, port = sys.argv[1], int(sys.argv[2])
    try:
        GROUPS[group]()
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        fail(f"after step {steps}", f"unexpected {e!r}")
    for k in keep:
        k.close()
    if listener is not None:
        listener.close()
    print(f"OK semantics {group} conns={conns}", flush=True)


if __name__ == "__main__":
    main()
