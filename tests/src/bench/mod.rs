//! The mode comparison benchmark (`cargo xtask bench`, the `modebench` binary): load
//! generators that run in the lab's client pod ([`load`]), and the table ([`report`]) and plots
//! ([`plots`]) built from their raw samples.

pub mod load;
pub mod plots;
pub mod report;
