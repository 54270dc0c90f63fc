//! The SMC-R protocol core (issue 4): CLC negotiation over the TCP connection, link groups and
//! links on the `rdma` engine, the RDMA WRITE data path with CDC cursor updates, close and
//! fallback to TCP, with a Rust socket API (`SmcStream`/`SmcListener`). Nothing here yet.
