//! Descriptor placement under the limits programs really run with (one test: it changes the
//! process's RLIMIT_NOFILE, which no other test of this binary may see).

use std::os::fd::{AsRawFd, OwnedFd};

use rdma::fdzone::{self, Zone};
use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

fn eventfd() -> OwnedFd {
    rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap()
}

fn set(soft: u64, hard: Option<u64>) {
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(soft),
            maximum: hard,
        },
    )
    .unwrap();
}

#[test]
fn our_descriptors_stay_out_of_the_applications_numbers() {
    // Off (a Rust program's own table): a descriptor stays where it is.
    let e = eventfd();
    let n = e.as_raw_fd();
    assert_eq!(fdzone::place(e).unwrap().as_raw_fd(), n);

    fdzone::enable();
    let hard = getrlimit(Resource::Nofile).maximum;
    if hard.is_none_or(|h| h > 64) {
        // Soft 64 under a higher hard limit (Debian's 1024/524288 in small): above the soft
        // limit, which is put back after each move.
        set(64, hard);
        assert!(matches!(fdzone::current(), Zone::Above { from: 64, .. }));
        let ours: Vec<OwnedFd> = (0..100)
            .map(|_| fdzone::place(eventfd()).unwrap())
            .collect();
        for o in &ours {
            assert!(o.as_raw_fd() >= 64, "placed at {}", o.as_raw_fd());
        }
        let l = getrlimit(Resource::Nofile);
        assert_eq!((l.current, l.maximum), (Some(64), hard), "limits restored");
        // The application's next descriptor is a low one, as without us.
        let app = eventfd();
        assert!(app.as_raw_fd() < 64);
        // Our descriptors above the limit keep working.
        rustix::io::write(&ours[99], &1u64.to_ne_bytes()).unwrap();
        drop(ours);
    } else {
        eprintln!("hard limit {hard:?} ≤ 64: the above-the-limit zone is not tried");
    }

    // Soft = hard = 128 (`ulimit -n 128`): the top eighth, [112, 128), and no more.
    set(128, Some(128));
    assert_eq!(fdzone::current(), Zone::Inside { from: 112, to: 128 });
    let mut ours = Vec::new();
    loop {
        match fdzone::place(eventfd()) {
            Ok(o) => ours.push(o),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::EMFILE), "{e}");
                break;
            }
        }
    }
    assert_eq!(ours.len(), 16, "the zone holds 16");
    for o in &ours {
        let n = o.as_raw_fd();
        assert!((112..128).contains(&n), "placed at {n}");
    }
    // Refused placements leave nothing behind in the application's numbers.
    let before = (0..112)
        .filter(|&fd| {
            rustix::io::fcntl_getfd(unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) }).is_ok()
        })
        .count();
    assert!(fdzone::place(eventfd()).is_err());
    let after = (0..112)
        .filter(|&fd| {
            rustix::io::fcntl_getfd(unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) }).is_ok()
        })
        .count();
    assert_eq!(before, after);
    // The application still has its seven eighths.
    let app: Vec<OwnedFd> = (0..(112 - before)).map(|_| eventfd()).collect();
    assert!(app.iter().all(|a| a.as_raw_fd() < 112));
    let (placed, refused) = fdzone::counts();
    assert!(placed >= 16 && refused >= 2, "{placed} {refused}");
}
