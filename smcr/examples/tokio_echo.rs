//! An echo server and client on tokio (`AsyncSmcListener`, `AsyncSmcStream`; feature `tokio`).
//!
//! ```text
//! cargo run -p smcr --features tokio --example tokio_echo -- server 127.0.0.1:7878 [--assume]
//! cargo run -p smcr --features tokio --example tokio_echo -- client 127.0.0.1:7878 [TEXT] [--assume]
//! ```
//! Each connection is SMC-R when both ends can, TCP otherwise (the mode is printed).
//! `--assume` skips the TCP option (both ends must be ours); without it the option program
//! must be installed (`smcr bpf install`, as root), else every connection falls back to TCP.
//! `accept` is cancel-safe: it may lose a `tokio::select!` (to a shutdown signal, a timer)
//! without dropping a connection.

use std::io;

use smcr::tokio::{AsyncSmcListener, AsyncSmcStream};
use smcr::{Negotiation, Runtime, RuntimeConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::main]
async fn main() -> io::Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let assume = args.iter().any(|a| a == "--assume");
    args.retain(|a| a != "--assume");
    let mut cfg = RuntimeConfig::new();
    if assume {
        cfg.negotiation = Negotiation::Assume;
    }
    let rt = Runtime::new(cfg);
    let addr = args.get(1).map_or("127.0.0.1:7878", String::as_str);
    let r = match args.first().map(String::as_str) {
        Some("server") => server(&rt, addr).await,
        Some("client") => client(&rt, addr, args.get(2).map_or("hello", String::as_str)).await,
        _ => {
            eprintln!("usage: tokio_echo server|client [ADDR] [TEXT] [--assume]");
            std::process::exit(2);
        }
    };
    rt.shutdown();
    r
}

async fn server(rt: &Runtime, addr: &str) -> io::Result<()> {
    let listener = AsyncSmcListener::bind(rt, addr).await?;
    println!("listening on {}", listener.local_addr()?);
    loop {
        let (stream, peer) = listener.accept().await?;
        println!("{stream:?}");
        tokio::spawn(async move {
            let (mut r, mut w) = tokio::io::split(stream);
            let echoed = tokio::io::copy(&mut r, &mut w).await;
            let _ = w.shutdown().await;
            println!("{peer}: echoed {echoed:?} bytes");
        });
    }
}

async fn client(rt: &Runtime, addr: &str, text: &str) -> io::Result<()> {
    let mut stream = AsyncSmcStream::connect(rt, addr).await?;
    stream.set_nodelay(true)?;
    println!("{stream:?}");
    stream.write_all(text.as_bytes()).await?;
    stream.shutdown().await?;
    let mut back = String::new();
    stream.read_to_string(&mut back).await?;
    println!("echoed: {back}");
    Ok(())
}
