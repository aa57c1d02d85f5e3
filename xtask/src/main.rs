//! Project tasks: `cargo xtask setup | build-ebpf | test | demo | bench | vm-test | fuzz | soak | links`.
//!
//! Everything is installed from Debian's packages and crates.io only (see docs/toolchain.md): Debian's
//! `rustc-web` ships a precompiled `core` for `bpfel-unknown-none`, so the eBPF crate builds
//! without rust-src or `-Z build-std`, and `bpf-linker` is built against Debian's LLVM 22.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

mod fuzz;
mod links;
mod parts;
mod vm;

const APT_PACKAGES: &[&str] = &[
    // eBPF toolchain
    "rustc-web",
    "libstd-rust-web-dev-bpf",
    "llvm-22-dev",
    // the lab and its checks
    "iproute2",
    "ethtool",
    "bpftool",
    // setpriv (privilege test), mount
    "util-linux",
    // sysctl inside lab namespaces
    "procps",
    // the netfilter proxy modes and the tools that check what they left behind
    "iptables",
    "nftables",
    "conntrack",
    // the ipvs mode's tools (its checks, and its masquerade sets)
    "ipvsadm",
    "ipset",
    // the benchmark's and the soak's PNG plots (their text)
    "fonts-dejavu-core",
    // libFuzzer, which libfuzzer-sys compiles for the fuzz targets (cargo xtask fuzz)
    "g++",
];
/// What `vm-test` needs besides (installed without recommends: qemu's would bring a GUI).
const VM_APT_PACKAGES: &[&str] = &["qemu-system-x86", "busybox-static", "kmod"];
const BPF_LINKER_VERSION: &str = "0.13.0";
const DEBIAN_RUSTC: &str = "/usr/bin/rustc";
const LLVM_PREFIX: &str = "/usr/lib/llvm-22";

#[derive(Parser)]
#[command(about = "Project tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install the eBPF toolchain and lab tools (idempotent).
    Setup,
    /// Build the eBPF object (proxy-ebpf) with Debian's rustc and bpf-linker.
    BuildEbpf,
    /// Everything CI checks: formatting, clippy, unit, in-kernel and lab tests, and the
    /// conformance suite in VMs running Debian's 6.1 and 5.10 (left out when a filter is
    /// given).
    Test {
        /// Every conformance and lifecycle row on each VM kernel, not the per-kernel choice
        /// CI runs (hours under emulation).
        #[arg(long)]
        full_matrix: bool,
        /// Extra arguments for `cargo test` (e.g. a test name filter).
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
    /// Run the agent on the demo manifests and show where traffic goes.
    Demo,
    /// Check that every relative link in README.md, CHANGELOG.md, BENCHMARKS.md and docs/
    /// resolves (part of `test`).
    Links,
    /// Every mode side by side (modebench: data plane, control plane, plots in
    /// target/modebench), then eBPF ns/packet and sync time per mode; `--quick`: a short
    /// modebench only. Other flags go to modebench (--modes, --services, --rounds, ...).
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The conformance suite in a VM running another kernel (Debian's, under qemu).
    VmTest {
        /// `debian-<major>.<minor>`, resolved through this host's `linux-image-amd64`.
        #[arg(long, default_value = "debian-6.1")]
        kernel: String,
        #[arg(long, default_value_t = 2)]
        cpus: u32,
        #[arg(long, default_value_t = 2048)]
        memory_mb: u32,
        /// Test name filters (default: the ebpf and ipvs modules).
        #[arg(trailing_var_arg = true)]
        filters: Vec<String>,
    },
    /// The libFuzzer targets in tests/fuzz (parsers of manifests, API objects, the config
    /// file, annotations, netlink replies, rule listings): built with coverage
    /// instrumentation, each run from its corpus; a crash fails and names its input.
    /// The agent in the two-node lab under churn (endpoint changes every 100 ms, Services
    /// added and removed, agent restarts) with traffic that must not fail, its RSS and
    /// descriptors sampled (target/soak: results.md, footprint.png). Flags go to the soak
    /// binary: --minutes (30), --modes (ebpf,nftables), --restart-minutes, --max-growth.
    Soak {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    Fuzz {
        /// How long each target runs.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// Targets run at once.
        #[arg(long, default_value_t = 1)]
        jobs: usize,
        /// Add the inputs that found new coverage to tests/fuzz/corpus.
        #[arg(long)]
        merge: bool,
        /// Targets (default: all).
        targets: Vec<String>,
    },
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.task {
        Task::Setup => setup(),
        Task::BuildEbpf => build_ebpf(),
        Task::Test { full_matrix, args } => test(&args, full_matrix),
        Task::Demo => demo(),
        Task::Links => {
            links::check(&root()).map(|n| step(&format!("links: {n} relative links resolve")))
        }
        Task::Bench { args } => bench(&args),
        Task::Soak { args } => soak(&args, true),
        Task::Fuzz {
            seconds,
            jobs,
            merge,
            targets,
        } => fuzz::fuzz(&fuzz::Options {
            seconds,
            jobs,
            merge,
            targets,
        }),
        Task::VmTest {
            kernel,
            cpus,
            memory_mb,
            filters,
        } => vm_setup().and_then(|()| {
            vm::vm_test(&vm::VmTest {
                kernel,
                payload: vm::Payload::Tests(if filters.is_empty() {
                    vm::DEFAULT_FILTERS.iter().map(|f| f.to_string()).collect()
                } else {
                    filters
                }),
                memory_mb,
                cpus,
                skips: Vec::new(),
            })
        }),
    };
    if let Err(e) = result {
        eprintln!("xtask: error: {e:#}");
        std::process::exit(1);
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn step(msg: &str) {
    println!("==> {msg}");
}

fn run(cmd: &mut Command) -> Result<()> {
    let shown = format!("{cmd:?}");
    let status = cmd.status().with_context(|| format!("starting {shown}"))?;
    if !status.success() {
        bail!("{shown} failed ({status})");
    }
    Ok(())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn missing_apt_packages() -> Vec<&'static str> {
    missing(APT_PACKAGES)
}

fn missing(packages: &[&'static str]) -> Vec<&'static str> {
    packages
        .iter()
        .copied()
        .filter(|p| {
            !Command::new("dpkg-query")
                .args(["-W", "-f=${Status}", p])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
                .unwrap_or(false)
        })
        .collect()
}

fn bpf_linker() -> Option<PathBuf> {
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))?;
    let p = cargo_home.join("bin/bpf-linker");
    p.exists().then_some(p)
}

fn toolchain_ready() -> bool {
    missing_apt_packages().is_empty() && bpf_linker().is_some()
}

fn setup() -> Result<()> {
    let missing = missing_apt_packages();
    if missing.is_empty() {
        step("setup: Debian packages already installed");
    } else {
        install_packages("setup", &missing, &[])?;
    }
    match bpf_linker() {
        Some(p) => step(&format!("setup: bpf-linker present ({})", p.display())),
        None => {
            step(&format!(
                "setup: building bpf-linker {BPF_LINKER_VERSION} from crates.io against LLVM 22 (a few minutes)"
            ));
            run(Command::new("cargo")
                .args(["install", "bpf-linker", "--version", BPF_LINKER_VERSION])
                .args(["--no-default-features", "--features", "llvm-22"])
                .env("LLVM_PREFIX", LLVM_PREFIX))?;
        }
    }
    step("setup: done");
    Ok(())
}

/// Installs the VM runner's packages (and the rest of the setup).
fn vm_setup() -> Result<()> {
    build_ebpf()?;
    let missing = missing(VM_APT_PACKAGES);
    if missing.is_empty() {
        return Ok(());
    }
    install_packages("vm-test", &missing, &["--no-install-recommends"])
}

/// `apt-get install`s `packages` (as root; otherwise says the command to run).
fn install_packages(task: &str, packages: &[&str], options: &[&str]) -> Result<()> {
    let command = ["apt-get install -y"]
        .iter()
        .chain(options)
        .chain(packages)
        .copied()
        .collect::<Vec<_>>()
        .join(" ");
    if !is_root() {
        bail!(
            "Debian packages missing: {}; run `sudo {command}` or run this as root",
            packages.join(" ")
        );
    }
    step(&format!(
        "{task}: installing Debian packages: {}",
        packages.join(" ")
    ));
    run(Command::new("apt-get").args(["update", "-qq"]))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq"])
        .args(options)
        .args(packages)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

fn ensure_setup() -> Result<()> {
    if !toolchain_ready() {
        setup()?;
    }
    Ok(())
}

fn build_ebpf() -> Result<()> {
    ensure_setup()?;
    step("build-ebpf: proxy-ebpf for bpfel-unknown-none (Debian rustc + bpf-linker)");
    let build = || {
        let mut cmd = Command::new("cargo");
        cmd.current_dir(root().join("proxy-ebpf"))
            .args(["build", "--release", "--locked"])
            .env("RUSTC", DEBIAN_RUSTC)
            // aya-ebpf uses asm_experimental_arch; allowed for this build only.
            .env("RUSTC_BOOTSTRAP", "1");
        for var in [
            "RUSTFLAGS",
            "CARGO_ENCODED_RUSTFLAGS",
            "CARGO_TARGET_DIR",
            "CARGO_BUILD_TARGET",
            "RUSTC_WRAPPER",
            "RUSTC_WORKSPACE_WRAPPER",
        ] {
            cmd.env_remove(var);
        }
        if let Some(home) = bpf_linker().and_then(|p| p.parent().map(Path::to_path_buf)) {
            let path = std::env::var("PATH").unwrap_or_default();
            cmd.env("PATH", format!("{}:{path}", home.display()));
        }
        cmd
    };
    run(&mut build())?;
    // The datapath for kernels without bpf_loop (the agent embeds both), and a
    // deliberately different build for the upgrade test.
    for feature in ["no-bpf-loop", "upgrade-test-variant"] {
        run(build()
            .args(["--features", feature, "--target-dir"])
            .arg(format!("target/{feature}")))?;
    }
    let object = ebpf_object();
    if !object.exists() {
        bail!("build-ebpf finished but {} is missing", object.display());
    }
    step(&format!("build-ebpf: {}", object.display()));
    Ok(())
}

fn ebpf_object() -> PathBuf {
    root().join("proxy-ebpf/target/bpfel-unknown-none/release/proxy-ebpf")
}

fn cargo(args: &[&str]) -> Command {
    let mut cmd = Command::new("cargo");
    cmd.current_dir(root()).args(args);
    cmd
}

/// The test modules named `safety` (floods, slow clients, two agents on one root).
const SAFETY_TESTS: &str = "safety::";
/// [W2-5]'s tests against the kernel: the benchmark smoke run (manifests, the replayed API
/// server, saturation) and the nftables netlink transactions compared with `nft`.
const SCALE_TESTS: &str = "scale::";
/// The conformance rows of the eBPF mode's second socket placements (hooks not above the
/// pods, `--socket-lb host-only`): the rows whose names end in `get_the_tc_path` /
/// `to_the_tc_path`.
const PLACEMENT_TESTS: &str = "_the_tc_path";
/// The conformance rows of `proxy-agent inspect` ([W2-7]), their own part: their names
/// start with `inspect_`.
const INSPECT_TESTS: &str = "::inspect_";
/// How long `test` runs each fuzz target (`cargo xtask fuzz` runs them longer).
const FUZZ_SECONDS_IN_TEST: u64 = 5;

fn test(extra: &[String], full_matrix: bool) -> Result<()> {
    let mut parts = parts::Parts::default();
    parts.start("test: build the eBPF object");
    build_ebpf()?;
    parts.start("test: cargo fmt --check, docs links, cargo clippy -D warnings");
    run(&mut cargo(&["fmt", "--all", "--", "--check"]))?;
    // The eBPF crate is its own workspace, which --all does not reach.
    run(&mut cargo(&[
        "fmt",
        "--manifest-path",
        "proxy-ebpf/Cargo.toml",
        "--",
        "--check",
    ]))?;
    let links = links::check(&root())?;
    step(&format!("test: docs links: {links} relative links resolve"));
    run(&mut cargo(&[
        "clippy",
        "--workspace",
        "--all-targets",
        "--quiet",
        "--",
        "-D",
        "warnings",
    ]))?;
    parts.start("test: unit, in-kernel and lab tests (and their build)");
    // Lab tests start the agent binary as a child process in a network namespace.
    run(&mut cargo(&["build", "--quiet", "-p", "proxy-agent"]))?;
    // Kernel tests must run, not skip, when this command runs them.
    let workspace_tests = |args: &[&str]| {
        let mut cmd = cargo(&["test", "--workspace"]);
        cmd.args(args).env("PROXY_REQUIRE_KERNEL_TESTS", "1");
        cmd
    };
    if extra.is_empty() {
        run(&mut workspace_tests(&[
            "--",
            "--skip",
            SAFETY_TESTS,
            "--skip",
            PLACEMENT_TESTS,
            "--skip",
            SCALE_TESTS,
            "--skip",
            INSPECT_TESTS,
        ]))?;
        // The pods' clients of the rows above run below the socket hooks, as the DaemonSet
        // places them; these rows check the placements where pods get the tc path ([W2-4]).
        parts.start("test: socket-hook placements where pods get the tc path (eBPF)");
        run(&mut workspace_tests(&[
            "--test",
            "conformance",
            PLACEMENT_TESTS,
        ]))?;
        // Their own part, so what [W2-7] added to a CI run shows on its own.
        parts.start("test: proxy-agent inspect in every mode (services, conntrack, trace, flows)");
        run(&mut workspace_tests(&[
            "--test",
            "conformance",
            INSPECT_TESTS,
        ]))?;
        // Their own part, so what [W2-2] added to a CI run shows on its own.
        parts.start("test: tenant and fault safety (floods, slow clients, two agents)");
        run(&mut workspace_tests(&[SAFETY_TESTS]))?;
        parts.start("test: the control plane at scale (bench smoke, nftables over netlink)");
        run(&mut workspace_tests(&[SCALE_TESTS]))?;
        // Every fuzz target builds and runs a little from its corpus ([W2-3]); the corpus and
        // past crashes also ran above, uninstrumented (tests/tests/fuzz_corpus.rs).
        parts.start("test: soak, 1 min per mode under churn (ebpf, nftables)");
        soak(
            &[
                "--minutes",
                "1",
                "--modes",
                "ebpf,nftables",
                "--restart-minutes",
                "0.4",
                // A minute is too short to judge growth in percent; this bounds it.
                "--max-growth",
                "25",
                "--out",
                "target/soak-test",
            ]
            .map(String::from),
            false,
        )?;
        parts.start("test: fuzz targets (instrumented build, then 5 s each)");
        fuzz::fuzz(&fuzz::Options {
            seconds: FUZZ_SECONDS_IN_TEST,
            jobs: 2,
            merge: false,
            targets: Vec::new(),
        })?;
    } else {
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        run(&mut workspace_tests(&extra))?;
    }
    if !extra.is_empty() {
        step("test: a filtered run: the VM suite is left out (cargo xtask vm-test runs it)");
        parts.report();
        return Ok(());
    }
    vm_setup()?;
    for (kernel, filters) in vm::ci_runs(full_matrix) {
        parts.start(&format!(
            "test: the conformance suite on {kernel}, in a VM ({})",
            if full_matrix {
                "every row"
            } else if kernel == "debian-6.1" {
                "the rows this host cannot run"
            } else {
                "every mode's essentials"
            }
        ));
        vm::vm_test(&vm::VmTest {
            kernel: kernel.into(),
            payload: vm::Payload::Tests(filters),
            memory_mb: 2048,
            cpus: 2,
            skips: if full_matrix || kernel != "debian-6.1" {
                Vec::new()
            } else {
                vm::CI_SKIPS_6_1.to_vec()
            },
        })?;
    }
    parts.start(
        "test: the benchmark in the VM, small (ipvs beside the baseline, drawn on this host)",
    );
    let out = root().join("target/vm-bench-smoke");
    let _ = std::fs::remove_dir_all(&out);
    bench_in_vm(
        &[
            "--modes",
            "ipvs",
            "--services",
            "1",
            "--rounds",
            "1",
            "--seconds",
            "0.2",
            "--serve-timeout",
            "120",
        ],
        &out,
        false,
    )?;
    for file in [
        "results.json",
        "results.md",
        "connections.svg",
        "connections.png",
    ] {
        if !out.join(file).is_file() {
            bail!("the VM benchmark wrote no {file}");
        }
    }
    let table = std::fs::read_to_string(out.join("results.md"))?;
    if !table.lines().any(|l| l.starts_with("| ipvs | 1 |")) {
        bail!("the VM benchmark's table has no ipvs row:\n{table}");
    }
    parts.report();
    Ok(())
}

/// modebench in the VM runner (Debian's 6.1: the host's modes and ipvs), into `out`.
fn bench_in_vm(args: &[&str], out: &Path, release: bool) -> Result<()> {
    vm_setup()?;
    vm::vm_test(&vm::VmTest {
        kernel: "debian-6.1".into(),
        payload: vm::Payload::Bench {
            args: args.iter().map(|a| a.to_string()).collect(),
            out: out.to_path_buf(),
            release,
        },
        memory_mb: 2048,
        cpus: 2,
        skips: Vec::new(),
    })
}

fn demo() -> Result<()> {
    build_ebpf()?;
    step("demo: building the agent and the lab");
    run(&mut cargo(&[
        "build",
        "--quiet",
        "-p",
        "proxy-agent",
        "-p",
        "proxy-tests",
        "--bins",
    ]))?;
    run(&mut cargo(&[
        "run",
        "--quiet",
        "-p",
        "proxy-tests",
        "--bin",
        "demo",
        "--",
    ]))
}

/// `cargo run --release` of one of proxy-tests' binaries.
fn release_bin(name: &str) -> Command {
    cargo(&[
        "run",
        "--release",
        "--quiet",
        "-p",
        "proxy-tests",
        "--bin",
        name,
        "--",
    ])
}

/// `cargo xtask bench [--quick | --host | --vm] [modebench flags]`.
/// The soak binary (tests/src/bin/soak.rs) with `args`, after building the agent it starts;
/// `release`: both optimised, as shipped (the test suite's short soak uses its debug build).
fn soak(args: &[String], release: bool) -> Result<()> {
    build_ebpf()?;
    let profile: &[&str] = if release { &["--release"] } else { &[] };
    let mut build = cargo(&["build", "--quiet", "-p", "proxy-agent"]);
    build.args(profile);
    run(&mut build)?;
    let mut soak = cargo(&["run", "--quiet", "-p", "proxy-tests", "--bin", "soak"]);
    soak.args(profile).arg("--").args(args);
    run(&mut soak)
}

fn bench(extra: &[String]) -> Result<()> {
    let has = |flag: &str| extra.iter().any(|a| a == flag);
    let (host, in_vm) = match (has("--host"), has("--vm"), has("--quick")) {
        (true, true, _) => bail!("bench: --host and --vm together are the default (neither)"),
        (_, _, true) => (true, false),
        (true, false, _) => (true, false),
        (false, true, _) => (false, true),
        (false, false, _) => (true, true),
    };
    let flags: Vec<&str> = extra
        .iter()
        .map(String::as_str)
        .filter(|a| !matches!(*a, "--host" | "--vm"))
        .collect();
    build_ebpf()?;
    run(&mut cargo(&[
        "build",
        "--release",
        "--quiet",
        "-p",
        "proxy-agent",
    ]))?;
    if host {
        step("bench: every mode side by side (modebench; target/modebench/results.md)");
        run(release_bin("modebench").args(&flags))?;
        if has("--quick") {
            return Ok(());
        }
        step("bench: datapath ns/packet (BPF_PROG_TEST_RUN; target/modebench/per-packet.md)");
        run(release_bin("bench").args(["--out", "target/modebench/per-packet.md"]))?;
    }
    if in_vm {
        step("bench: every mode again, ipvs included, in the VM (target/modebench/vm/results.md)");
        // Software emulation: fewer services by default (flags given here replace them).
        let mut vm_flags = if has("--services") {
            vec![]
        } else {
            vec!["--services", "1,100,1000"]
        };
        let mut it = flags.iter().copied();
        while let Some(flag) = it.next() {
            if flag == "--out" {
                it.next(); // the VM's results go to target/modebench/vm
            } else {
                vm_flags.push(flag);
            }
        }
        bench_in_vm(&vm_flags, &root().join("target/modebench/vm"), true)?;
    }
    Ok(())
}
