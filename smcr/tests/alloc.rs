//! Hot-path hygiene: a `write()` on an established SMC-R connection over UDP allocates
//! nothing on the writing thread (scatter lists and work requests live on the stack), and
//! neither does a `read()`, nor a write corked as an event loop's answers are and sent when
//! the thread uncorks. Counted by a global allocator that counts per thread; not timed.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::{Read, Write};
use std::thread;

use smcr::{Mode, Negotiation, Runtime, RuntimeConfig, SmcListener, SmcStream};

struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator; the counter is a const-initialised thread-local
// (no allocation, no destructor).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: as the caller's contract.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: as the caller's contract.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: as the caller's contract.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(Cell::get)
}

#[test]
fn writes_and_reads_on_a_udp_link_do_not_allocate() {
    round_trips(false);
}

/// As an event loop answers: the server corks before its write and uncorks after it, so each
/// answer is deferred and sent by `cork::end`.
#[test]
fn corked_writes_on_a_udp_link_do_not_allocate() {
    round_trips(true);
}

fn round_trips(cork: bool) {
    let mut cfg = RuntimeConfig::new();
    cfg.negotiation = Negotiation::Assume;
    // (The two tests run at once, each with its own port.)
    cfg.roce_port = 21000 + (std::process::id() % 4000) as u16 + if cork { 4000 } else { 0 };
    // Over UDP (RoCE v2), not the same-host shared-memory transport.
    cfg.same_host = false;
    let rt = Runtime::new(cfg);
    let l = SmcListener::bind(&rt, "127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    const N: usize = 4000;
    let server = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        assert!(matches!(s.mode(), Mode::SmcR { .. }), "{:?}", s.mode());
        let mut buf = [0u8; 64];
        // Ping-pong (each write is flushed at once: nothing in flight to cork behind): a
        // warm-up half, then the measured half.
        let mut n = 0;
        for half in 0..2 {
            let before = allocs();
            for _ in 0..N / 2 {
                s.read_exact(&mut buf).unwrap();
                if cork {
                    smcr::cork::begin();
                }
                s.write_all(&buf).unwrap();
                if cork {
                    smcr::cork::end();
                }
            }
            if half == 1 {
                n = allocs() - before;
            }
        }
        n
    });
    let mut c = SmcStream::connect(&rt, addr).unwrap();
    assert!(matches!(c.mode(), Mode::SmcR { .. }), "{:?}", c.mode());
    let mut msg = [7u8; 64];
    let mut client = 0;
    for half in 0..2 {
        let before = allocs();
        for _ in 0..N / 2 {
            c.write_all(&msg).unwrap();
            c.read_exact(&mut msg).unwrap();
        }
        if half == 1 {
            client = allocs() - before;
        }
    }
    let server = server.join().unwrap();
    println!(
        "allocations in {} round trips (write + read each side, cork {cork}): client {client}, server {server}",
        N / 2
    );
    // A few are allowed (a buffer that grows once); none per message.
    assert!(
        client <= 16,
        "client: {client} allocations in {} round trips",
        N / 2
    );
    assert!(
        server <= 16,
        "server: {server} allocations in {} round trips",
        N / 2
    );
}
