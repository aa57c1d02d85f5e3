//! Loading the real datapath into the running kernel for `BPF_PROG_TEST_RUN` tests and
//! benchmarks.

use std::net::{SocketAddr, SocketAddrV4};

use anyhow::{Context, Result};
use aya::{
    programs::{TestRun, TestRunOptions},
    TestRunResult,
};
use proxy_agent::{
    datapath::{Datapath, DatapathSizes, LoadOptions},
    model::Frontend,
    proxier::ebpf::{
        maps::KernelMaps,
        sync::{FrontendSpec, HeaderSettings, MapSync},
    },
};
use proxy_common::program_names;

/// tc verdicts as the classifier returns them.
pub const TC_ACT_UNSPEC: i32 = -1;
pub const TC_ACT_SHOT: i32 = 2;
pub const TC_ACT_REDIRECT: i32 = 7;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hook {
    Ingress,
    Egress,
}

impl Hook {
    fn program(self) -> &'static str {
        match self {
            Hook::Ingress => program_names::TC_INGRESS,
            Hook::Egress => program_names::TC_EGRESS,
        }
    }
}

/// Why kernel tests cannot run here, if they cannot. `cargo xtask test` sets
/// `PROXY_REQUIRE_KERNEL_TESTS=1`, which turns every such skip into a failure, so CI never
/// passes by skipping.
/// This kernel's (major, minor) version, for tests that depend on a feature's version.
pub fn kernel_version() -> (u32, u32) {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut numbers = release
        .split(|c: char| !c.is_ascii_digit())
        .map(|n| n.parse().unwrap_or(0));
    (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0))
}

pub fn kernel_tests_unavailable() -> Option<String> {
    let reason = if !Datapath::object_available() {
        Some("the eBPF object is not built (run `cargo xtask test`, which builds it)".to_string())
    } else if unsafe { libc::geteuid() } != 0 {
        Some("loading BPF programs needs root (CAP_BPF, CAP_NET_ADMIN)".to_string())
    } else {
        None
    };
    if let Some(r) = &reason {
        if std::env::var_os("PROXY_REQUIRE_KERNEL_TESTS").is_some() {
            panic!("kernel tests required but cannot run: {r}");
        }
    }
    reason
}

/// Skips the calling test with a reason when the kernel datapath is unavailable.
#[macro_export]
macro_rules! require_kernel {
    () => {
        if let Some(reason) = $crate::kernel::kernel_tests_unavailable() {
            eprintln!("skipped: {reason}");
            return;
        }
    };
}

/// The datapath loaded into the kernel, not attached anywhere, driven by test packets.
pub struct TestDatapath {
    pub datapath: Datapath,
    pub sync: MapSync<KernelMaps>,
}

impl TestDatapath {
    pub fn load(sizes: DatapathSizes) -> Result<Self> {
        Self::load_with(sizes, LoadOptions::default())
    }

    pub fn load_with(sizes: DatapathSizes, options: LoadOptions) -> Result<Self> {
        let mut datapath = Datapath::load_with(sizes, None, options)?;
        let maps = KernelMaps::take(&mut datapath)?;
        Ok(Self {
            datapath,
            sync: MapSync::new(maps),
        })
    }

    pub fn set_service(&mut self, frontend: Frontend, backends: &[SocketAddrV4]) -> Result<()> {
        let backends: Vec<SocketAddr> = backends.iter().map(|b| SocketAddr::V4(*b)).collect();
        self.sync
            .set(frontend, &backends)
            .with_context(|| format!("programming {frontend}"))?;
        Ok(())
    }

    /// Like [`TestDatapath::set_service`], with header settings (flags, affinity) and the
    /// backends that are on other nodes.
    pub fn set_service_with(
        &mut self,
        frontend: Frontend,
        backends: &[SocketAddrV4],
        header: HeaderSettings,
        remote: &[SocketAddrV4],
    ) -> Result<()> {
        let remote = remote.iter().map(|b| SocketAddr::V4(*b)).collect();
        let backends: Vec<SocketAddr> = backends.iter().map(|b| SocketAddr::V4(*b)).collect();
        let spec = FrontendSpec {
            header,
            remote: &remote,
            ..FrontendSpec::new(&backends)
        };
        self.sync
            .set_with(frontend, &spec)
            .with_context(|| format!("programming {frontend}"))?;
        Ok(())
    }

    fn test_run(&self, hook: Hook, frame: &[u8], repeat: u32) -> Result<(TestRunResult, Vec<u8>)> {
        let prog = self.datapath.program(hook.program())?;
        let mut out = vec![0u8; frame.len() + 256];
        let result = prog
            .test_run(TestRunOptions {
                data_in: Some(frame),
                data_out: Some(&mut out),
                repeat,
                ..TestRunOptions::default()
            })
            .context("BPF_PROG_TEST_RUN")?;
        out.truncate(result.data_size_out as usize);
        Ok((result, out))
    }

    /// Runs one frame through the classifier; returns the verdict and the frame as it
    /// leaves the program.
    pub fn run(&self, hook: Hook, frame: &[u8]) -> Result<(i32, Vec<u8>)> {
        let (result, out) = self.test_run(hook, frame, 1)?;
        Ok((result.return_value as i32, out))
    }

    /// Like [`TestDatapath::run`], with the kernel's time for the run in ns.
    pub fn run_timed(&self, hook: Hook, frame: &[u8]) -> Result<(i32, Vec<u8>, f64)> {
        let (result, out) = self.test_run(hook, frame, 1)?;
        Ok((
            result.return_value as i32,
            out,
            result.duration.as_nanos() as f64,
        ))
    }

    /// Runs `frame` `repeat` times in the kernel; returns the mean ns per run as the kernel
    /// measured it.
    pub fn time(&self, hook: Hook, frame: &[u8], repeat: u32) -> Result<f64> {
        let (result, _) = self.test_run(hook, frame, repeat)?;
        Ok(result.duration.as_nanos() as f64)
    }
}
