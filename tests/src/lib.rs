//! Test support: packet crafting, the in-kernel test harness, and (later) the lab.
pub mod kernel;
pub mod lab;
pub mod packet;
