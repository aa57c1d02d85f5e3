//! The lab: a node network namespace with pods in their own namespaces, wired as a
//! Calico-style CNI does it (a veth per pod, a /32 route per pod on the node, proxy ARP for
//! the pods' gateway 169.254.1.1), an external client namespace on the node's external
//! interface, and the real agent running as a child process inside the node namespace.
//!
//! Rules it keeps: nothing is created or changed outside the namespaces it creates; every
//! route it adds ends inside the lab (the node's default route points at the external
//! namespace, whose default route points back); names are unique per lab so tests run in
//! parallel; namespaces left by killed runs are swept at start; everything is torn down on
//! drop, panics included.

use std::{
    fs::File,
    io::{BufRead, BufReader, Read, Write},
    net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream, UdpSocket},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

pub const PREFIX: &str = "kpl";
pub static LAB_COUNTER: AtomicUsize = AtomicUsize::new(0);

/// Runs a command, failing with its stderr.
pub fn sh(program: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A network namespace this lab created; deleted on drop.
#[derive(Debug)]
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn create(name: &str) -> Result<Self> {
        sh("ip", &["netns", "add", name])?;
        let ns = Netns { name: name.into() };
        // In this process, as the sysctls: a spawn costs much under the VM's emulation.
        ns.run(loopback_up)??;
        Ok(ns)
    }

    /// `ip -n NS ARGS`.
    pub fn ip(&self, args: &[&str]) -> Result<String> {
        let mut all = vec!["-n", &self.name];
        all.extend_from_slice(args);
        sh("ip", &all)
    }

    /// Runs a program inside the namespace (`ip netns exec`).
    pub fn exec(&self, program: &str, args: &[&str]) -> Result<String> {
        let mut all = vec!["netns", "exec", &self.name, program];
        all.extend_from_slice(args);
        sh("ip", &all)
    }

    /// `ip -n NS -batch -`: the commands in one process. Each one spawned costs a fork and
    /// exec, which under the VM runner's software emulation takes a large part of a second.
    /// (Batch lines take no options such as `-6`: `ip` infers the family from the address.)
    pub fn ip_batch(&self, commands: &[&[&str]]) -> Result<()> {
        let mut script = String::new();
        for command in commands {
            script.push_str(&command.join(" "));
            script.push('\n');
        }
        let mut child = Command::new("ip")
            .args(["-n", &self.name, "-batch", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .context("running ip -batch")?;
        child
            .stdin
            .take()
            .context("ip -batch stdin")?
            .write_all(script.as_bytes())?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "ip -n {} -batch: {}\n{script}",
                self.name,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    /// Sets `key=value` (sysctl's notation) in this namespace, by writing /proc/sys from a
    /// thread inside it: /proc/sys/net shows the writing thread's namespace.
    pub fn sysctl(&self, setting: &str) -> Result<()> {
        let (key, value) = setting
            .split_once('=')
            .with_context(|| format!("sysctl {setting:?}: not key=value"))?;
        let path = format!("/proc/sys/{}", key.trim().replace('.', "/"));
        let value = value.trim().to_string();
        self.run(move || {
            std::fs::write(&path, &value).with_context(|| format!("writing {value:?} to {path}"))
        })?
    }

    /// Runs `f` on a fresh thread that has entered this namespace, so sockets it opens live
    /// there. (Threads of an async runtime must never be moved between namespaces.)
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> JoinHandle<Result<T>> {
        let path = format!("/var/run/netns/{}", self.name);
        std::thread::spawn(move || {
            let file = File::open(&path).with_context(|| format!("opening {path}"))?;
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                bail!("setns {path}: {}", std::io::Error::last_os_error());
            }
            Ok(f())
        })
    }

    /// Runs `f` inside the namespace and waits for it.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
        match self.spawn(f).join() {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}

impl Drop for Netns {
    /// What `ip netns del` does, without its process: detach the namespace's bind mount
    /// and remove the file (the namespace goes with its last process and mount).
    fn drop(&mut self) {
        let path = format!("/var/run/netns/{}", self.name);
        if let Ok(c_path) = std::ffi::CString::new(path.as_str()) {
            // SAFETY: a valid C string; failure (not mounted) is harmless here.
            unsafe { libc::umount2(c_path.as_ptr(), libc::MNT_DETACH) };
        }
        let _ = std::fs::remove_file(&path);
    }
}

/// `ip` arguments for a veth pair: `local` in the namespace the command runs in, `peer`
/// moved into `peer_ns`.
pub fn veth<'a>(local: &'a str, peer: &'a str, peer_ns: &'a Netns) -> [&'a str; 10] {
    [
        "link",
        "add",
        local,
        "type",
        "veth",
        "peer",
        "name",
        peer,
        "netns",
        &peer_ns.name,
    ]
}

/// Sets the loopback interface of the calling thread's network namespace up.
fn loopback_up() -> Result<()> {
    // SAFETY: plain socket and ioctl calls on a descriptor owned here, and an ifreq this
    // function fills.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            bail!("socket: {}", std::io::Error::last_os_error());
        }
        let fd = OwnedFd::from_raw_fd(fd);
        let mut request: libc::ifreq = std::mem::zeroed();
        request.ifr_name[..2].copy_from_slice(&[b'l' as libc::c_char, b'o' as libc::c_char]);
        if libc::ioctl(fd.as_raw_fd(), libc::SIOCGIFFLAGS, &mut request) != 0 {
            bail!("SIOCGIFFLAGS lo: {}", std::io::Error::last_os_error());
        }
        request.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(fd.as_raw_fd(), libc::SIOCSIFFLAGS, &request) != 0 {
            bail!("SIOCSIFFLAGS lo: {}", std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Wires a pod namespace to its node as a Calico-style CNI does: a veth (`host_if` on the
/// node, `eth0` in the pod), a /32 route on the node, proxy ARP answering for the pod's
/// gateway 169.254.1.1 at once (the default delays answers by up to 0.8 s, which a pod's
/// first datagram would wait out), and the pod's default route through it.
pub(crate) fn wire_pod(node: &Netns, pod: &Netns, host_if: &str, ip: Ipv4Addr) -> Result<()> {
    wire_pod_with(node, pod, host_if, ip, &[], &[])
}

/// [`wire_pod`] with more commands for each side (`node_more`, `pod_more`), run in the same
/// `ip -batch` as the IPv4 wiring.
pub(crate) fn wire_pod_with(
    node: &Netns,
    pod: &Netns,
    host_if: &str,
    ip: Ipv4Addr,
    node_more: &[&[&str]],
    pod_more: &[&[&str]],
) -> Result<()> {
    let host = format!("{ip}/32");
    let mut node_side: Vec<&[&str]> = Vec::new();
    let veth = veth(host_if, "eth0", pod);
    let up = ["link", "set", host_if, "up"];
    let route = ["route", "add", &host, "dev", host_if];
    node_side.extend([&veth[..], &up, &route]);
    node_side.extend_from_slice(node_more);
    node.ip_batch(&node_side)?;
    node.sysctl(&format!("net.ipv4.conf.{host_if}.proxy_arp=1"))?;
    node.sysctl(&format!("net.ipv4.neigh.{host_if}.proxy_delay=0"))?;
    let addr = ["addr", "add", &host, "dev", "eth0"];
    let up = ["link", "set", "eth0", "up"];
    let gateway = [
        "route",
        "add",
        "169.254.1.1",
        "dev",
        "eth0",
        "scope",
        "link",
    ];
    let default = [
        "route",
        "add",
        "default",
        "via",
        "169.254.1.1",
        "dev",
        "eth0",
    ];
    let mut pod_side: Vec<&[&str]> = vec![&addr, &up, &gateway, &default];
    pod_side.extend_from_slice(pod_more);
    pod.ip_batch(&pod_side)
}

/// Deletes lab namespaces whose creating process is gone (a run killed before its drop).
pub fn sweep_stale_namespaces() {
    let Ok(list) = sh("ip", &["netns", "list"]) else {
        return;
    };
    for line in list.lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let mut parts = name.split('-');
        if parts.next() != Some(PREFIX) {
            continue;
        }
        let Some(pid) = parts.next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = sh("ip", &["netns", "del", name]);
        }
    }
}

/// Unmounts bpffs instances that labs of killed runs left mounted.
pub(crate) fn sweep_stale_mounts() {
    let Ok(mounts) = std::fs::read_to_string("/proc/self/mounts") else {
        return;
    };
    for line in mounts.lines() {
        let mut f = line.split_whitespace();
        let (Some(_), Some(point), Some(fstype)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if fstype != "bpf" && fstype != "cgroup2" {
            continue;
        }
        let Some(rest) = point.split(&format!("/{PREFIX}-")).nth(1) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = sh("umount", &["-l", point]);
        }
    }
}

/// A bpffs mounted for one lab: pins must outlive each agent process, and `ip netns exec`
/// gives every process its own /sys (a bpffs mounted there dies with the process).
#[derive(Debug)]
pub struct LabBpffs {
    pub path: PathBuf,
}

impl LabBpffs {
    pub(crate) fn mount(dir: &Path) -> Result<Self> {
        let path = dir.join("bpffs");
        std::fs::create_dir_all(&path)?;
        sh("mount", &["-t", "bpf", "bpf", &path.to_string_lossy()])?;
        Ok(LabBpffs { path })
    }

    /// The agent's `--bpffs-root`.
    pub fn root(&self) -> PathBuf {
        self.path.join("proxy-agent")
    }
}

impl Drop for LabBpffs {
    fn drop(&mut self) {
        let _ = sh("umount", &["-l", &self.path.to_string_lossy()]);
    }
}

/// A pod: its namespace, its address, and the node-side end of its veth.
#[derive(Debug)]
pub struct Pod {
    pub name: String,
    pub ip: Ipv4Addr,
    /// Interface name on the node.
    pub host_if: String,
    pub ns: Netns,
}

#[derive(Clone, Debug)]
pub struct LabOptions {
    /// Backend pod addresses (each also serves TCP 8080 and UDP 5353).
    pub backends: Vec<Ipv4Addr>,
    /// Client pod address.
    pub client: Ipv4Addr,
    pub checksums: Checksums,
}

/// How checksums are handled on the lab's veths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checksums {
    /// Offload on everywhere (veth default): senders leave partial checksums and receivers
    /// trust them, so a wrong checksum can go unnoticed.
    Offloaded,
    /// Offload off everywhere (`ethtool -K rx off tx off`): full checksums are computed by
    /// the senders and verified in software by every receiver.
    Software,
    /// Pods send partial checksums (tx on), so the datapath rewrites CHECKSUM_PARTIAL
    /// packets; the node completes checksums in software when it forwards (tx off on the node
    /// side) and the receiving pod verifies them (rx off). A wrong partial update is a
    /// dropped packet.
    PartialCompletedByNode,
}

impl Default for LabOptions {
    fn default() -> Self {
        Self {
            backends: (11..=13).map(|i| Ipv4Addr::new(10, 244, 1, i)).collect(),
            client: Ipv4Addr::new(10, 244, 0, 2),
            checksums: Checksums::Offloaded,
        }
    }
}

pub const NODE_EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(10, 250, 0, 1);
pub const EXTERNAL_CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 250, 0, 2);
pub const TCP_PORT: u16 = 8080;
/// The counting sink for bulk transfers (see [`count_and_report`]).
pub const BULK_PORT: u16 = 8081;
pub const UDP_PORT: u16 = 5353;

/// A backend pod's server loop: stops when its flag is set.
type ServerThread = JoinHandle<Result<Result<()>>>;

pub struct Lab {
    pub id: String,
    pub client: Pod,
    pub backends: Vec<Pod>,
    /// Pods added after the lab was built (see [`Lab::add_pod_later`]).
    pub extra_pods: Vec<Pod>,
    pub external: Netns,
    pub bpffs: LabBpffs,
    pub dir: tempfile::TempDir,
    servers: Vec<(Arc<AtomicBool>, ServerThread)>,
    agent: Option<Agent>,
    /// Searched before `PATH` for the node's tools by the agents started next: a test puts a
    /// wrapper there to inject a fault (a tool that hangs).
    pub tools_first: Option<PathBuf>,
    /// A command the agent runs under (e.g. `setpriv` with the DaemonSet's capabilities).
    pub agent_prefix: Vec<String>,
    /// Whether agents get the runner's `PROXY_AGENT_ARGS` (true unless a test needs the
    /// agent as an operator starts it, e.g. without the VM's nftables kernel-check skip).
    pub runner_args: bool,
    // Dropped last: deleting it removes every veth of the lab.
    pub node: Netns,
}

impl Lab {
    pub fn new(options: LabOptions) -> Result<Self> {
        sweep_stale_namespaces();
        sweep_stale_mounts();
        let id = format!(
            "{PREFIX}-{}-{}",
            std::process::id(),
            LAB_COUNTER.fetch_add(1, Ordering::SeqCst)
        );
        let dir = tempfile::Builder::new()
            .prefix(&format!("{id}-"))
            .tempdir()?;
        let bpffs = LabBpffs::mount(dir.path())?;
        let node = Netns::create(&format!("{id}-node"))?;
        node.sysctl("net.ipv4.ip_forward=1")?;
        let external = Netns::create(&format!("{id}-ext"))?;
        // The node's external link; its default route ends in the external namespace.
        node.ip(&veth("ext0", "eth0", &external))?;
        node.ip(&[
            "addr",
            "add",
            &format!("{NODE_EXTERNAL_IP}/24"),
            "dev",
            "ext0",
        ])?;
        node.ip(&["link", "set", "ext0", "up"])?;
        node.ip(&[
            "route",
            "add",
            "default",
            "via",
            &EXTERNAL_CLIENT_IP.to_string(),
        ])?;
        external.ip(&[
            "addr",
            "add",
            &format!("{EXTERNAL_CLIENT_IP}/24"),
            "dev",
            "eth0",
        ])?;
        external.ip(&["link", "set", "eth0", "up"])?;
        external.ip(&[
            "route",
            "add",
            "default",
            "via",
            &NODE_EXTERNAL_IP.to_string(),
        ])?;

        let client = Self::add_pod(&id, &node, "client", options.client, 0)?;
        let mut backends = Vec::new();
        for (i, ip) in options.backends.iter().enumerate() {
            backends.push(Self::add_pod(
                &id,
                &node,
                &format!("pod{}", i + 1),
                *ip,
                i + 1,
            )?);
        }
        let (node_side, pod_side): (&[&str], &[&str]) = match options.checksums {
            Checksums::Offloaded => (&[], &[]),
            Checksums::Software => (&["rx", "off", "tx", "off"], &["rx", "off", "tx", "off"]),
            Checksums::PartialCompletedByNode => (&["tx", "off"], &["rx", "off"]),
        };
        if !node_side.is_empty() {
            let ethtool = |ns: &Netns, dev: &str, settings: &[&str]| {
                let mut args = vec!["-K", dev];
                args.extend_from_slice(settings);
                ns.exec("ethtool", &args).map(|_| ())
            };
            ethtool(&node, "ext0", node_side)?;
            ethtool(&external, "eth0", pod_side)?;
            for pod in std::iter::once(&client).chain(&backends) {
                ethtool(&node, &pod.host_if, node_side)?;
                ethtool(&pod.ns, "eth0", pod_side)?;
            }
        }
        let mut lab = Lab {
            id,
            client,
            backends,
            extra_pods: Vec::new(),
            external,
            bpffs,
            dir,
            servers: Vec::new(),
            agent: None,
            tools_first: None,
            agent_prefix: Vec::new(),
            runner_args: true,
            node,
        };
        for i in 0..lab.backends.len() {
            lab.start_servers(i)?;
        }
        Ok(lab)
    }

    fn add_pod(id: &str, node: &Netns, name: &str, ip: Ipv4Addr, index: usize) -> Result<Pod> {
        let ns = Netns::create(&format!("{id}-{name}"))?;
        let host_if = format!("lxc{index}");
        wire_pod(node, &ns, &host_if, ip)?;
        Ok(Pod {
            name: name.into(),
            ip,
            host_if,
            ns,
        })
    }

    /// TCP :8080 answers each connection with the pod's name, then echoes; TCP :8081
    /// counts what arrives; UDP :5353 answers each datagram with the pod's name.
    fn start_servers(&mut self, index: usize) -> Result<()> {
        let pod = &self.backends[index];
        let name = pod.name.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let stop2 = stop.clone();
        let handle = pod.ns.spawn(move || -> Result<()> {
            let tcp = TcpListener::bind(("0.0.0.0", TCP_PORT))?;
            tcp.set_nonblocking(true)?;
            let bulk = TcpListener::bind(("0.0.0.0", BULK_PORT))?;
            bulk.set_nonblocking(true)?;
            let udp = UdpSocket::bind(("0.0.0.0", UDP_PORT))?;
            udp.set_nonblocking(true)?;
            ready_tx.send(()).ok();
            let workers = Workers::default();
            let mut buf = [0u8; 2048];
            // Wait on both sockets at once; the timeout only bounds how late a stop is seen.
            let mut fds = [
                libc::pollfd {
                    fd: tcp.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: udp.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: bulk.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            while !stop2.load(Ordering::Relaxed) {
                // SAFETY: `fds` holds valid pollfd entries, `fds.len()` of them.
                if unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 50) } <= 0 {
                    continue;
                }
                while let Ok((stream, _)) = tcp.accept() {
                    let name = name.clone();
                    workers.run(move || serve_greeting_then_echo(stream, &name));
                }
                while let Ok((stream, _)) = bulk.accept() {
                    workers.run(move || count_and_report(stream));
                }
                while let Ok((_, from)) = udp.recv_from(&mut buf) {
                    let _ = udp.send_to(name.as_bytes(), from);
                }
            }
            Ok(())
        });
        ready_rx
            .recv_timeout(Duration::from_secs(5))
            .context("backend servers did not start")?;
        self.servers.push((stop, handle));
        Ok(())
    }

    /// Adds a pod (as a client) while the agent runs, on node interface `lxc<index>`.
    pub fn add_pod_later(&mut self, name: &str, ip: Ipv4Addr, index: usize) -> Result<&Pod> {
        let pod = Self::add_pod(&self.id, &self.node, name, ip, index)?;
        self.extra_pods.push(pod);
        Ok(self.extra_pods.last().unwrap())
    }

    /// Deletes a pod added with [`Lab::add_pod_later`] (its veth goes with its namespace)
    /// and waits until the node side of the veth is gone too: the kernel dismantles a
    /// namespace asynchronously.
    pub fn remove_extra_pod(&mut self, name: &str) {
        let host_ifs: Vec<String> = self
            .extra_pods
            .iter()
            .filter(|p| p.name == name)
            .map(|p| p.host_if.clone())
            .collect();
        self.extra_pods.retain(|p| p.name != name);
        let deadline = Instant::now() + Duration::from_secs(5);
        for dev in host_ifs {
            while self.node.ip(&["link", "show", &dev]).is_ok() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    /// Writes `yaml` as the agent's manifest file and returns its path.
    pub fn write_manifests(&self, yaml: &str) -> Result<PathBuf> {
        let path = self.dir.path().join("cluster.yaml");
        let tmp = self.dir.path().join(".cluster.yaml.tmp");
        std::fs::write(&tmp, yaml)?;
        std::fs::rename(&tmp, &path)?;
        Ok(path)
    }

    /// Starts the agent inside the node namespace and waits until it has attached to every
    /// pod interface and synced the manifests.
    pub fn start_agent(&mut self, manifests: &Path, extra: &[&str]) -> Result<&mut Agent> {
        self.start_agent_from(Some(manifests), extra)
    }

    /// Like [`Lab::start_agent`]; `None` runs it against an API server given in `extra`.
    pub fn start_agent_from(
        &mut self,
        manifests: Option<&Path>,
        extra: &[&str],
    ) -> Result<&mut Agent> {
        let pods = 1 + self.backends.len();
        let attaches = attaches_interfaces(extra);
        let agent = self.spawn_agent_from(manifests, extra)?;
        agent.wait_for_log(|log| {
            (!attaches || log.matches("attached interface=").count() >= pods)
                && log.contains("synced")
        })?;
        Ok(agent)
    }

    /// Starts the agent without waiting for it (the benchmark times how long it takes to
    /// serve).
    pub fn spawn_agent(&mut self, manifests: &Path, extra: &[&str]) -> Result<&mut Agent> {
        self.spawn_agent_from(Some(manifests), extra)
    }

    /// Starts the agent (from `manifests`, or without: the API source) without waiting.
    pub fn spawn_agent_from(
        &mut self,
        manifests: Option<&Path>,
        extra: &[&str],
    ) -> Result<&mut Agent> {
        let root = self.bpffs.root();
        let mut args = vec!["--bpffs-root", root.to_str().unwrap()];
        args.extend_from_slice(extra);
        let log = self.next_log();
        Ok(self.agent.insert(Agent::start_under(
            &self.node,
            manifests,
            &log,
            &args,
            self.tools_first.as_deref(),
            &self.agent_prefix,
            self.runner_args,
        )?))
    }

    fn next_log(&self) -> PathBuf {
        let n = std::fs::read_dir(self.dir.path())
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with("agent"))
                    .count()
            })
            .unwrap_or(0);
        self.dir.path().join(format!("agent-{n}.log"))
    }

    /// Runs the agent binary in the node namespace with `args` (plus this lab's
    /// `--bpffs-root`) to completion; returns (success, combined output).
    pub fn run_agent_once(&self, args: &[&str]) -> Result<(bool, String)> {
        let bin = agent_binary()?;
        let root = self.bpffs.root();
        let out = Command::new("ip")
            .args(["netns", "exec", &self.node.name])
            .arg(&bin)
            .args(["--bpffs-root", root.to_str().unwrap()])
            .args(args)
            .env("NO_COLOR", "1")
            .output()?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok((out.status.success(), text))
    }

    pub fn agent(&mut self) -> Option<&mut Agent> {
        self.agent.as_mut()
    }

    pub fn stop_agent(&mut self) -> Result<()> {
        if let Some(mut a) = self.agent.take() {
            a.stop()?;
        }
        Ok(())
    }
}

/// TCP :8080 of a backend pod: the pod's name as a greeting line, then an echo.
pub fn serve_greeting_then_echo(mut stream: TcpStream, name: &str) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    if stream.write_all(format!("{name}\n").as_bytes()).is_err() {
        return;
    }
    echo(&mut stream);
}

type Job = Box<dyn FnOnce() + Send>;

/// A thread per connection, reused: a connection goes to an idle thread when there is one,
/// else to a new one. A benchmark opens thousands of short connections a second, and a new
/// thread each (its stack mapped and unmapped, the other cores told to flush their TLBs)
/// cost more CPU than the datapath under test. Threads are created from the calling one
/// (so they share its namespace) and end when it drops this.
struct Workers {
    tx: std::sync::mpsc::Sender<Job>,
    rx: Arc<std::sync::Mutex<std::sync::mpsc::Receiver<Job>>>,
    /// Threads waiting for a job and not yet promised one.
    idle: Arc<std::sync::atomic::AtomicUsize>,
}

impl Default for Workers {
    fn default() -> Self {
        let (tx, rx) = std::sync::mpsc::channel();
        Workers {
            tx,
            rx: Arc::new(std::sync::Mutex::new(rx)),
            idle: Arc::default(),
        }
    }
}

impl Workers {
    fn run(&self, job: impl FnOnce() + Send + 'static) {
        // Promise the job to an idle thread (it is waiting on the channel, so it takes it),
        // or start one: a job never waits behind a long connection.
        let promised = self
            .idle
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok();
        let mut first: Job = Box::new(job);
        if promised {
            match self.tx.send(first) {
                Ok(()) => return,
                Err(unsent) => first = unsent.0,
            }
        }
        let (rx, idle) = (self.rx.clone(), self.idle.clone());
        std::thread::spawn(move || {
            first();
            loop {
                idle.fetch_add(1, Ordering::AcqRel);
                let next = rx.lock().map(|r| r.recv());
                match next {
                    Ok(Ok(job)) => job(),
                    _ => return,
                }
            }
        });
    }
}

/// TCP :8081 of a backend pod (the benchmark's bulk transfers): reads until the peer
/// half-closes, then answers with the number of bytes it received.
pub fn count_and_report(mut stream: TcpStream) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    let mut buf = vec![0u8; 256 * 1024];
    let mut total: u64 = 0;
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => total += n as u64,
            Err(_) => return,
        }
    }
    let _ = stream.write_all(format!("{total}\n").as_bytes());
}

/// Sends back whatever arrives until the peer closes (or 30 s of silence).
pub(crate) fn echo(stream: &mut TcpStream) {
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if stream.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if let Some(mut a) = self.agent.take() {
            let _ = a.stop();
        }
        // What the agent left attached and pinned goes with the lab.
        let _ = self.run_agent_once(&["--cleanup"]);
        for (stop, _) in &self.servers {
            stop.store(true, Ordering::Relaxed);
        }
        for (_, h) in self.servers.drain(..) {
            let _ = h.join();
        }
    }
}

/// The agent binary built next to the test binaries.
/// Whether an agent run with `args` attaches to interfaces (only the eBPF mode does).
pub fn attaches_interfaces(args: &[&str]) -> bool {
    args.windows(2)
        .find(|w| w[0] == "--proxy-mode")
        .is_none_or(|w| w[1] == "ebpf")
}

pub fn agent_binary() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("PROXY_AGENT_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()?;
    for dir in exe.ancestors().skip(1).take(3) {
        let candidate = dir.join("proxy-agent");
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    bail!("proxy-agent binary not found next to {}: run `cargo build -p proxy-agent` (cargo xtask test does)", exe.display())
}

/// The agent as a child process in the node namespace.
pub struct Agent {
    child: Child,
    pub log: PathBuf,
}

impl Agent {
    /// Starts the agent; without `manifests` it watches an API server (`extra` says where).
    pub fn start(
        node: &Netns,
        manifests: Option<&Path>,
        log: &Path,
        extra: &[&str],
    ) -> Result<Self> {
        Self::start_under(node, manifests, log, extra, None, &[], true)
    }

    /// Like [`Agent::start`], with `tools_first` searched before `PATH` for its tools, the
    /// agent run by `prefix` (a command and its arguments, e.g. `setpriv`), if any, and the
    /// runner's `PROXY_AGENT_ARGS` added if `runner_args`.
    pub fn start_under(
        node: &Netns,
        manifests: Option<&Path>,
        log: &Path,
        extra: &[&str],
        tools_first: Option<&Path>,
        prefix: &[String],
        runner_args: bool,
    ) -> Result<Self> {
        let bin = agent_binary()?;
        let logfile = File::create(log)?;
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &node.name])
            .args(prefix)
            .arg(&bin);
        if let Some(m) = manifests {
            cmd.arg("--manifests").arg(m);
        }
        // PROXY_AGENT_ARGS: flags for every agent a test starts (the VM runner's, per
        // kernel: `--nftables-skip-kernel-version-check` on 5.10).
        let from_env = match runner_args {
            true => std::env::var("PROXY_AGENT_ARGS").unwrap_or_default(),
            false => String::new(),
        };
        if let Some(dir) = tools_first {
            let mut path = std::ffi::OsString::from(dir);
            path.push(":");
            path.push(std::env::var_os("PATH").unwrap_or_default());
            cmd.env("PATH", path);
        }
        let child = cmd
            .args(["--interfaces", "lxc*", "-v", "2"])
            // The runner's first, so a test's own flags (a map size it needs) win: the
            // last of a repeated flag does.
            .args(from_env.split_whitespace())
            .args(extra)
            .stdin(Stdio::null())
            .stdout(logfile.try_clone()?)
            .stderr(logfile)
            .env("NO_COLOR", "1")
            .spawn()
            .context("starting the agent")?;
        Ok(Agent {
            child,
            log: log.to_path_buf(),
        })
    }

    /// The agent's process id (`ip netns exec` execs it: the child is the agent).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until `ready(log)` holds, failing if the agent exits or 15 s pass (scaled: the
    /// verifier is slow under emulation).
    pub fn wait_for_log(&mut self, ready: impl Fn(&str) -> bool) -> Result<()> {
        let limit = crate::scaled(Duration::from_secs(15));
        let deadline = Instant::now() + limit;
        loop {
            let log = self.log_text();
            if ready(&log) {
                return Ok(());
            }
            if let Some(status) = self.child.try_wait()? {
                bail!("agent exited ({status}):\n{log}");
            }
            if Instant::now() > deadline {
                bail!("agent not ready after {} s:\n{log}", limit.as_secs());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, then wait (kill after 5 s).
    pub fn stop(&mut self) -> Result<()> {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if self.child.try_wait()?.is_some() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Client helpers; call them inside a namespace (`Netns::run`).
pub mod client {
    use super::*;

    /// Connects, reads the backend's greeting line (its pod name).
    pub fn tcp_hello(to: SocketAddrV4, timeout: Duration) -> std::io::Result<String> {
        tcp_hello_within(to, timeout, timeout)
    }

    /// [`tcp_hello`] with separate bounds on the connect and on the greeting.
    pub fn tcp_hello_within(
        to: SocketAddrV4,
        connect: Duration,
        read: Duration,
    ) -> std::io::Result<String> {
        let mut s = TcpStream::connect_timeout(&to.into(), connect)?;
        s.set_read_timeout(Some(read))?;
        let mut line = String::new();
        BufReader::new(&mut s).read_line(&mut line)?;
        Ok(line.trim().to_string())
    }

    /// Sends one datagram, returns the answer (the backend's pod name).
    pub fn udp_hello(to: SocketAddrV4, timeout: Duration) -> std::io::Result<String> {
        let s = UdpSocket::bind("0.0.0.0:0")?;
        s.connect(to)?;
        s.set_read_timeout(Some(timeout))?;
        s.send(b"hello")?;
        let mut buf = [0u8; 512];
        let n = s.recv(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
    }
}

/// A TCP connection held open from a pod, on its own thread inside the pod's namespace.
pub struct Session {
    /// The pod that accepted it (from its greeting).
    pub backend: String,
    requests: std::sync::mpsc::Sender<String>,
    replies: std::sync::mpsc::Receiver<std::io::Result<String>>,
    thread: Option<JoinHandle<Result<()>>>,
}

impl Session {
    pub fn open(ns: &Netns, to: impl Into<std::net::SocketAddr>) -> Result<Self> {
        let to: std::net::SocketAddr = to.into();
        let (req_tx, req_rx) = std::sync::mpsc::channel::<String>();
        let (rep_tx, rep_rx) = std::sync::mpsc::channel::<std::io::Result<String>>();
        let thread = ns.spawn(move || {
            let mut stream = match TcpStream::connect_timeout(&to, Duration::from_secs(2)) {
                Ok(s) => s,
                Err(e) => {
                    let _ = rep_tx.send(Err(e));
                    return;
                }
            };
            let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
            let mut reader = BufReader::new(stream.try_clone().expect("clone"));
            let mut line = String::new();
            let greeting = reader.read_line(&mut line).map(|_| line.trim().to_string());
            let _ = rep_tx.send(greeting);
            while let Ok(msg) = req_rx.recv() {
                let reply = (|| {
                    stream.write_all(format!("{msg}\n").as_bytes())?;
                    let mut echo = String::new();
                    reader.read_line(&mut echo)?;
                    Ok(echo.trim().to_string())
                })();
                if rep_tx.send(reply).is_err() {
                    return;
                }
            }
        });
        let backend = rep_rx
            .recv_timeout(Duration::from_secs(5))
            .context("session did not start")?
            .context("opening the session")?;
        Ok(Session {
            backend,
            requests: req_tx,
            replies: rep_rx,
            thread: Some(thread),
        })
    }

    /// Sends a line and returns what comes back (the backends echo).
    pub fn exchange(&self, msg: &str) -> Result<String> {
        self.requests.send(msg.to_string())?;
        Ok(self
            .replies
            .recv_timeout(Duration::from_secs(5))
            .context("no reply")??)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let (tx, _) = std::sync::mpsc::channel();
        drop(std::mem::replace(&mut self.requests, tx));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Connections that worked, and the errors of those that failed.
pub type LoopOutcome = (usize, Vec<String>);

/// Opens connections from a pod in a loop until stopped; counts what failed.
pub struct ConnectLoop {
    stop: Arc<AtomicBool>,
    served: Arc<std::sync::atomic::AtomicUsize>,
    thread: Option<JoinHandle<Result<(LoopOutcome, Duration)>>>,
}

impl ConnectLoop {
    pub fn start(ns: &Netns, to: SocketAddrV4) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let served = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let flag = stop.clone();
        let count = served.clone();
        let thread = ns.spawn(move || {
            let mut ok = 0;
            let mut failures = Vec::new();
            let mut last_ok = Instant::now();
            let mut longest_gap = Duration::ZERO;
            while !flag.load(Ordering::Relaxed) {
                match client::tcp_hello(to, Duration::from_secs(1)) {
                    Ok(_) => {
                        ok += 1;
                        count.store(ok, Ordering::Relaxed);
                        longest_gap = longest_gap.max(last_ok.elapsed());
                        last_ok = Instant::now();
                    }
                    Err(e) => failures.push(e.to_string()),
                }
            }
            ((ok, failures), longest_gap.max(last_ok.elapsed()))
        });
        ConnectLoop {
            stop,
            served,
            thread: Some(thread),
        }
    }

    /// Connections that worked so far.
    pub fn served(&self) -> usize {
        self.served.load(Ordering::Relaxed)
    }

    /// Stops the loop; returns (connections that worked, errors of those that failed).
    pub fn finish(self) -> Result<LoopOutcome> {
        Ok(self.finish_with_gap()?.0)
    }

    /// Like [`ConnectLoop::finish`], with the longest time between two connections that
    /// worked (or from the start or until the end): how long new connections were not
    /// served.
    pub fn finish_with_gap(mut self) -> Result<(LoopOutcome, Duration)> {
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.take().unwrap().join() {
            Ok(r) => r,
            Err(_) => bail!("connect loop panicked"),
        }
    }
}

impl Drop for ConnectLoop {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Builds manifest YAML for the lab's tests: a Service and, when it has endpoints, its
/// EndpointSlice, as the API server would serve them.
pub mod manifest {
    use std::net::Ipv4Addr;

    use serde_json::{json, Value};

    /// One port of a Service: (name, protocol, port, targetPort). The slice gets the target
    /// port under the same name, as the EndpointSlice controller writes it.
    pub type Port<'a> = (&'a str, &'a str, u16, u16);

    pub fn service(
        name: &str,
        cluster_ip: Ipv4Addr,
        ports: &[Port],
        endpoints: &[Ipv4Addr],
    ) -> String {
        let svc_ports: String = ports
            .iter()
            .map(|(n, proto, port, target)| {
                format!("    - {{name: \"{n}\", protocol: {proto}, port: {port}, targetPort: {target}}}\n")
            })
            .collect();
        let mut yaml = format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: lab}}\nspec:\n  clusterIP: {cluster_ip}\n  ports:\n{svc_ports}---\n"
        );
        if !endpoints.is_empty() {
            let slice_ports: String = ports
                .iter()
                .map(|(n, proto, _, target)| {
                    format!("  - {{name: \"{n}\", protocol: {proto}, port: {target}}}\n")
                })
                .collect();
            let eps: String = endpoints
                .iter()
                .map(|ip| format!("  - addresses: [\"{ip}\"]\n    conditions: {{ready: true}}\n"))
                .collect();
            yaml.push_str(&format!(
                "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: lab, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nports:\n{slice_ports}endpoints:\n{eps}---\n"
            ));
        }
        yaml
    }

    /// The objects [`service`] writes, as the API server serves them (JSON): the Service
    /// and, with endpoints, its EndpointSlice.
    pub fn objects(
        name: &str,
        cluster_ip: Ipv4Addr,
        ports: &[Port],
        endpoints: &[Ipv4Addr],
    ) -> (Value, Option<Value>) {
        let svc_ports: Vec<Value> = ports
            .iter()
            .map(|(n, proto, port, target)| {
                json!({"name": n, "protocol": proto, "port": port, "targetPort": target})
            })
            .collect();
        let service = json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "lab"},
            "spec": {"clusterIP": cluster_ip.to_string(), "ports": svc_ports}});
        let slice = (!endpoints.is_empty()).then(|| {
            let slice_ports: Vec<Value> = ports
                .iter()
                .map(|(n, proto, _, target)| json!({"name": n, "protocol": proto, "port": target}))
                .collect();
            let eps: Vec<Value> = endpoints
                .iter()
                .map(|ip| json!({"addresses": [ip.to_string()], "conditions": {"ready": true}}))
                .collect();
            json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": format!("{name}-1"), "namespace": "lab",
                             "labels": {"kubernetes.io/service-name": name}},
                "addressType": "IPv4", "ports": slice_ports, "endpoints": eps})
        });
        (service, slice)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn the_api_objects_are_the_manifests_objects() {
            let ports = [("http", "TCP", 80, 8080), ("bulk", "TCP", 81, 8081)];
            let eps = [Ipv4Addr::new(10, 244, 1, 11), Ipv4Addr::new(10, 244, 1, 12)];
            let yaml = service("web", Ipv4Addr::new(10, 96, 0, 10), &ports, &eps);
            let docs: Vec<Value> = yaml
                .split("---\n")
                .filter(|d| !d.trim().is_empty())
                .map(|d| serde_yaml::from_str(d).unwrap())
                .collect();
            let (svc, slice) = objects("web", Ipv4Addr::new(10, 96, 0, 10), &ports, &eps);
            assert_eq!(docs, [svc, slice.unwrap()]);
            let (_, none) = objects("web", Ipv4Addr::new(10, 96, 0, 10), &ports, &[]);
            assert!(none.is_none());
        }
    }
}
