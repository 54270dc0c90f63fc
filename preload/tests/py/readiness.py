"""Readiness of connected TCP sockets as epoll, poll and select report it, "mio style": after
each step the expected events arrive (within ARRIVE seconds) and no unexpected event arrives
(nothing within QUIET seconds).

Both ends of every connection live in this one process (server on 127.0.0.2, client from
127.0.0.1). The expectations are what Linux TCP gives; run plainly, this script checks
them; run under LD_PRELOAD=libsmcr_preload.so (SMCR_NEGOTIATION=assume), the same script
checks that SMC-R sockets behave the same.

usage: readiness.py [GROUP ...]     (all groups when none is named)
Prints one line per check and exits 1 at the first failure; on success the last line is
"OK readiness N checks".
"""

import errno
import fcntl
import os
import select
import socket
import sys
import threading
import time

IN = select.EPOLLIN
OUT = select.EPOLLOUT
RDHUP = select.EPOLLRDHUP
HUP = select.EPOLLHUP
ERR = select.EPOLLERR
ET = select.EPOLLET
ONESHOT = select.EPOLLONESHOT
# poll() uses the same bit values as epoll for these.
assert (select.POLLIN, select.POLLOUT, select.POLLHUP, select.POLLERR) == (IN, OUT, HUP, ERR)
assert getattr(select, "POLLRDHUP", RDHUP) == RDHUP
POLLRDHUP = RDHUP

ARRIVE = 2.0  # an expected event must arrive within this
QUIET = 0.2  # and an unexpected one must not arrive within this
HOST = "127.0.0.2"

checks = 0
group = "?"


def names(mask):
    if not mask:
        return "nothing"
    out = []
    for n, b in (("IN", IN), ("OUT", OUT), ("RDHUP", RDHUP), ("HUP", HUP), ("ERR", ERR)):
        if mask & b:
            out.append(n)
            mask &= ~b
    if mask:
        out.append(hex(mask))
    return "|".join(out)


def fail(what, detail):
    print(f"FAIL [{group}] {what}: {detail}", flush=True)
    sys.exit(1)


def ok(what):
    global checks
    checks += 1
    print(f"ok {checks} [{group}] {what}", flush=True)


def fileno(s):
    return s if isinstance(s, int) else s.fileno()


def show(evs):
    return "[" + ", ".join(f"fd {fd}: {names(m)}" for fd, m in evs) + "]" if evs else "no event"


# --- epoll -----------------------------------------------------------------------------------


def level(ep, s, want, what, timeout=ARRIVE):
    """Level-triggered: epoll reports exactly `want` for `s` (and no other fd) within
    `timeout` (it may take a while to get there)."""
    fd = fileno(s)
    deadline = time.monotonic() + timeout
    last = None
    while True:
        evs = ep.poll(0)
        if evs == [(fd, want)]:
            return ok(what)
        last = evs
        if time.monotonic() >= deadline:
            fail(what, f"expected fd {fd}: {names(want)}; epoll gives {show(last)}")
        time.sleep(0.005)


def settle(ep, s, want, timeout=ARRIVE):
    """Waits up to `timeout` for epoll to report exactly `want` for `s`; returns what it
    reports last (for checks that report several findings at once)."""
    fd = fileno(s)
    deadline = time.monotonic() + timeout
    while True:
        evs = ep.poll(0)
        if evs == [(fd, want)] or time.monotonic() >= deadline:
            return show(evs)
        time.sleep(0.005)


def level_now(ep, s, want, what):
    """Level-triggered, at once: epoll_wait(0) reports exactly `want` for `s`."""
    fd = fileno(s)
    evs = ep.poll(0)
    if evs != [(fd, want)]:
        fail(what, f"expected fd {fd}: {names(want)} at once; epoll gives {show(evs)}")
    ok(what)


def steady(ep, s, want, what, dur=QUIET):
    """Level-triggered: from now on and for `dur`, every epoll_wait reports exactly `want`."""
    fd = fileno(s)
    end = time.monotonic() + dur
    while True:
        evs = ep.poll(0)
        if evs != [(fd, want)]:
            fail(what, f"expected fd {fd}: {names(want)} throughout; epoll gives {show(evs)}")
        if time.monotonic() >= end:
            return ok(what)
        time.sleep(0.01)


def edge(ep, s, want, what):
    """One event: the next epoll_wait (within ARRIVE) reports exactly `want` for `s`."""
    fd = fileno(s)
    evs = ep.poll(ARRIVE)
    if evs != [(fd, want)]:
        fail(what, f"expected one event fd {fd}: {names(want)}; epoll gives {show(evs)}")
    ok(what)


def quiet(ep, what, dur=QUIET):
    """No event within `dur`."""
    evs = ep.poll(dur)
    if evs:
        fail(what, f"expected no event; epoll gives {show(evs)}")
    ok(what)


def writes():
    """How many write calls this thread made (the kernel's syscw)."""
    with open("/proc/thread-self/io") as f:
        for line in f:
            if line.startswith("syscw:"):
                return int(line.split()[1])
    raise RuntimeError("no syscw in /proc/thread-self/io")


def epoll(s, events):
    ep = select.epoll()
    ep.register(fileno(s), events)
    return ep


# --- poll and select -------------------------------------------------------------------------


def poll_mask(s, timeout=0, events=select.POLLIN | select.POLLOUT | POLLRDHUP):
    p = select.poll()
    p.register(fileno(s), events)
    evs = p.poll(timeout * 1000)
    return evs[0][1] if evs else 0


def select_view(s, timeout=0):
    fd = fileno(s)
    r, w, x = select.select([fd], [fd], [fd], timeout)
    return (bool(r), bool(w), bool(x))


def select_expect(mask):
    # Linux: readable = IN|HUP|ERR, writable = OUT|ERR, exceptional = PRI (never here).
    return (bool(mask & (IN | HUP | ERR)), bool(mask & (OUT | ERR)), False)


def agree(s, want, what):
    """poll() reaches exactly `want` within ARRIVE; then poll, select and a fresh
    level-triggered epoll set all report the same at once. `want` 0: none of the three
    reports anything within QUIET."""
    fd = fileno(s)
    if want == 0:
        m = poll_mask(s, QUIET)
        if m:
            fail(what, f"poll(): expected nothing, got {names(m)}")
        v = select_view(s, QUIET)
        if v != (False, False, False):
            fail(what, f"select(): expected nothing, got (r, w, x) = {v}")
        ep = epoll(s, IN | OUT | RDHUP)
        evs = ep.poll(QUIET)
        ep.close()
        if evs:
            fail(what, f"epoll: expected nothing, got {show(evs)}")
        return ok(what + " [poll, select, epoll: nothing]")
    deadline = time.monotonic() + ARRIVE
    while True:
        m = poll_mask(s)
        if m == want:
            break
        if time.monotonic() >= deadline:
            fail(what, f"poll(): expected {names(want)}, got {names(m)}")
        time.sleep(0.005)
    v = select_view(s)
    if v != select_expect(want):
        fail(what, f"select(): expected (r, w, x) = {select_expect(want)}, got {v}")
    ep = epoll(s, IN | OUT | RDHUP)
    evs = ep.poll(0)
    ep.close()
    if evs != [(fd, want)]:
        fail(what, f"epoll: expected {names(want)}, got {show(evs)}")
    ok(what + f" [poll, select, epoll: {names(want)}]")


# --- connections -----------------------------------------------------------------------------


def listener(rcvbuf=None):
    l = socket.socket()
    l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if rcvbuf:
        l.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    l.bind((HOST, 0))
    l.listen(16)
    return l


def connect(l, sndbuf=None):
    """A connected pair (client, server), both non-blocking. Blocking connect and accept."""
    c = socket.socket()
    if sndbuf:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    c.connect(l.getsockname())
    s, _ = l.accept()
    c.setblocking(False)
    s.setblocking(False)
    return c, s


def recv_exact(s, n, what):
    """Reads exactly n bytes from non-blocking `s`, waiting with poll() up to ARRIVE for
    each piece."""
    got = bytearray()
    while len(got) < n:
        try:
            d = s.recv(n - len(got))
        except BlockingIOError:
            if not poll_mask(s, ARRIVE, select.POLLIN):
                fail(what, f"{len(got)} of {n} bytes arrived, then nothing for {ARRIVE}s")
            continue
        if not d:
            fail(what, f"EOF after {len(got)} of {n} bytes")
        got += d
    return bytes(got)


def would_block(s, what):
    try:
        d = s.recv(100)
    except BlockingIOError:
        return ok(what)
    fail(what, f"recv gave {d!r}, expected EAGAIN")


def fill_once(c):
    chunk = b"f" * 4096
    sent = 0
    while True:
        try:
            n = c.send(chunk)
        except BlockingIOError:
            return sent
        sent += n


def fill(c):
    """Non-blocking sends until EAGAIN, repeated after a pause until nothing more is taken
    (Linux TCP may take more once in-flight data reaches the receiver's buffer); returns
    the bytes accepted."""
    sent = fill_once(c)
    for _ in range(50):
        time.sleep(0.05)
        n = fill_once(c)
        if n == 0:
            return sent
        sent += n
    fail("fill", f"still taking data after {sent} bytes")


# --- the checks ------------------------------------------------------------------------------


def g_level():
    """1. Level-triggered EPOLLIN/EPOLLOUT."""
    l = listener()
    c, s = connect(l)
    ep = epoll(s, IN | OUT | RDHUP)
    steady(ep, s, OUT, "connected, nothing received: EPOLLOUT only")
    epc = epoll(c, OUT)
    level(epc, c, OUT, "client side: EPOLLOUT on a connected socket with free space")
    c.send(b"hello")
    level(ep, s, IN | OUT, "data arrived: EPOLLIN|EPOLLOUT")
    for i in range(3):
        level_now(ep, s, IN | OUT, f"data unread: reported again ({i + 1})")
    if s.recv(2) != b"he":
        fail("partial read", "wrong data")
    level_now(ep, s, IN | OUT, "2 of 5 bytes read: EPOLLIN still reported")
    if s.recv(100) != b"llo":
        fail("read the rest", "wrong data")
    would_block(s, "all read: recv gives EAGAIN")
    steady(ep, s, OUT, "all read: EPOLLIN no longer reported")
    c.send(b"more")
    level(ep, s, IN | OUT, "new data: EPOLLIN again")
    recv_exact(s, 4, "read it")
    steady(ep, s, OUT, "read it all: EPOLLIN gone again")
    for x in (c, s, l, ep, epc):
        x.close()


def g_edge():
    """2. Edge-triggered: one event per arrival."""
    l = listener()
    c, s = connect(l)
    ep = epoll(s, IN | OUT | RDHUP | ET)
    edge(ep, s, OUT, "registered a writable socket: one EPOLLOUT")
    quiet(ep, "no repeat")
    c.send(b"a")
    edge(ep, s, IN | OUT, "data arrived: one event")
    quiet(ep, "no repeat without new data (data still unread)")
    recv_exact(s, 1, "read")
    would_block(s, "all read")
    quiet(ep, "reading everything: no event")
    c.send(b"bb")
    edge(ep, s, IN | OUT, "more data arrived: one event")
    quiet(ep, "no repeat")
    recv_exact(s, 1, "partial read")
    quiet(ep, "partial read: no event")
    c.send(b"c")
    edge(ep, s, IN | OUT, "new data while older data is still unread: a new event")
    quiet(ep, "no repeat")
    if recv_exact(s, 2, "read the rest") != b"bc":
        fail("read the rest", "wrong data")
    quiet(ep, "all read: no event")
    for x in (c, s, l, ep):
        x.close()


def g_oneshot():
    """3. EPOLLONESHOT: one event, then nothing until EPOLL_CTL_MOD re-arms."""
    l = listener()
    c, s = connect(l)
    ep = epoll(s, IN | ONESHOT)
    quiet(ep, "nothing to read: no event")
    c.send(b"x")
    edge(ep, s, IN, "data arrived: one event")
    quiet(ep, "disarmed: no event though data is unread")
    c.send(b"y")
    quiet(ep, "disarmed: no event for new data")
    ep.modify(s.fileno(), IN | ONESHOT)
    edge(ep, s, IN, "re-armed with data unread: one event")
    quiet(ep, "disarmed again")
    if recv_exact(s, 2, "read") != b"xy":
        fail("read", "wrong data")
    ep.modify(s.fileno(), IN | ONESHOT)
    quiet(ep, "re-armed, nothing to read: no event")
    c.send(b"z")
    edge(ep, s, IN, "re-armed, data arrived: one event")
    quiet(ep, "disarmed again")
    for x in (c, s, l, ep):
        x.close()


def g_shutdown():
    """4a. The peer shuts down writing, then both directions are shut."""
    l = listener()
    c, s = connect(l)
    eps = epoll(s, IN | OUT | RDHUP)
    epc = epoll(c, IN | OUT | RDHUP)
    level(eps, s, OUT, "server: connected")
    level(epc, c, OUT, "client: connected")
    c.shutdown(socket.SHUT_WR)
    level(eps, s, IN | OUT | RDHUP, "peer shut down writing: EPOLLIN|EPOLLOUT|EPOLLRDHUP")
    steady(epc, c, OUT, "own shutdown(SHUT_WR): still EPOLLOUT only")
    d = s.recv(100)
    if d != b"":
        fail("read after the peer's shutdown", f"expected EOF (b''), got {d!r}")
    ok("read after the peer's shutdown gives b''")
    steady(eps, s, IN | OUT | RDHUP, "EOF read: still EPOLLIN|EPOLLOUT|EPOLLRDHUP")
    agree(s, IN | OUT | RDHUP, "peer shut down writing")
    s.send(b"late")
    level(epc, c, IN | OUT, "the half-closed side still receives: EPOLLIN|EPOLLOUT")
    recv_exact(c, 4, "read it")
    steady(epc, c, OUT, "read it: EPOLLOUT only")
    s.shutdown(socket.SHUT_WR)
    level(epc, c, IN | OUT | RDHUP | HUP, "client: both directions shut: EPOLLHUP too")
    level(eps, s, IN | OUT | RDHUP | HUP, "server: both directions shut: EPOLLHUP too")
    agree(s, IN | OUT | RDHUP | HUP, "server: both directions shut")
    agree(c, IN | OUT | RDHUP | HUP, "client: both directions shut")
    for x in (c, s, l, eps, epc):
        x.close()


def g_close():
    """4b. The peer closes (nothing unread on its side)."""
    l = listener()
    c, s = connect(l)
    c.send(b"bye")
    ep = epoll(s, IN | OUT | RDHUP)
    level(ep, s, IN | OUT, "data arrived")
    c.close()
    level(ep, s, IN | OUT | RDHUP, "peer closed: EPOLLIN|EPOLLOUT|EPOLLRDHUP")
    agree(s, IN | OUT | RDHUP, "peer closed")
    if recv_exact(s, 3, "the data sent before close") != b"bye":
        fail("the data sent before close", "wrong data")
    d = s.recv(100)
    if d != b"":
        fail("read after the data", f"expected EOF (b''), got {d!r}")
    ok("then read gives b''")
    steady(ep, s, IN | OUT | RDHUP, "EOF read: still EPOLLIN|EPOLLOUT|EPOLLRDHUP")
    s.shutdown(socket.SHUT_WR)
    level(ep, s, IN | OUT | RDHUP | HUP, "own shutdown(SHUT_WR) after the peer's close: EPOLLHUP")
    agree(s, IN | OUT | RDHUP | HUP, "closed both ways")
    for x in (s, l, ep):
        x.close()


def g_reset():
    """4c. The peer closes with data it did not read (Linux TCP sends a reset)."""
    l = listener()
    c, s = connect(l)
    s.send(b"never read")
    epc = epoll(c, IN)
    level(epc, c, IN, "the data reached the client")
    ep = epoll(s, IN | OUT | RDHUP)
    level(ep, s, OUT, "server: connected")
    c.close()
    want = IN | OUT | RDHUP | HUP | ERR
    seen = settle(ep, s, want)
    try:
        got = repr(s.recv(100))
    except OSError as e:
        got = errno.errorcode.get(e.errno, str(e))
    what = "peer closed with unread data (reset)"
    if seen != show([(s.fileno(), want)]) or got != "ECONNRESET":
        fail(what, f"expected fd {s.fileno()}: {names(want)} then recv ECONNRESET; "
             f"epoll gives {seen}, then recv gives {got}")
    ok(what + f": {names(want)}, then recv ECONNRESET")
    level(ep, s, IN | OUT | RDHUP | HUP, "error reported: EPOLLERR gone, EPOLLHUP stays")
    for x in (s, l, ep, epc):
        x.close()


def g_writable():
    """5. EPOLLOUT only after the reader frees space."""
    l = listener(rcvbuf=16384)
    c, s = connect(l, sndbuf=16384)
    lt = epoll(c, OUT)
    et = epoll(c, OUT | ET)
    level(lt, c, OUT, "connected: EPOLLOUT (level)")
    edge(et, c, OUT, "connected: one EPOLLOUT (edge)")
    sent = fill(c)
    if sent <= 0:
        fail("fill", "no byte was accepted")
    ok(f"filled the connection: {sent} bytes, then EAGAIN")
    quiet(lt, "full: no EPOLLOUT (level)")
    quiet(et, "full: no EPOLLOUT (edge)")
    agree(c, 0, "full")
    recv_exact(s, sent, "the reader drains everything")
    would_block(s, "drained")
    level(lt, c, OUT, "space freed: EPOLLOUT (level)")
    edge(et, c, OUT, "space freed: one EPOLLOUT (edge)")
    try:
        n = c.send(b"after")
    except BlockingIOError:
        fail("send after EPOLLOUT", "EAGAIN")
    if n <= 0:
        fail("send after EPOLLOUT", f"returned {n}")
    ok("a send after EPOLLOUT succeeds")
    recv_exact(s, n, "it arrives")
    for x in (c, s, l, lt, et):
        x.close()


def g_multi():
    """6. Several epoll sets watching one descriptor."""
    l = listener()
    c, s = connect(l)
    a = epoll(s, IN)
    b = epoll(s, IN | ET)
    d = epoll(s, IN | OUT)
    quiet(a, "set A (level IN): nothing yet")
    quiet(b, "set B (edge IN): nothing yet")
    c.send(b"ping")
    level(a, s, IN, "set A: EPOLLIN")
    edge(b, s, IN, "set B: one EPOLLIN")
    level(d, s, IN | OUT, "set C (level IN|OUT): EPOLLIN|EPOLLOUT")
    agree(s, IN | OUT, "data pending")
    recv_exact(s, 4, "read")
    quiet(a, "set A: nothing once read")
    quiet(b, "set B: nothing once read")
    steady(d, s, OUT, "set C: EPOLLOUT once read")
    a.unregister(s.fileno())
    c.send(b"pong")
    edge(b, s, IN, "set B still gets events after set A unregistered")
    level(d, s, IN | OUT, "set C too")
    quiet(a, "set A: nothing after unregister")
    for x in (c, s, l, a, b, d):
        x.close()


def g_reuse():
    """7. A closed socket's number reused by a new socket: no events of the old connection."""
    l = listener()
    ca, sa = connect(l)
    ep = epoll(sa, IN | RDHUP)
    ca.send(b"old")
    level(ep, sa, IN, "old connection: data arrived")
    recv_exact(sa, 3, "read it")
    n = sa.fileno()
    sa.close()  # no EPOLL_CTL_DEL: closing the only descriptor removes the registration
    quiet(ep, "old socket closed: its registration is gone")
    # The new socket takes the lowest free number: fill the numbers below n first (under the
    # shim, accept's number need not be the lowest free one).
    spare = []
    x = socket.socket()
    while x.fileno() != n and len(spare) < 256:
        spare.append(x)
        x = socket.socket()
    if x.fileno() != n:
        fail("setup", f"no new socket got the closed number {n}")
    for y in spare:
        y.close()
    x.connect(l.getsockname())
    sb, _ = l.accept()
    x.setblocking(False)
    ep.register(n, IN | RDHUP)
    ok(f"new connection at the same number {n} registered")
    quiet(ep, "new connection: nothing to report")
    try:
        ca.send(b"written after the close")
    except OSError:
        pass
    quiet(ep, "the old peer writes after the close: no event on the new socket")
    try:
        ca.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # Linux: reset by the write above
    quiet(ep, "the old peer shuts down: no event on the new socket")
    ca.close()
    quiet(ep, "the old peer closes: no event on the new socket")
    sb.send(b"new")
    level(ep, n, IN, "the new connection's data: EPOLLIN")
    if recv_exact(x, 3, "read it") != b"new":
        fail("read it", "wrong data")
    quiet(ep, "all read")
    for y in (x, sb, l, ep):
        y.close()


def g_pollselect():
    """8. poll() and select() agree with epoll."""
    l = listener(rcvbuf=16384)
    c, s = connect(l, sndbuf=16384)
    agree(s, OUT, "connected")
    c.send(b"data")
    agree(s, IN | OUT, "data pending")
    recv_exact(s, 4, "read")
    agree(s, OUT, "data read")
    sent = fill(c)
    agree(c, 0, "writer's connection full")
    recv_exact(s, sent, "drain")
    agree(c, OUT, "writer after the reader drained")
    # Waiting in poll() and select() (not only asking).
    c.send(b"x")
    if not poll_mask(s, ARRIVE, select.POLLIN) & IN:
        fail("poll() waits for data", "no POLLIN within the timeout")
    ok("poll() waiting returns on data")
    recv_exact(s, 1, "read")
    c.send(b"y")
    r, _, _ = select.select([s.fileno()], [], [], ARRIVE)
    if not r:
        fail("select() waits for data", "not readable within the timeout")
    ok("select() waiting returns on data")
    recv_exact(s, 1, "read")
    c.shutdown(socket.SHUT_WR)
    agree(s, IN | OUT | RDHUP, "peer shut down writing")
    s.shutdown(socket.SHUT_WR)
    agree(s, IN | OUT | RDHUP | HUP, "both shut down")
    agree(c, IN | OUT | RDHUP | HUP, "both shut down (client)")
    for x in (c, s, l):
        x.close()


def g_listener():
    """9. A listening socket."""
    l = listener()
    l.setblocking(False)
    lt = epoll(l, IN)
    et = epoll(l, IN | ET)
    quiet(lt, "no connection: not readable (epoll level)")
    quiet(et, "no connection: not readable (epoll edge)")
    agree(l, 0, "no connection")
    try:
        l.accept()
        fail("accept with no connection", "returned a connection")
    except BlockingIOError:
        ok("accept with no connection: EAGAIN")
    c1 = socket.socket()
    c1.connect(l.getsockname())
    level(lt, l, IN, "a connection is ready: readable (level)")
    edge(et, l, IN, "a connection is ready: one event (edge)")
    quiet(et, "no repeat (edge)")
    agree(l, IN, "a connection is ready")
    s1, _ = l.accept()
    ok("accept returns it")
    quiet(lt, "accepted: not readable (level)")
    quiet(et, "accepted: no event (edge)")
    agree(l, 0, "accepted")
    try:
        l.accept()
        fail("accept again", "returned a connection")
    except BlockingIOError:
        ok("accept again: EAGAIN")
    s1.setblocking(False)
    c1.send(b"hi")
    if recv_exact(s1, 2, "the accepted connection works") != b"hi":
        fail("the accepted connection works", "wrong data")
    ok("the accepted connection works")
    c2 = socket.socket()
    c2.connect(l.getsockname())
    edge(et, l, IN, "second connection: one event (edge)")
    level(lt, l, IN, "second connection: readable (level)")
    c3 = socket.socket()
    c3.connect(l.getsockname())
    # Both are queued before accepting either: a second arrival still makes an edge (Linux
    # wakes the listener for every connection).
    edge(et, l, IN, "third connection while the second waits: one more event (edge)")
    s2, _ = l.accept()
    # (Under the shim a connection is acceptable once its server handshake ended, which may be
    # an instant after the client's connect returned: the step may wait for it.)
    level(lt, l, IN, "one accepted, one waiting: still readable")
    s3, _ = l.accept()
    quiet(lt, "both accepted: not readable")
    for x in (c1, c2, c3, s1, s2, s3, l, lt, et):
        x.close()


def nb_connect(addr):
    c = socket.socket()
    c.setblocking(False)
    e = c.connect_ex(addr)
    if e not in (0, errno.EINPROGRESS):
        fail("non-blocking connect", f"connect gave {errno.errorcode.get(e, e)}")
    return c


def connected_now(c, s_listener, what):
    e = c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if e != 0:
        fail(what, f"SO_ERROR {errno.errorcode.get(e, e)}")
    try:
        c.getpeername()
    except OSError as x:
        fail(what, f"writable but not connected: getpeername: {x}")
    s, _ = s_listener.accept()
    s.setblocking(False)
    c.send(b"hello")
    if recv_exact(s, 5, what) != b"hello":
        fail(what, "wrong data")
    ok(what + ": SO_ERROR 0, connected, data flows")
    return s


def g_connect():
    """10. Non-blocking connect."""
    l = listener()
    addr = l.getsockname()
    # epoll
    c = nb_connect(addr)
    ep = epoll(c, IN | OUT | RDHUP)
    edge(ep, c, OUT, "non-blocking connect: the first event is EPOLLOUT alone")
    s = connected_now(c, l, "at EPOLLOUT")
    steady(ep, c, OUT, "then EPOLLOUT only")
    for x in (c, s, ep):
        x.close()
    # poll()
    c = nb_connect(addr)
    m = poll_mask(c, ARRIVE)
    if m != OUT:
        fail("non-blocking connect, poll()", f"expected POLLOUT, got {names(m)}")
    ok("non-blocking connect, poll(): POLLOUT")
    s = connected_now(c, l, "at POLLOUT")
    for x in (c, s):
        x.close()
    # select()
    c = nb_connect(addr)
    _, w, _ = select.select([], [c.fileno()], [], ARRIVE)
    if not w:
        fail("non-blocking connect, select()", "not writable within the timeout")
    ok("non-blocking connect, select(): writable")
    s = connected_now(c, l, "at select() writable")
    for x in (c, s):
        x.close()
    # A refused connect: a bound port nobody listens on.
    r = socket.socket()
    r.bind((HOST, 0))
    c = nb_connect(r.getsockname())
    ep = epoll(c, IN | OUT | RDHUP)
    want = IN | OUT | RDHUP | HUP | ERR
    seen = settle(ep, c, want)
    e = c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    e = errno.errorcode.get(e, e)
    what = "refused non-blocking connect"
    if seen != show([(c.fileno(), want)]) or e != "ECONNREFUSED":
        fail(what, f"expected fd {c.fileno()}: {names(want)} and SO_ERROR ECONNREFUSED; "
             f"epoll gives {seen}, SO_ERROR {e}")
    ok(what + f": {names(want)}, SO_ERROR ECONNREFUSED")
    level(ep, c, IN | OUT | RDHUP | HUP, "refused, error read: EPOLLERR gone")
    for x in (c, r, ep, l):
        x.close()


def poll_now(s, want, what):
    """poll() with no wait reports exactly `want` — the socket's state changed while nothing
    looked at it (no epoll set holds it), so this is the first look since."""
    m = poll_mask(s)
    if m != want:
        fail(what, f"poll(): expected {names(want)} at once, got {names(m)}")
    ok(what)


def g_unwatched():
    """11. Readiness first asked for long after it changed (poll and select only, no epoll)."""
    l = listener(rcvbuf=16384)
    c, s = connect(l, sndbuf=16384)
    poll_now(s, OUT, "connected")
    c.send(b"data")
    time.sleep(0.2)
    poll_now(s, IN | OUT, "data arrived while nothing looked")
    if select_view(s) != (True, True, False):
        fail("select agrees", f"select(): {select_view(s)}")
    ok("select agrees")
    recv_exact(s, 4, "read")
    poll_now(s, OUT, "data read")
    sent = fill(c)
    poll_now(c, 0, "the writer filled the connection while nothing looked")
    got = 0
    while got < sent:
        try:
            got += len(s.recv(65536))
        except BlockingIOError:
            time.sleep(0.01)
    time.sleep(0.2)
    poll_now(c, OUT, "the reader drained it while nothing looked")
    # A reset seen first through recv, looked at only afterwards.
    s.send(b"never read")
    time.sleep(0.2)
    c.close()
    time.sleep(0.3)
    try:
        got = repr(s.recv(100))
    except OSError as e:
        got = errno.errorcode.get(e.errno, str(e))
    if got != "ECONNRESET":
        fail("recv after the peer's reset", f"got {got}")
    ok("recv after the peer's reset: ECONNRESET")
    poll_now(s, IN | OUT | RDHUP | HUP, "the reset was collected: hang-up, no POLLERR")
    for x in (s, l):
        x.close()


def g_sets():
    """12. epoll sets in use: registration errors, a set nested in another and polled, a
    registration and a shutdown made by another thread while one sleeps, many ready sockets
    and a small maxevents."""
    l = listener()
    c, s = connect(l)
    ep = epoll(s, IN)
    try:
        ep.register(s.fileno(), IN)
        fail("ADD twice", "no error")
    except FileExistsError:
        ok("ADD twice: EEXIST")
    c2, s2 = connect(l)
    for what, call in (("MOD", lambda: ep.modify(s2.fileno(), IN)),
                       ("DEL", lambda: ep.unregister(s2.fileno()))):
        try:
            call()
            fail(f"{what} of a socket not in the set", "no error")
        except FileNotFoundError:
            ok(f"{what} of a socket not in the set: ENOENT")
    # Nested: the set inside another set, and polled.
    outer = select.epoll()
    outer.register(ep.fileno(), IN)
    c.send(b"x")
    level(outer, ep.fileno(), IN, "a set nested in another: the outer one sees it ready")
    if not poll_mask(ep.fileno(), ARRIVE, select.POLLIN) & IN:
        fail("poll() on the set", "not readable")
    ok("poll() on the set: readable")
    level(ep, s, IN, "the set itself still reports the socket")
    # The kernel answers for the socket now (what shows at its number): still non-blocking.
    if not fcntl.fcntl(s.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK:
        fail("F_GETFL", "O_NONBLOCK lost")
    ok("F_GETFL: still O_NONBLOCK")
    recv_exact(s, 1, "read")
    quiet(outer, "read: the outer set sees nothing")
    outer.close()
    # Another thread registers a socket while this one sleeps in epoll_wait.
    w = select.epoll()
    got = []
    t = threading.Thread(target=lambda: got.extend(w.poll(ARRIVE)))
    t.start()
    time.sleep(0.2)
    c2.send(b"y")
    w.register(s2.fileno(), IN)
    t.join()
    if got != [(s2.fileno(), IN)]:
        fail("registered by another thread while one sleeps", f"epoll gives {show(got)}")
    ok("registered by another thread while one sleeps: it wakes with EPOLLIN")
    recv_exact(s2, 1, "read")
    # Re-armed while ready, with no thread asleep in the set (redis-benchmark re-arms EPOLLOUT
    # with EPOLL_CTL_MOD for every request): epoll_ctl and nothing more, as with TCP. This
    # thread's own count of write calls (other threads of the process may write meanwhile).
    w.register(s.fileno(), OUT)
    level_now(w, s, OUT, "registered for EPOLLOUT")
    before = writes()
    for _ in range(1000):
        w.modify(s.fileno(), OUT)
    made = writes() - before
    if made > 10:
        fail("re-armed 1000 times while ready, nobody waiting", f"{made} write calls")
    ok(f"re-armed 1000 times while ready, nobody waiting: {made} write calls")
    level_now(w, s, OUT, "re-armed: still reported")
    w.unregister(s.fileno())
    # Another thread shuts a socket down while this one sleeps.
    w.modify(s2.fileno(), IN | RDHUP)
    got = []
    t = threading.Thread(target=lambda: got.extend(w.poll(ARRIVE)))
    t.start()
    time.sleep(0.2)
    s2.shutdown(socket.SHUT_RD)
    t.join()
    if not got or got[0][0] != s2.fileno() or not got[0][1] & IN:
        fail("shut down by another thread while one sleeps", f"epoll gives {show(got)}")
    ok("shut down by another thread while one sleeps: it wakes")
    w.close()
    # The same with poll() and select() asleep.
    c3, s3 = connect(l)
    got = []
    t = threading.Thread(target=lambda: got.append(poll_mask(s3, 10, select.POLLIN)))
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    s3.shutdown(socket.SHUT_RD)
    t.join()
    took = time.monotonic() - t0
    if not got or not got[0] & IN or took > ARRIVE / 2:
        fail("poll() asleep, the socket shut down by another thread",
             f"poll gives {got} after {took:.2f} s")
    ok("poll() asleep, the socket shut down by another thread: it wakes")
    c4, s4 = connect(l)
    got = []
    t = threading.Thread(target=lambda: got.append(select.select([s4], [], [], ARRIVE)[0]))
    t.start()
    time.sleep(0.2)
    c4.send(b"w")
    t.join()
    if got != [[s4]]:
        fail("select() asleep, data arrives", f"select gives {got}")
    ok("select() asleep, data arrives: readable")
    for x in (c3, s3, c4, s4):
        x.close()
    # Many ready sockets, one event per call: each comes in turn.
    pairs = [connect(l) for _ in range(5)]
    many = select.epoll()
    for _, srv in pairs:
        many.register(srv.fileno(), IN)
    for cl, _ in pairs:
        cl.send(b"z")
    want = {srv.fileno() for _, srv in pairs}
    seen = set()
    deadline = time.monotonic() + ARRIVE
    while seen != want and time.monotonic() < deadline:
        for fd, m in many.poll(0.1, 1):
            seen.add(fd)
    if seen != want:
        fail("five ready sockets, maxevents 1", f"saw {sorted(seen)} of {sorted(want)}")
    ok("five ready sockets, maxevents 1: each reported in turn")
    # Registrations taken out of the middle and the front: the others keep theirs (events,
    # data), can be modified and deleted, and a deleted one is unknown.
    gone = {pairs[2][1].fileno(), pairs[0][1].fileno()}
    for fd in (pairs[2][1].fileno(), pairs[0][1].fileno()):
        many.unregister(fd)
    left = [srv for _, srv in pairs if srv.fileno() not in gone]
    for srv in left:
        many.modify(srv.fileno(), IN | OUT)
    got = dict(many.poll(ARRIVE))
    if set(got) != {srv.fileno() for srv in left} or any(m != IN | OUT for m in got.values()):
        fail("after deleting two of five, the other three modified", f"epoll gives {show(got.items())}")
    for fd in gone:
        try:
            many.modify(fd, IN)
            fail("MOD of a deleted registration", "no error")
        except FileNotFoundError:
            pass
    many.unregister(left[-1].fileno())
    many.register(pairs[2][1].fileno(), OUT)
    got = dict(many.poll(ARRIVE))
    want = {left[0].fileno(): IN | OUT, left[1].fileno(): IN | OUT, pairs[2][1].fileno(): OUT}
    if got != want:
        fail("deleted, added again", f"epoll gives {show(got.items())}, want {show(want.items())}")
    ok("registrations deleted from the middle of a set: the rest keep theirs")
    for x in [many, ep, c, s, c2, s2, l] + [y for p in pairs for y in p]:
        x.close()


GROUPS = {
    "sets": g_sets,
    "unwatched": g_unwatched,
    "level": g_level,
    "edge": g_edge,
    "oneshot": g_oneshot,
    "shutdown": g_shutdown,
    "close": g_close,
    "reset": g_reset,
    "writable": g_writable,
    "multi": g_multi,
    "reuse": g_reuse,
    "pollselect": g_pollselect,
    "listener": g_listener,
    "connect": g_connect,
}


def main():
    global group
    wanted = sys.argv[1:] or list(GROUPS)
    for g in wanted:
        if g not in GROUPS:
            print(f"unknown group {g}; groups: {' '.join(GROUPS)}")
            sys.exit(2)
    for g in wanted:
        group = g
        GROUPS[g]()
    print(f"OK readiness {checks} checks", flush=True)


if __name__ == "__main__":
    main()
