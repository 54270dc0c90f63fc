//! The bench and soak harness behind the `bench` command: real applications (redis, iperf3,
//! sockperf, ...) under the shim against plain TCP in the same run ([`app_bench`]),
//! `SmcStream` against `TcpStream` across two namespaces ([`smc_bench`]), the long soak with
//! faults and a data check ([`soak`]), and the engine's XDP probe ([`xdp_bench`]).
//! docs/performance.md says what each measures and the last full run's figures.

pub mod app_bench;
pub mod smc_bench;
pub mod soak;
pub mod xdp_bench;
