//! An echo server and client on the blocking API (`SmcListener`, `SmcStream`).
//!
//! ```text
//! cargo run -p smcr --example std_echo -- server 127.0.0.1:7878 [--assume]
//! cargo run -p smcr --example std_echo -- client 127.0.0.1:7878 [TEXT] [--assume]
//! ```
//! Each connection is SMC-R when both ends can, TCP otherwise (the mode is printed).
//! `--assume` skips the TCP option (both ends must be ours); without it the option program
//! must be installed (`smcr bpf install`, as root), else every connection falls back to TCP.

use std::io::{self, Read, Write};
use std::net::Shutdown;

use smcr::{Negotiation, Runtime, RuntimeConfig, SmcListener, SmcStream};

fn main() -> io::Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let assume = args.iter().any(|a| a == "--assume");
    args.retain(|a| a != "--assume");
    let mut cfg = RuntimeConfig::new();
    if assume {
        cfg.negotiation = Negotiation::Assume;
    }
    let rt = Runtime::new(cfg);
    let addr = args.get(1).map_or("127.0.0.1:7878", String::as_str);
    match args.first().map(String::as_str) {
        Some("server") => server(&rt, addr),
        Some("client") => client(&rt, addr, args.get(2).map_or("hello", String::as_str)),
        _ => {
            eprintln!("usage: std_echo server|client [ADDR] [TEXT] [--assume]");
            std::process::exit(2);
        }
    }
}

fn server(rt: &Runtime, addr: &str) -> io::Result<()> {
    let listener = SmcListener::bind(rt, addr)?;
    println!("listening on {}", listener.local_addr()?);
    for stream in listener.incoming() {
        let stream = stream?;
        println!("{stream:?}");
        std::thread::spawn(move || {
            // `&SmcStream` reads and writes: copy the stream into itself until EOF.
            let echoed = io::copy(&mut &stream, &mut &stream);
            let _ = stream.shutdown(Shutdown::Write);
            println!("{:?}: echoed {echoed:?} bytes", stream.peer_addr());
        });
    }
    Ok(())
}

fn client(rt: &Runtime, addr: &str, text: &str) -> io::Result<()> {
    let mut stream = SmcStream::connect(rt, addr)?;
    stream.set_nodelay(true)?;
    println!("{stream:?}");
    stream.write_all(text.as_bytes())?;
    stream.shutdown(Shutdown::Write)?;
    let mut back = String::new();
    stream.read_to_string(&mut back)?;
    println!("echoed: {back}");
    rt.shutdown();
    Ok(())
}
