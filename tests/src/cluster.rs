//! The two-node lab: two node namespaces joined by a routed link (each node routes the other
//! node's pod range via the other node's address, as a CNI in routed mode does), pods on
//! both, an external client namespace wired to each node's external interface, and one agent
//! per node. Built from the same pieces as [`crate::lab`] and under the same rules: only
//! namespaces it creates, every route ends inside the lab, unique names, torn down on drop.
//!
//! ```text
//!   ext ns: eth1 10.250.1.2 ── ext0 10.250.1.1  node-1  fab0 10.251.0.1 ─┐
//!           eth2 10.250.2.2 ── ext0 10.250.2.1  node-2  fab0 10.251.0.2 ─┘
//!   node-1 pods 10.244.1.0/24 (lxc*), node-2 pods 10.244.2.0/24 (lxc*)
//! ```
//!
//! The lab is dual-stack: every address above has an IPv6 twin ([`v6`]: 10.a.b.c becomes
//! fd00:10:a:b::c), with the same routes, so IPv4 and IPv6 services run side by side.
//!
//! Backend pods answer TCP on 8080 and 8081, UDP on 5353 and, where the kernel has SCTP,
//! SCTP on 9090 with a greeting that says who answered, on which port, and which source
//! address they saw (so tests can check source NAT and source preservation).

use std::{
    io::{BufRead, BufReader, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::Duration,
};

use anyhow::{bail, Context, Result};

pub use crate::client::{self, sctp_socket, Hello};

use crate::lab::{
    sweep_stale_mounts, sweep_stale_namespaces, Agent, LabBpffs, Netns, LAB_COUNTER, PREFIX,
};

pub const TCP_PORTS: [u16; 2] = [8080, 8081];
pub const UDP_PORT: u16 = 5353;
pub const SCTP_PORT: u16 = 9090;

/// The IPv6 twin of a lab address: 10.a.b.c becomes fd00:10:a:b::c.
pub fn v6(v4: Ipv4Addr) -> Ipv6Addr {
    let [ten, a, b, c] = v4.octets();
    let hex = |x: u8| u16::from_str_radix(&x.to_string(), 16).expect("decimal digits read as hex");
    Ipv6Addr::new(0xfd00, hex(ten), hex(a), hex(b), 0, 0, 0, hex(c))
}

/// Where an external client sits: on each node's external link.
pub fn external_client_ip(node: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 250, node, 2)
}

/// A second address of the external client on node `node`'s link (another "user").
pub fn other_external_client_ip(node: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 250, node, 3)
}

/// Addresses routed to node-1 from the external namespace: external IPs and load-balancer
/// IPs in tests live here.
pub const EXTERNAL_RANGE: &str = "10.252.0.0/24";
pub const EXTERNAL_RANGE6: &str = "fd00:10:252::/64";

pub struct ClusterNode {
    pub name: String,
    pub index: u8,
    /// The node's "host" cgroup (v2): the agent's socket hooks are attached to it, and the
    /// node's own processes in tests run in it. Never the root cgroup.
    pub cgroup: PathBuf,
    /// The node's InternalIP, on the link between the nodes.
    pub internal_ip: Ipv4Addr,
    /// The node's ExternalIP, on its external link.
    pub external_ip: Ipv4Addr,
    pub bpffs: LabBpffs,
    pub agent: Option<Agent>,
    /// The agent's arguments, for restarts.
    args: Vec<String>,
    manifests: Option<PathBuf>,
    pub ns: Netns,
}

/// A pod on one node.
#[derive(Debug)]
pub struct ClusterPod {
    pub name: String,
    pub ip: Ipv4Addr,
    /// 1 or 2.
    pub node: u8,
    pub ns: Netns,
    /// The pod's cgroup, below its node's (where the agent attaches the socket hooks), as
    /// a pod's is below the host's root cgroup in a cluster.
    pub cgroup: PathBuf,
}

type ServerThread = JoinHandle<Result<Result<()>>>;

pub struct Cluster {
    pub id: String,
    /// Pods' clients run as threads of the test process, outside every pod's cgroup (so
    /// outside the socket hooks): the placement of hooks on a cgroup that holds no pod.
    /// Off by default: clients are processes in their pod's cgroup (`pod_command`).
    pub pod_clients_outside_hooks: bool,
    /// A cgroup2 mount of the lab's own (visible to `ip netns exec`, which remounts /sys).
    cgroup_mount: PathBuf,
    pub pods: Vec<ClusterPod>,
    pub external: Netns,
    servers: Vec<(Arc<AtomicBool>, ServerThread)>,
    // Dropped after the rest but the directory: deleting them removes every veth of the lab.
    pub nodes: Vec<ClusterNode>,
    /// After the nodes, whose bpffs mounts are inside it (a mounted directory cannot be
    /// removed: every cluster lab left its directory behind).
    pub dir: tempfile::TempDir,
}

/// The pods every cluster has: a client pod on each node, one backend on node-1, two on
/// node-2.
pub const CLIENT: &str = "client";
pub const CLIENT_2: &str = "client-2";
pub const CLIENT_2_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 2);
pub const BACKENDS: [(&str, u8, Ipv4Addr); 3] = [
    ("web-1a", 1, Ipv4Addr::new(10, 244, 1, 11)),
    ("web-2a", 2, Ipv4Addr::new(10, 244, 2, 11)),
    ("web-2b", 2, Ipv4Addr::new(10, 244, 2, 12)),
];
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 2);

impl Cluster {
    pub fn new() -> Result<Self> {
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
        let external = Netns::create(&format!("{id}-ext"))?;
        let cgroup_mount = dir.path().join("cgroup2");
        std::fs::create_dir_all(&cgroup_mount)?;
        crate::lab::sh(
            "mount",
            &["-t", "cgroup2", "none", &cgroup_mount.to_string_lossy()],
        )?;
        sweep_stale_cgroups(&cgroup_mount);
        let mut nodes = Vec::new();
        for index in 1..=2u8 {
            let ns = Netns::create(&format!("{id}-n{index}"))?;
            ns.sysctl("net.ipv4.ip_forward=1")?;
            ns.sysctl("net.ipv6.conf.all.forwarding=1")?;
            // Static lab addresses need no duplicate detection (it would delay them by seconds).
            ns.sysctl("net.ipv6.conf.default.accept_dad=0")?;
            let node_dir = dir.path().join(format!("node-{index}"));
            std::fs::create_dir_all(&node_dir)?;
            let ext_if = format!("eth{index}");
            let external_ip = Ipv4Addr::new(10, 250, index, 1);
            let own = format!("{external_ip}/24");
            let own6 = format!("{}/64", v6(external_ip));
            let gateway = external_client_ip(index).to_string();
            let gateway6 = v6(external_client_ip(index)).to_string();
            ns.ip_batch(&[
                &crate::lab::veth("ext0", &ext_if, &external),
                &["addr", "add", &own, "dev", "ext0"],
                &["addr", "add", &own6, "dev", "ext0", "nodad"],
                &["link", "set", "ext0", "up"],
                &["route", "add", "default", "via", &gateway],
                &["route", "add", "default", "via", &gateway6],
            ])?;
            let clients = [external_client_ip(index), other_external_client_ip(index)];
            let clients4 = clients.map(|ip| format!("{ip}/24"));
            let clients6 = clients.map(|ip| format!("{}/64", v6(ip)));
            external.ip_batch(&[
                &["addr", "add", &clients4[0], "dev", &ext_if],
                &["addr", "add", &clients4[1], "dev", &ext_if],
                &["addr", "add", &clients6[0], "dev", &ext_if, "nodad"],
                &["addr", "add", &clients6[1], "dev", &ext_if, "nodad"],
                &["link", "set", &ext_if, "up"],
            ])?;
            let cgroup = cgroup_mount.join(format!("{id}-n{index}"));
            std::fs::create_dir_all(&cgroup)
                .with_context(|| format!("creating cgroup {}", cgroup.display()))?;
            nodes.push(ClusterNode {
                name: format!("node-{index}"),
                index,
                cgroup,
                internal_ip: Ipv4Addr::new(10, 251, 0, index),
                external_ip,
                bpffs: LabBpffs::mount(&node_dir)?,
                agent: None,
                args: Vec::new(),
                manifests: None,
                ns,
            });
        }
        // External IPs and load-balancer IPs arrive at node-1, as a router would send them.
        external.ip(&["route", "add", EXTERNAL_RANGE, "via", "10.250.1.1"])?;
        external.ip(&[
            "-6",
            "route",
            "add",
            EXTERNAL_RANGE6,
            "via",
            &v6(Ipv4Addr::new(10, 250, 1, 1)).to_string(),
        ])?;
        // The link between the nodes, and each node's route to the other's pods.
        nodes[0]
            .ns
            .ip(&crate::lab::veth("fab0", "fab0", &nodes[1].ns))?;
        for (i, node) in nodes.iter().enumerate() {
            let other = format!("10.251.0.{}", 2 - i);
            let own = format!("{}/24", node.internal_ip);
            let own6 = format!("{}/64", v6(node.internal_ip));
            let other_pods = format!("10.244.{}.0/24", 2 - i);
            let other_pods6 = format!("fd00:10:244:{}::/64", 2 - i);
            let other6 = v6(Ipv4Addr::new(10, 251, 0, 2 - i as u8)).to_string();
            node.ns.ip_batch(&[
                &["addr", "add", &own, "dev", "fab0"],
                &["addr", "add", &own6, "dev", "fab0", "nodad"],
                &["link", "set", "fab0", "up"],
                &["route", "add", &other_pods, "via", &other],
                &["route", "add", &other_pods6, "via", &other6],
            ])?;
        }
        let mut cluster = Cluster {
            id,
            pod_clients_outside_hooks: false,
            cgroup_mount,
            dir,
            pods: Vec::new(),
            external,
            servers: Vec::new(),
            nodes,
        };
        cluster.add_pod(CLIENT, 1, CLIENT_IP)?;
        cluster.add_pod(CLIENT_2, 2, CLIENT_2_IP)?;
        for (name, node, ip) in BACKENDS {
            cluster.add_pod(name, node, ip)?;
            cluster.start_servers(name)?;
        }
        Ok(cluster)
    }

    pub fn node(&self, index: u8) -> &ClusterNode {
        &self.nodes[index as usize - 1]
    }

    pub fn pod(&self, name: &str) -> &ClusterPod {
        self.pods
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no pod {name}"))
    }

    fn add_pod(&mut self, name: &str, node: u8, ip: Ipv4Addr) -> Result<()> {
        let ns = Netns::create(&format!("{}-{name}", self.id))?;
        let node_ns = &self.nodes[node as usize - 1].ns;
        let host_if = format!("lxc{}", self.pods.iter().filter(|p| p.node == node).count());
        wire_dual_stack_pod(node_ns, &ns, &host_if, ip)?;
        let cgroup = self.nodes[node as usize - 1].cgroup.join(name);
        std::fs::create_dir_all(&cgroup)
            .with_context(|| format!("creating cgroup {}", cgroup.display()))?;
        self.pods.push(ClusterPod {
            name: name.into(),
            ip,
            node,
            ns,
            cgroup,
        });
        Ok(())
    }

    /// A command that runs `podclient` (the tests' `podclient` binary) as a process of pod
    /// `name`: in the pod's cgroup and network namespace. Arguments follow.
    pub fn pod_command(&self, name: &str, podclient: &Path) -> std::process::Command {
        let pod = self.pod(name);
        let mut command = std::process::Command::new(podclient);
        command
            .arg("--netns")
            .arg(&pod.ns.name)
            .arg("--cgroup")
            .arg(&pod.cgroup);
        command
    }

    fn start_servers(&mut self, name: &str) -> Result<()> {
        let pod = self.pod(name);
        let name = pod.name.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let stop2 = stop.clone();
        let handle = pod.ns.spawn(move || -> Result<()> {
            let mut tcp = Vec::new();
            let mut udp = Vec::new();
            // One socket per family (the pod has bindv6only set), so IPv4 peers are
            // reported as IPv4 addresses.
            for any in [
                IpAddr::from(Ipv4Addr::UNSPECIFIED),
                Ipv6Addr::UNSPECIFIED.into(),
            ] {
                for port in TCP_PORTS {
                    let l = TcpListener::bind((any, port))?;
                    l.set_nonblocking(true)?;
                    tcp.push(l);
                }
                let u = UdpSocket::bind((any, UDP_PORT))?;
                u.set_nonblocking(true)?;
                udp.push(u);
                if let Some(fd) = sctp_socket(SocketAddr::new(any, SCTP_PORT))? {
                    // SAFETY: a bound socket of our own.
                    if unsafe { libc::listen(fd.as_raw_fd(), 128) } != 0 {
                        return Err(std::io::Error::last_os_error().into());
                    }
                    let l = TcpListener::from(fd);
                    l.set_nonblocking(true)?;
                    tcp.push(l);
                }
            }
            ready_tx.send(()).ok();
            let mut fds: Vec<libc::pollfd> = tcp
                .iter()
                .map(|l| l.as_raw_fd())
                .chain(udp.iter().map(|u| u.as_raw_fd()))
                .map(|fd| libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                })
                .collect();
            let mut buf = [0u8; 65536];
            while !stop2.load(Ordering::Relaxed) {
                // SAFETY: valid pollfd entries.
                if unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as _, 50) } <= 0 {
                    continue;
                }
                for l in &tcp {
                    while let Ok((stream, _)) = l.accept() {
                        let name = name.clone();
                        std::thread::spawn(move || serve_tcp(stream, &name));
                    }
                }
                for udp in &udp {
                    while let Ok((n, from)) = udp.recv_from(&mut buf) {
                        // Large datagrams are echoed with the greeting in front (fragment
                        // tests).
                        let mut reply = format!("{name} {from} {UDP_PORT}\n").into_bytes();
                        if n > 100 {
                            reply.extend_from_slice(&buf[..n]);
                        }
                        let _ = udp.send_to(&reply, from);
                    }
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

    /// Writes the manifests both agents read; returns the path.
    pub fn write_manifests(&self, yaml: &str) -> Result<PathBuf> {
        let path = self.dir.path().join("cluster.yaml");
        let tmp = self.dir.path().join(".cluster.yaml.tmp");
        std::fs::write(&tmp, format!("{}{yaml}", self.node_objects()))?;
        std::fs::rename(&tmp, &path)?;
        Ok(path)
    }

    /// The two Node objects (InternalIP on the link between nodes, ExternalIP outside, zones
    /// z1 and z2, each node's pod ranges as spec.podCIDRs).
    fn node_objects(&self) -> String {
        self.nodes
            .iter()
            .map(|n| {
                format!(
                    "apiVersion: v1\nkind: Node\nmetadata:\n  name: {}\n  labels: {{topology.kubernetes.io/zone: z{}}}\nspec:\n  podCIDR: \"10.244.{i}.0/24\"\n  podCIDRs: [\"10.244.{i}.0/24\", \"fd00:10:244:{i}::/64\"]\nstatus:\n  addresses:\n  - {{type: InternalIP, address: \"{}\"}}\n  - {{type: InternalIP, address: \"{}\"}}\n  - {{type: ExternalIP, address: \"{}\"}}\n  - {{type: ExternalIP, address: \"{}\"}}\n---\n",
                    n.name, n.index, n.internal_ip, v6(n.internal_ip), n.external_ip, v6(n.external_ip),
                    i = n.index
                )
            })
            .collect()
    }

    /// Starts an agent on every node with `extra` flags and waits until each has attached to
    /// all its interfaces and synced.
    pub fn start_agents(&mut self, manifests: &Path, extra: &[&str]) -> Result<()> {
        for i in 0..self.nodes.len() {
            let node = &mut self.nodes[i];
            let root = node.bpffs.root();
            let mut args: Vec<String> = [
                "--bpffs-root",
                root.to_str().unwrap(),
                "--interfaces",
                "lxc*,ext0,fab0",
                "--hostname-override",
                &node.name,
                "--cgroup-path",
                &node.cgroup.to_string_lossy(),
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            args.extend(extra.iter().map(|s| s.to_string()));
            node.args = args;
            node.manifests = Some(manifests.to_path_buf());
            self.run_agent(i as u8 + 1)?;
        }
        Ok(())
    }

    /// Stops node `index`'s agent (an eBPF agent's datapath keeps serving from its pins).
    pub fn stop_agent(&mut self, index: u8) -> Result<()> {
        if let Some(mut a) = self.nodes[index as usize - 1].agent.take() {
            a.stop()?;
        }
        Ok(())
    }

    /// Stops node `index`'s agent and starts it again with the same arguments (the new one
    /// adopts what the old one pinned).
    pub fn restart_agent(&mut self, index: u8) -> Result<()> {
        if let Some(mut a) = self.nodes[index as usize - 1].agent.take() {
            a.stop()?;
        }
        self.run_agent(index)
    }

    fn run_agent(&mut self, index: u8) -> Result<()> {
        let interfaces = 2 + self.pods.iter().filter(|p| p.node == index).count();
        let runs = std::fs::read_dir(self.dir.path())?
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("agent-"))
            .count();
        let node = &mut self.nodes[index as usize - 1];
        let log = self
            .dir
            .path()
            .join(format!("agent-{}-{runs}.log", node.name));
        let args: Vec<&str> = node.args.iter().map(String::as_str).collect();
        let ebpf = crate::lab::attaches_interfaces(&args);
        let agent = Agent::start(&node.ns, node.manifests.as_deref(), &log, &args)?;
        node.agent = Some(agent);
        node.agent.as_mut().unwrap().wait_for_log(|log| {
            (!ebpf || log.matches("attached interface=").count() >= interfaces)
                && log.contains("synced")
        })
    }

    /// Runs `script` with bash as a process of node `index` itself: in its network namespace
    /// and in its host cgroup. Returns (success, stdout).
    pub fn on_node(&self, index: u8, script: &str) -> Result<(bool, String)> {
        let node = self.node(index);
        let procs = node.cgroup.join("cgroup.procs");
        let out = std::process::Command::new("bash")
            .arg("-c")
            .arg(format!(
                "echo $$ > {} && exec timeout 120 ip netns exec {} bash -c \"$0\"",
                procs.display(),
                node.ns.name
            ))
            .arg(script)
            .output()?;
        Ok((
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        ))
    }

    /// `proxy-agent inspect ARGS` on node `index`, as an operator runs it in the agent's
    /// pod (the agent's binary, in the node's network namespace): what it printed, or an
    /// error with what it said.
    pub fn inspect(&self, index: u8, args: &[&str]) -> Result<String> {
        let out = self.inspect_command(index, args)?.output()?;
        if !out.status.success() {
            anyhow::bail!(
                "proxy-agent inspect {args:?} on node {index}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `proxy-agent inspect ARGS` on node `index`, as [`Cluster::inspect`] runs it, with
    /// node `index`'s `--bpffs-root`, to spawn (`inspect flows --follow` runs until stopped).
    pub fn inspect_command(&self, index: u8, args: &[&str]) -> Result<std::process::Command> {
        let node = self.node(index);
        let mut command = std::process::Command::new("ip");
        command
            .args(["netns", "exec", &node.ns.name])
            .arg(crate::lab::agent_binary()?)
            .arg("inspect")
            .args(args);
        Ok(command)
    }

    /// A command that runs `podclient` as a process of node `index` itself: in its host
    /// cgroup (below the hooks) and network namespace.
    pub fn node_command(&self, index: u8, podclient: &Path) -> std::process::Command {
        let node = self.node(index);
        let mut command = std::process::Command::new(podclient);
        command
            .arg("--netns")
            .arg(&node.ns.name)
            .arg("--cgroup")
            .arg(&node.cgroup);
        command
    }

    /// A TCP connection held open by a process of pod `name` (`podclient session`).
    pub fn pod_session(
        &self,
        name: &str,
        podclient: &Path,
        to: impl Into<SocketAddr>,
    ) -> Result<PodSession> {
        let mut child = self
            .pod_command(name, podclient)
            .args(["session", &to.into().to_string()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .context("starting podclient")?;
        let stdin = child.stdin.take();
        let mut stdout = BufReader::new(child.stdout.take().context("podclient stdout")?);
        let mut session = PodSession {
            backend: String::new(),
            child,
            stdin,
            stdout: None,
        };
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        session.stdout = Some(stdout);
        session.backend = line
            .strip_prefix("OK ")
            .with_context(|| format!("opening the session: {line:?}"))?
            .trim()
            .to_string();
        Ok(session)
    }

    /// Both agents' logs, for failure messages.
    pub fn logs(&self) -> String {
        self.nodes
            .iter()
            .filter_map(|n| {
                n.agent
                    .as_ref()
                    .map(|a| format!("--- {}:\n{}", n.name, a.log_text()))
            })
            .collect()
    }

    /// Waits until both agents have logged `count` syncs in total more than `before`.
    pub fn wait_for_syncs(&mut self, before: usize) -> Result<()> {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            if self.sync_count() > before + 1 {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                bail!("agents did not sync:\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn sync_count(&self) -> usize {
        self.nodes
            .iter()
            .filter_map(|n| n.agent.as_ref())
            .map(|a| a.log_text().matches(" synced full=").count())
            .sum()
    }
}

/// A TCP connection held open by a pod's process; closed when dropped.
pub struct PodSession {
    /// The greeting of the pod that accepted it (`<pod> <peer> <port>`).
    pub backend: String,
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    stdout: Option<BufReader<std::process::ChildStdout>>,
}

impl PodSession {
    /// Sends a line and returns what comes back (the backends echo).
    pub fn exchange(&mut self, msg: &str) -> Result<String> {
        let stdin = self.stdin.as_mut().context("session closed")?;
        writeln!(stdin, "{msg}")?;
        stdin.flush()?;
        let mut line = String::new();
        self.stdout
            .as_mut()
            .context("session closed")?
            .read_line(&mut line)?;
        match line.strip_prefix("OK ") {
            Some(echo) => Ok(echo.trim().to_string()),
            None => bail!("{}", line.trim()),
        }
    }
}

impl Drop for PodSession {
    fn drop(&mut self) {
        drop(self.stdin.take());
        if self.child.wait().is_err() {
            let _ = self.child.kill();
        }
    }
}

fn serve_tcp(mut stream: TcpStream, name: &str) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    let (Ok(peer), Ok(local)) = (stream.peer_addr(), stream.local_addr()) else {
        return;
    };
    if stream
        .write_all(format!("{name} {peer} {}\n", local.port()).as_bytes())
        .is_err()
    {
        return;
    }
    crate::lab::echo(&mut stream);
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut a) = node.agent.take() {
                let _ = a.stop();
            }
            // What the agent left attached and pinned goes with the lab.
            let root = node.bpffs.root();
            if let Ok(bin) = crate::lab::agent_binary() {
                let _ = std::process::Command::new("ip")
                    .args(["netns", "exec", &node.ns.name])
                    .arg(bin)
                    .args(["--bpffs-root", root.to_str().unwrap(), "--cleanup"])
                    .output();
            }
        }
        for (stop, _) in &self.servers {
            stop.store(true, Ordering::Relaxed);
        }
        for (_, h) in self.servers.drain(..) {
            let _ = h.join();
        }
        for pod in &self.pods {
            let _ = std::fs::remove_dir(&pod.cgroup);
        }
        for node in &self.nodes {
            let _ = std::fs::remove_dir(&node.cgroup);
        }
        let _ = crate::lab::sh("umount", &["-l", &self.cgroup_mount.to_string_lossy()]);
    }
}

/// A pod wired for both families: `lab::wire_pod`, and the IPv6 half: the pod's /128, a
/// route to it on the node, and the pod's default route via a link-local gateway address
/// the node holds on every pod interface, as Calico does with IPv4's 169.254.1.1.
fn wire_dual_stack_pod(node: &Netns, pod: &Netns, host_if: &str, ip: Ipv4Addr) -> Result<()> {
    const GATEWAY: &str = "fe80::1";
    let gateway = format!("{GATEWAY}/64");
    let host = format!("{}/128", v6(ip));
    // Each family gets its own sockets, so IPv4 peers are not shown as ::ffff:a.b.c.d; the
    // address is ready before the interface comes up.
    pod.sysctl("net.ipv6.bindv6only=1")?;
    pod.sysctl("net.ipv6.conf.default.accept_dad=0")?;
    crate::lab::wire_pod_with(
        node,
        pod,
        host_if,
        ip,
        &[
            &["addr", "add", &gateway, "dev", host_if, "nodad"],
            &["route", "add", &host, "dev", host_if],
        ],
        &[
            &["addr", "add", &host, "dev", "eth0", "nodad"],
            &["route", "add", "default", "via", GATEWAY, "dev", "eth0"],
        ],
    )
}

/// Removes node cgroups that labs of killed runs left (named after their process).
fn sweep_stale_cgroups(mount: &Path) {
    let Ok(entries) = std::fs::read_dir(mount) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let mut parts = name.split('-');
        if parts.next() != Some(PREFIX) {
            continue;
        }
        let Some(pid) = parts.next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            // Its pods' cgroups first: a cgroup with children cannot be removed.
            for child in std::fs::read_dir(e.path()).into_iter().flatten().flatten() {
                if child.file_type().is_ok_and(|t| t.is_dir()) {
                    let _ = std::fs::remove_dir(child.path());
                }
            }
            let _ = std::fs::remove_dir(e.path());
        }
    }
}
