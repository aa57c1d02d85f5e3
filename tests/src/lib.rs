//! Test support: packet crafting, the in-kernel test harness, the one-node lab and the
//! two-node cluster lab.
pub mod cluster;
pub mod kernel;
pub mod lab;
pub mod packet;
