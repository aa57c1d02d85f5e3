//! `cargo xtask vm-test --kernel debian-6.1`: the conformance suite on a kernel this machine
//! does not run (IPVS, SCTP, the dummy driver, and tc attachment without TCX).
//!
//! The kernel is Debian's, resolved through the `linux-image-amd64` metapackage (never a
//! pinned ABI name) of this host's apt sources, or, for another release's kernel (5.10:
//! bullseye), of a private apt configuration under `target/vm/apt/`; fetched with
//! `apt-get download` and unpacked under `target/vm/<kernel>/`. It boots under `qemu-system-x86_64` with a small
//! initramfs (busybox and the virtio/9p modules); the init mounts this host's root read-only
//! over 9p, chroots into it — so iproute2, iptables with its run-time extensions, nft,
//! ipvsadm, the agent and the test binaries are the host's own — and loads every other
//! module on demand with the host's `modprobe` pointed at the unpacked kernel's tree. The
//! test binary's output comes back over the serial console; each test's result is listed,
//! and a failure makes the command fail.

use std::{
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use crate::{cargo, root, run, step};

/// What the init prints when the VM has booted far enough to run anything.
const BOOTED: &str = "VMTEST-BOOTED";
/// What the init prints after the tests, with their exit code.
const EXIT: &str = "VMTEST-EXIT=";
/// Around the benchmark's results.json on the console (the host's root is read-only).
const RESULTS_BEGIN: &str = "VMBENCH-RESULTS-BEGIN";
const RESULTS_END: &str = "VMBENCH-RESULTS-END";

/// Modules the tests need before anything asks for them (the rest load on demand through
/// the kernel's modprobe helper).
const PRELOAD: &[&str] = &[
    "veth",
    "dummy",
    "sctp",
    "nf_conntrack",
    "nf_nat",
    "nf_tables",
    "nft_chain_nat",
    "ip_tables",
    "ip6_tables",
    "iptable_nat",
    "iptable_filter",
    "ip6table_nat",
    "ip6table_filter",
    "ip_vs",
    "ip_vs_rr",
    "ip_set",
    "ip_set_hash_ipport",
    "ip_set_hash_ipportip",
    "xt_set",
    "cls_bpf",
    "sch_ingress",
];

/// What runs in the VM: the conformance rows of the modes this host cannot run (ipvs) and
/// of the eBPF mode on a kernel without TCX, the SCTP rows of every mode (this host's
/// kernel has no SCTP), and the lifecycle test switching to and from ipvs. A filter
/// `lifecycle::<f>`, `datapath::<f>` or `observe::<f>` selects from those suites, any other
/// from the conformance suite.
pub const DEFAULT_FILTERS: &[&str] = &["ebpf::", "ipvs::", "sctp_", "lifecycle::ipvs"];

/// What `cargo xtask test` runs on Debian 11's 5.10: every mode's essentials (a `::name`
/// filter matches that row of every mode, not its `ipv6_` sibling) and the mode switches.
/// `cargo xtask test --full-matrix` runs [`FULL_MATRIX`] there instead.
pub const ESSENTIALS: &[&str] = &[
    "::cluster_ip_tcp_and_udp_reach_backends_on_both_nodes",
    "::node_port_reaches_every_backend_from_outside",
    "::service_without_endpoints_is_refused",
    "::session_affinity_client_ip",
    "::schedulers_chosen_by_annotation",
    "lifecycle::switching",
    "observe::auto_mode",
];

/// The in-kernel test `cargo xtask test` runs on every VM kernel: what its verifier loads,
/// and how close to its limits.
pub const IN_KERNEL_TESTS: &[&str] = &["datapath::verifier"];

/// The in-kernel (`BPF_PROG_TEST_RUN`) tests of the schedulers that scan with `bpf_loop`,
/// and of wrr, whose search 6.1's verifier once could not afford, run on 6.1: verifiers
/// before 6.7 make less of a `bpf_loop` step, and lc and lblcr chose wrongly there while
/// this host's tests passed (5.10 has no `bpf_loop`: its build scans in bounded loops).
pub const BPF_LOOP_SCHEDULER_TESTS: &[&str] = &[
    "datapath::wrr_",
    "datapath::lc_sends",
    "datapath::wlc_sed",
    "datapath::lblc",
];

/// Rows `cargo xtask test` leaves out of the VM run on 6.1 (not `--full-matrix`), with the
/// reason the run prints.
pub const CI_SKIPS_6_1: &[(&str, &str)] = &[(
    "ebpf::inspect_",
    "the host runs them; `inspect` reads the same maps and kernel interfaces over either attachment (--full-matrix runs them)",
)];

/// Every row of the conformance, lifecycle and in-kernel suites (`--full-matrix`).
pub const FULL_MATRIX: &[&str] = &["", "lifecycle::", "datapath::", "observe::auto_mode"];

/// The kernels `cargo xtask test` runs in the VM, with their filters.
pub fn ci_runs(full_matrix: bool) -> Vec<(&'static str, Vec<String>)> {
    let filters = |f: &[&[&str]]| f.concat().iter().map(|f| f.to_string()).collect();
    if full_matrix {
        vec![
            ("debian-6.1", filters(&[FULL_MATRIX])),
            ("debian-5.10", filters(&[FULL_MATRIX])),
        ]
    } else {
        vec![
            (
                "debian-6.1",
                filters(&[DEFAULT_FILTERS, IN_KERNEL_TESTS, BPF_LOOP_SCHEDULER_TESTS]),
            ),
            ("debian-5.10", filters(&[ESSENTIALS, IN_KERNEL_TESTS])),
        ]
    }
}

/// The test binaries the VM can run, by the prefix that routes a filter to them.
const SUITES: &[&str] = &["conformance", "lifecycle", "datapath", "observe"];

/// `filters` by suite: (suite, its filters), in [`SUITES`] order, only suites with some.
fn filters_by_suite(filters: &[String]) -> Vec<(&'static str, Vec<String>)> {
    SUITES
        .iter()
        .filter_map(|&suite| {
            let mine: Vec<String> = filters
                .iter()
                .filter_map(|f| match f.split_once("::") {
                    Some((prefix, rest)) if prefix == suite && suite != "conformance" => {
                        Some(rest.to_string())
                    }
                    _ if suite == "conformance"
                        && !SUITES[1..].iter().any(|s| f.starts_with(&format!("{s}::"))) =>
                    {
                        Some(f.clone())
                    }
                    _ => None,
                })
                .collect();
            (!mine.is_empty()).then_some((suite, mine))
        })
        .collect()
}

/// Rows skipped per kernel, with the reason (printed, never silent).
fn skipped_rows(kernel: &str) -> Vec<(&'static str, &'static str)> {
    match kernel {
        "debian-5.10" => vec![
            (
                "ebpf::the_node_itself_reaches_cluster_ips",
                NODE_COOKIE_BEFORE_5_14,
            ),
            (
                "ebpf::udp_flow_moves_to_a_live_backend",
                NODE_COOKIE_BEFORE_5_14,
            ),
            ("ebpf::socket_lb_host_only", NODE_COOKIE_BEFORE_5_14),
            (
                "ebpf::pods_outside_the_hooks_short_circuit",
                NODE_COOKIE_BEFORE_5_14,
            ),
        ],
        _ => Vec::new(),
    }
}

/// Agent flags per kernel.
fn agent_args(kernel: &str) -> &'static str {
    match kernel {
        // kube-proxy's nftables mode needs 5.13; the VM runs it anyway, as its check allows.
        "debian-5.10" => "--nftables-skip-kernel-version-check",
        _ => "",
    }
}

/// eBPF map sizes of the agents the VM's tests start (the benchmark keeps the defaults).
/// The rows use a handful of services, and under emulation creating the default maps
/// (262 144 entries each; a per-CPU array allocates element by element) costs seconds of
/// every agent start; the host's runs test the defaults.
const TEST_MAP_SIZES: &str =
    "--services-map-size 16384 --backends-map-size 16384 --conntrack-map-size 65536";

const NODE_COOKIE_BEFORE_5_14: &str = "before 5.14 the agent cannot read its network namespace's cookie (SO_NETNS_COOKIE), so the socket hooks take the initial namespace as the node's: right on a real node, where the agent runs in the host's, not in the lab, whose nodes are namespaces, so these rows' node processes count as pods";

/// What the VM runs.
pub enum Payload {
    /// Test name filters of the conformance and lifecycle suites.
    Tests(Vec<String>),
    /// modebench with these flags (the host's modes' comparison, with ipvs); its
    /// results.json comes back over the console into `out`, where the host draws the table
    /// and plots. `release`: the optimised agent and benchmark (a full run), else the
    /// debug builds the tests already made (a smoke run).
    Bench {
        args: Vec<String>,
        out: PathBuf,
        release: bool,
    },
}

pub struct VmTest {
    pub kernel: String,
    pub payload: Payload,
    pub memory_mb: u32,
    pub cpus: u32,
    /// Rows skipped besides the kernel's own ([`skipped_rows`]), with the reason.
    pub skips: Vec<(&'static str, &'static str)>,
}

pub fn vm_test(opts: &VmTest) -> Result<()> {
    let series = opts
        .kernel
        .strip_prefix("debian-")
        .with_context(|| format!("--kernel {}: expected debian-<major>.<minor>", opts.kernel))?;
    let dir = root().join("target/vm").join(&opts.kernel);
    std::fs::create_dir_all(&dir)?;
    let (release, apt) = resolve_kernel(series)?;
    let unpacked = fetch_kernel(&dir, &release, &apt)?;
    let initramfs = build_initramfs(&dir, &unpacked, &release)?;
    let vmlinuz = unpacked.join(format!("boot/vmlinuz-{release}"));

    let accel = accelerator(&vmlinuz, &initramfs);
    let mut skipped = skipped_rows(&opts.kernel);
    skipped.extend(opts.skips.iter().copied());
    let (script_text, what) = match &opts.payload {
        Payload::Tests(filters) => {
            step("vm-test: building the agent and the test suites");
            run(&mut cargo(&["build", "--quiet", "-p", "proxy-agent"]))?;
            let mut suites = Vec::new();
            for (suite, filters) in filters_by_suite(filters) {
                suites.push((test_binary(suite)?, filters));
            }
            for (pattern, reason) in &skipped {
                step(&format!(
                    "vm-test: skipping rows matching {pattern:?}: {reason}"
                ));
            }
            let args = format!("{} {TEST_MAP_SIZES}", agent_args(&opts.kernel));
            (run_script(&suites, &skipped, &args), filters.join(" "))
        }
        Payload::Bench {
            args,
            release: optimised,
            ..
        } => {
            step("vm-bench: building the agent and modebench");
            let profile: &[&str] = if *optimised { &["--release"] } else { &[] };
            run(cargo(&["build", "--quiet", "-p", "proxy-agent"]).args(profile))?;
            run(cargo(&[
                "build",
                "--quiet",
                "-p",
                "proxy-tests",
                "--bin",
                "modebench",
            ])
            .args(profile))?;
            let environment = format!(
                "VM: Debian {release} under qemu ({accel}, {} CPUs)",
                opts.cpus
            );
            (
                bench_script(args, *optimised, &environment, agent_args(&opts.kernel)),
                format!("modebench {}", args.join(" ")),
            )
        }
    };
    let script = dir.join("run.sh");
    std::fs::write(&script, script_text)?;

    step(&format!(
        "vm: booting Debian's {release} under qemu ({accel}, {} CPUs, {} MiB): {}",
        opts.cpus, opts.memory_mb, what
    ));
    let append = format!(
        "console=ttyS0 panic=-1 quiet loglevel=3 vmtest.script={} vmtest.modroot={} vmtest.workspace={}",
        script.display(),
        unpacked.display(),
        root().display()
    );
    let mut child = qemu(&vmlinuz, &initramfs, &append, accel, opts)
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .context("starting qemu-system-x86_64 (Debian package qemu-system-x86)")?;
    let mut results = Vec::new();
    let mut exit = None;
    let mut booted = false;
    let mut results_json: Option<String> = None;
    let mut in_results = false;
    let out = std::io::stdout();
    for line in BufReader::new(child.stdout.take().expect("piped")).lines() {
        let line = line.unwrap_or_default();
        let line = line.trim_end_matches('\r');
        if line.contains(BOOTED) {
            booted = true;
        }
        if line == RESULTS_BEGIN {
            in_results = true;
            results_json = Some(String::new());
            continue;
        }
        if line == RESULTS_END {
            in_results = false;
            continue;
        }
        if in_results {
            if let Some(json) = &mut results_json {
                json.push_str(line);
                json.push('\n');
            }
            continue;
        }
        if let Some(code) = line.split(EXIT).nth(1) {
            exit = code.trim().parse::<i32>().ok();
        }
        if let Some(r) = TestResult::parse(line) {
            results.push(r);
        }
        let _ = writeln!(out.lock(), "vm | {line}");
    }
    let status = child.wait()?;
    if let Payload::Bench { out, release, .. } = &opts.payload {
        // The table and plots are drawn here from the samples, whatever the exit code:
        // what was measured is kept.
        if let Some(json) = results_json.filter(|j| !j.trim().is_empty()) {
            std::fs::create_dir_all(out)?;
            std::fs::write(out.join("results.json"), json)?;
            let profile = if *release { "release" } else { "debug" };
            run(
                Command::new(root().join("target").join(profile).join("modebench"))
                    .arg("--render")
                    .arg("--out")
                    .arg(out),
            )
            .context("drawing the VM run's table and plots")?;
            step(&format!("vm-bench: {}", out.join("results.md").display()));
        } else if booted {
            bail!("vm-bench: the VM returned no results (see modebench's output above)");
        }
    } else {
        report(&results);
    }
    match exit {
        Some(0) => {
            step(&format!("vm: {}: passed", opts.kernel));
            Ok(())
        }
        Some(code) => bail!("vm: {}: the run failed (exit {code})", opts.kernel),
        None if !booted => bail!("vm-test: the VM did not boot (qemu: {status})"),
        None => bail!("vm-test: the VM stopped before the suite finished (qemu: {status})"),
    }
}

/// Debian's release whose `linux-image-amd64` is kernel series `series`.
fn debian_suite(series: &str) -> Option<&'static str> {
    match series {
        "5.10" => Some("bullseye"),
        "6.1" => Some("bookworm"),
        "6.12" => Some("trixie"),
        _ => None,
    }
}

/// Where apt finds a kernel series: this host's own sources when they resolve
/// `linux-image-amd64` to it, else a private configuration for the Debian release that
/// ships it (its own sources list, package lists and cache under `target/vm/apt/<suite>`;
/// the host's apt state is untouched). The options go before every apt command.
struct Apt {
    options: Vec<String>,
}

impl Apt {
    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.args(&self.options);
        c
    }

    /// `linux-image-amd64`'s kernel, if these sources have it.
    fn kernel(&self) -> Result<Option<String>> {
        let out = self
            .command("apt-cache")
            .args(["depends", "linux-image-amd64"])
            .output()
            .context("apt-cache (this runner needs Debian's apt)")?;
        let text = String::from_utf8_lossy(&out.stdout);
        Ok(text
            .lines()
            .filter_map(|l| l.trim().strip_prefix("Depends: linux-image-"))
            .map(str::to_string)
            .next())
    }

    /// A private configuration for Debian `suite` (and its security updates), its package
    /// lists fetched once a day.
    fn private(suite: &str) -> Result<Apt> {
        let dir = root().join("target/vm/apt").join(suite);
        for sub in ["lists/partial", "cache/archives/partial", "parts"] {
            std::fs::create_dir_all(dir.join(sub))?;
        }
        let list = dir.join("sources.list");
        let keyring = "/usr/share/keyrings/debian-archive-keyring.gpg";
        std::fs::write(
            &list,
            format!(
                "deb [signed-by={keyring}] http://deb.debian.org/debian {suite} main\n\
                 deb [signed-by={keyring}] http://deb.debian.org/debian-security {suite}-security main\n"
            ),
        )?;
        let path = |p: &Path| p.display().to_string();
        let apt = Apt {
            options: vec![
                "-o".into(),
                format!("Dir::Etc::SourceList={}", path(&list)),
                "-o".into(),
                format!("Dir::Etc::SourceParts={}", path(&dir.join("parts"))),
                "-o".into(),
                format!("Dir::State::Lists={}", path(&dir.join("lists"))),
                "-o".into(),
                format!("Dir::Cache={}", path(&dir.join("cache"))),
                // The host's installed packages are not this release's business.
                "-o".into(),
                "Dir::State::status=/dev/null".into(),
            ],
        };
        let stamp = dir.join("lists/updated");
        let fresh = std::fs::metadata(&stamp)
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().unwrap_or_default() < Duration::from_secs(86_400));
        if !fresh {
            step(&format!(
                "vm-test: apt-get update for Debian {suite} (private lists)"
            ));
            let out = apt
                .command("apt-get")
                .args(["update", "-qq"])
                .output()
                .context("apt-get")?;
            let err = String::from_utf8_lossy(&out.stderr);
            if !out.status.success() || err.contains("does not have a Release file") {
                bail!(
                    "Debian {suite}'s package lists could not be fetched from deb.debian.org (is the release still served there, or only by archive.debian.org?): {}",
                    err.trim()
                );
            }
            std::fs::write(&stamp, b"")?;
        }
        Ok(apt)
    }
}

/// The Debian kernel of `series` (`major.minor`) and the apt that fetches it.
fn resolve_kernel(series: &str) -> Result<(String, Apt)> {
    let host = Apt {
        options: Vec::new(),
    };
    let on_host = host.kernel()?;
    if let Some(release) = on_host
        .as_ref()
        .filter(|r| r.starts_with(&format!("{series}.")))
    {
        return Ok((release.clone(), host));
    }
    let Some(suite) = debian_suite(series) else {
        bail!(
            "no Debian release is known to ship a {series} kernel (known: 5.10 bullseye, 6.1 bookworm, 6.12 trixie; older releases are only on archive.debian.org){}",
            on_host.map(|r| format!("; this host's sources have {r}")).unwrap_or_default()
        );
    };
    let apt = Apt::private(suite)?;
    let release = apt
        .kernel()?
        .with_context(|| format!("Debian {suite}'s lists name no linux-image-amd64 kernel"))?;
    if !release.starts_with(&format!("{series}.")) {
        bail!("Debian {suite}'s linux-image-amd64 is {release}, not a {series} kernel");
    }
    Ok((release, apt))
}

/// Downloads and unpacks the kernel package once; returns the unpacked tree.
fn fetch_kernel(dir: &Path, release: &str, apt: &Apt) -> Result<PathBuf> {
    let unpacked = dir.join("root");
    let vmlinuz = unpacked.join(format!("boot/vmlinuz-{release}"));
    if vmlinuz.exists() {
        step(&format!("vm-test: kernel {release} already unpacked"));
    } else {
        step(&format!("vm-test: apt-get download linux-image-{release}"));
        let package = format!("linux-image-{release}");
        run(apt
            .command("apt-get")
            .args(["download", "-qq", &package])
            .current_dir(dir))?;
        let deb = std::fs::read_dir(dir)?
            .flatten()
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(&format!("{package}_")))
            })
            .context("apt-get download left no package")?;
        let _ = std::fs::remove_dir_all(&unpacked);
        run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&unpacked))?;
        std::fs::remove_file(&deb)?;
    }
    // modules.dep for `modprobe -d` inside the VM.
    run(Command::new("depmod").arg("-b").arg(&unpacked).arg(release))?;
    Ok(unpacked)
}

/// The initramfs: busybox, the modules that reach the 9p share, and the init.
fn build_initramfs(dir: &Path, unpacked: &Path, release: &str) -> Result<PathBuf> {
    let mut modules = Vec::new();
    for module in ["virtio_pci", "9pnet_virtio", "9p"] {
        let out = Command::new("modprobe")
            .arg("-d")
            .arg(unpacked)
            .args(["-S", release, "--show-depends", module])
            .output()
            .context("modprobe (Debian package kmod)")?;
        if !out.status.success() {
            bail!(
                "resolving the modules of {module}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if let Some(path) = line.strip_prefix("insmod ") {
                let path = PathBuf::from(path.trim());
                if !modules.contains(&path) {
                    modules.push(path);
                }
            }
        }
    }
    let busybox = Path::new("/bin/busybox");
    if !busybox.exists() {
        bail!("/bin/busybox is missing (Debian package busybox-static)");
    }
    let mut archive = Cpio::default();
    for d in ["bin", "dev", "proc", "sys", "mnt", "host", "modules"] {
        archive.dir(d);
    }
    archive.file("bin/busybox", &std::fs::read(busybox)?, 0o755);
    let mut order = String::new();
    for m in &modules {
        let name = m.file_name().expect("a module file").to_string_lossy();
        archive.file(&format!("modules/{name}"), &std::fs::read(m)?, 0o644);
        order.push_str(&name);
        order.push('\n');
    }
    archive.file("modules/order", order.as_bytes(), 0o644);
    archive.file("init", init_script().as_bytes(), 0o755);
    archive.file("modprobe", MODPROBE_HELPER.as_bytes(), 0o755);
    let path = dir.join("initramfs.cpio");
    std::fs::write(&path, archive.finish())?;
    Ok(path)
}

/// The kernel's modprobe helper: the host's modprobe, in the chroot, on the unpacked tree.
const MODPROBE_HELPER: &str = "#!/bin/busybox sh
exec /bin/busybox chroot /mnt /sbin/modprobe -d \"$(cat /modroot)\" \"$@\"
";

fn init_script() -> String {
    format!(
        r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules/order); do insmod /modules/$m || echo "insmod $m failed"; done
for x in $(cat /proc/cmdline); do
  case "$x" in
    vmtest.script=*) script="${{x#*=}}" ;;
    vmtest.modroot=*) modroot="${{x#*=}}" ;;
    vmtest.workspace=*) workspace="${{x#*=}}" ;;
    vmtest.probe) echo {BOOTED}; poweroff -f ;;
  esac
done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=512000 hostroot /mnt || {{ echo "mounting the host root over 9p failed"; poweroff -f; }}
echo {BOOTED}
# The host's root as it is, without the tmpfs below: a workspace under /tmp stays visible.
mount -o bind /mnt /host
mount -o bind /proc /mnt/proc
mount -o bind /sys /mnt/sys
mount -o bind /dev /mnt/dev
mkdir -p /dev/pts && mount -t devpts devpts /mnt/dev/pts
mount -t tmpfs tmp /mnt/tmp
case "$workspace" in
  /tmp/*) mkdir -p "/mnt$workspace" && mount -o bind "/host$workspace" "/mnt$workspace" ;;
esac
mount -t tmpfs run /mnt/run
mount -t tmpfs vartmp /mnt/var/tmp
mount -t cgroup2 cgroup2 /mnt/sys/fs/cgroup
echo "$modroot" > /modroot
echo /modprobe > /proc/sys/kernel/modprobe
chroot /mnt /sbin/modprobe -d "$modroot" -a {preload} || echo "preloading modules failed"
chroot /mnt /bin/sh "$script"
echo "{EXIT}$?"
poweroff -f
"#,
        preload = PRELOAD.join(" ")
    )
}

/// The script the VM runs in the chroot: each suite's binary with its filters, the kernel
/// tests required to run; the exit status is the first failure's. Ignored tests run too:
/// the ipvs tests are ignored on hosts without IPVS and meant for here; a row a mode cannot
/// run only prints its reason.
fn run_script(
    suites: &[(PathBuf, Vec<String>)],
    skipped: &[(&str, &str)],
    agent_args: &str,
) -> String {
    let root = root();
    let skips: String = skipped
        .iter()
        .map(|(pattern, _)| format!(" --skip {pattern}"))
        .collect();
    // The tests' own output (figures such as the mode-switch gaps) with PROXY_VM_NOCAPTURE=1.
    let capture = if std::env::var_os("PROXY_VM_NOCAPTURE").is_some() {
        " --nocapture"
    } else {
        ""
    };
    let runs: String = suites
        .iter()
        .map(|(binary, filters)| {
            format!(
                "{} --color never --test-threads 1 --include-ignored{capture} {}{skips} || status=${{status:-$?}}\n",
                binary.display(),
                filters.join(" ")
            )
        })
        .collect();
    format!(
        "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/tmp PROXY_REQUIRE_KERNEL_TESTS=1 PROXY_TEST_TIME_SCALE=5
export PROXY_AGENT_BIN={agent}
export PROXY_AGENT_ARGS=\"{agent_args}\"
cd {tests_dir}
echo \"kernel $(uname -r), $(nproc) CPUs\"
{runs}(exit ${{status:-0}})
",
        agent = root.join("target/debug/proxy-agent").display(),
        tests_dir = root.join("tests").display(),
    )
}

/// The script the VM runs for the benchmark: modebench on this kernel, its results.json
/// printed between markers for the host to keep.
fn bench_script(args: &[String], release: bool, environment: &str, agent_args: &str) -> String {
    let target = root()
        .join("target")
        .join(if release { "release" } else { "debug" });
    let args: String = args.iter().map(|a| format!(" '{a}'")).collect();
    format!(
        "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/tmp PROXY_REQUIRE_KERNEL_TESTS=1 PROXY_TEST_TIME_SCALE=5 PROXY_BENCH_PLAIN=1
export PROXY_AGENT_BIN={agent}
export PROXY_AGENT_ARGS=\"{agent_args}\"
export PROXY_BENCH_ENVIRONMENT=\"{environment}\"
cd /tmp
echo \"kernel $(uname -r), $(nproc) CPUs\"
{modebench}{args} --out /tmp/modebench
status=$?
if [ -f /tmp/modebench/results.json ]; then
  echo {RESULTS_BEGIN}
  cat /tmp/modebench/results.json
  echo
  echo {RESULTS_END}
fi
(exit $status)
",
        agent = target.join("proxy-agent").display(),
        modebench = target.join("modebench").display(),
    )
}

/// A test binary of the proxy-tests package (built if needed).
fn test_binary(suite: &str) -> Result<PathBuf> {
    let out = cargo(&[
        "test",
        "--no-run",
        "--quiet",
        "-p",
        "proxy-tests",
        "--test",
        suite,
        "--message-format=json",
    ])
    .stderr(Stdio::inherit())
    .output()
    .with_context(|| format!("building the {suite} tests"))?;
    if !out.status.success() {
        bail!("building the {suite} tests failed");
    }
    let name = format!("\"name\":\"{suite}\"");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&name))
        .find_map(|l| {
            let start = l.find("\"executable\":\"")? + "\"executable\":\"".len();
            let end = l[start..].find('"')? + start;
            Some(PathBuf::from(&l[start..end]))
        })
        .with_context(|| format!("cargo named no {suite} test binary"))
}

fn qemu(vmlinuz: &Path, initramfs: &Path, append: &str, accel: &str, opts: &VmTest) -> Command {
    let mut cmd = Command::new("qemu-system-x86_64");
    cmd.args(["-accel", accel])
        .args(["-cpu", if accel == "kvm" { "host" } else { "max" }])
        .args(["-smp", &opts.cpus.to_string()])
        .args(["-m", &opts.memory_mb.to_string()])
        .arg("-kernel")
        .arg(vmlinuz)
        .arg("-initrd")
        .arg(initramfs)
        .args(["-append", append])
        .args(["-display", "none", "-serial", "stdio", "-monitor", "none"])
        .args(["-nic", "none", "-no-reboot"])
        .args([
            "-fsdev",
            "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap",
            "-device",
            "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
        ]);
    cmd
}

/// KVM if a VM boots with it within the timeout (on this machine kind `/dev/kvm` exists but
/// qemu hangs with it), else TCG.
/// [`probe_kvm`]'s answer, found once per run: a machine whose KVM does not boot one of
/// Debian's kernels does not boot the next (and each probe waits 20 s to say so).
fn accelerator(vmlinuz: &Path, initramfs: &Path) -> &'static str {
    static FOUND: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();
    FOUND.get_or_init(|| probe_kvm(vmlinuz, initramfs))
}

fn probe_kvm(vmlinuz: &Path, initramfs: &Path) -> &'static str {
    const TIMEOUT: Duration = Duration::from_secs(20);
    if !Path::new("/dev/kvm").exists() {
        return "tcg,thread=multi";
    }
    let opts = VmTest {
        kernel: String::new(),
        payload: Payload::Tests(Vec::new()),
        memory_mb: 256,
        cpus: 1,
        skips: Vec::new(),
    };
    let spawned = qemu(
        vmlinuz,
        initramfs,
        "console=ttyS0 panic=-1 quiet vmtest.probe",
        "kvm",
        &opts,
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .stdin(Stdio::null())
    .spawn();
    let Ok(mut child) = spawned else {
        return "tcg,thread=multi";
    };
    let stdout = child.stdout.take().expect("piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let booted = BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|l| l.contains(BOOTED));
        let _ = tx.send(booted);
    });
    let started = Instant::now();
    let booted = rx.recv_timeout(TIMEOUT).unwrap_or(false);
    let _ = child.kill();
    let _ = child.wait();
    if booted {
        "kvm"
    } else {
        step(&format!(
            "vm-test: qemu with KVM did not boot the kernel (gave up after {:.1} s): using TCG (software emulation)",
            started.elapsed().as_secs_f64()
        ));
        "tcg,thread=multi"
    }
}

/// One test's outcome, from libtest's `test <name> ... <outcome>` lines.
struct TestResult {
    name: String,
    outcome: String,
}

impl TestResult {
    fn parse(line: &str) -> Option<Self> {
        let rest = line.strip_prefix("test ")?;
        let (name, outcome) = rest.split_once(" ... ")?;
        Some(TestResult {
            name: name.to_string(),
            outcome: outcome.trim().to_string(),
        })
    }
}

fn report(results: &[TestResult]) {
    let count = |prefix: &str| {
        results
            .iter()
            .filter(|r| r.outcome.starts_with(prefix))
            .count()
    };
    // A row a mode cannot run prints its SKIP line (uncaptured) where the outcome goes.
    println!(
        "vm-test results: {} passed, {} failed, {} ignored, {} skipped with a reason",
        count("ok"),
        count("FAILED"),
        count("ignored"),
        count("SKIP")
    );
    for r in results.iter().filter(|r| r.outcome.starts_with("SKIP")) {
        println!("  {}", r.outcome);
    }
    for r in results.iter().filter(|r| r.outcome.starts_with("FAILED")) {
        println!("  FAILED {}", r.name);
    }
}

/// A `newc` cpio archive, the format the kernel unpacks an initramfs from.
#[derive(Default)]
struct Cpio {
    bytes: Vec<u8>,
    inode: u32,
}

impl Cpio {
    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.inode += 1;
        let header = format!(
            "070701{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            self.inode,
            mode,
            0,
            0,
            1,
            0,
            data.len(),
            0,
            0,
            0,
            0,
            name.len() + 1,
            0
        );
        self.bytes.extend_from_slice(header.as_bytes());
        self.bytes.extend_from_slice(name.as_bytes());
        self.bytes.push(0);
        self.pad();
        self.bytes.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.bytes.len().is_multiple_of(4) {
            self.bytes.push(0);
        }
    }

    fn dir(&mut self, name: &str) {
        self.entry(name, 0o040755, &[]);
    }

    fn file(&mut self, name: &str, data: &[u8], perm: u32) {
        self.entry(name, 0o100000 | perm, data);
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, &[]);
        self.bytes
    }
}
