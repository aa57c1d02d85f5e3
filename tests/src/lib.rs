//! Test support: the replayed API server, packet crafting, the in-kernel test harness, the one-node lab and the
//! two-node cluster lab.
pub mod apiserver;
pub mod bench;
pub mod client;
pub mod cluster;
pub mod kernel;
pub mod lab;
pub mod packet;

/// `d` stretched for a slower machine: `PROXY_TEST_TIME_SCALE` (the VM runner sets it, as
/// software emulation runs the kernel several times slower); 1 when unset.
pub fn scaled(d: std::time::Duration) -> std::time::Duration {
    let scale = std::env::var("PROXY_TEST_TIME_SCALE")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| *s >= 1.0)
        .unwrap_or(1.0);
    d.mul_f64(scale)
}
