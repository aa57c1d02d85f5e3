//! `proxy-agent inspect`: what the agent on this node decided, and why, for operators
//! (`kubectl exec` into the agent's pod; the binary is the DaemonSet's own).
//!
//! | command | answers | from |
//! |---|---|---|
//! | `inspect services [NAMESPACE/NAME]` | every frontend of the service ports this node serves, its backends with weight and state, and traffic counters per frontend and backend | the desired state the proxier serves, and the mode's counters ([`services`]); in eBPF mode with the agent stopped, the pinned maps ([`pinned`]) |
//! | `inspect conntrack [--service NAMESPACE/NAME]` | the flows through services: client, frontend, backend, protocol, state, idle time or expiry | the eBPF conntrack maps (from their pins), or kernel conntrack ([`conntrack`]) |
//! | `inspect trace SRC DST:PORT/PROTO` | what a new flow from SRC would get: frontend, source-range verdict, endpoint set, remembered affinity and tracked flows, scheduler candidates and rule, what decides it | the model's state and the mode's ([`trace`]), without sending a packet or changing state |
//! | `inspect flows --follow [--service NAMESPACE/NAME]` | new flows as the eBPF datapath decides them: path (tc or socket hook), client, frontend, Service, backend, verdict | a ring buffer the datapath fills only while someone follows ([`flows`]) |
//! | `inspect explain NAMESPACE/NAME` | for each port, family and frontend of a Service: served or why not; for each endpoint and each kind of traffic: serving, draining or unused, and the rule that decided it | the model's own decisions ([`crate::model::explain`]), asked of the running agent over [`server`] |
//!
//! Each prints an aligned table ([`table`]) or, with `-o json`, the answer's JSON, whose
//! field names are documented in docs/inspect.md and kept stable.

pub mod conntrack;
pub mod flows;
pub mod pinned;
pub mod server;
pub mod services;
pub mod table;
pub mod trace;

use std::{net::SocketAddr, process::ExitCode, time::Duration};

use anyhow::{anyhow, Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use http_body_util::{BodyExt, Empty};
use hyper::{body::Bytes, header, Request, StatusCode};
use hyper_util::rt::TokioIo;

use crate::model::{explain::Explanation, ObjectName};
use services::ServicesView;

/// Look at what the agent on this node decided, and why.
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// The agent's inspect endpoint (its --inspect-address).
    #[arg(long, global = true, default_value = server::DEFAULT_ADDRESS)]
    pub address: String,

    /// eBPF mode: the bpffs directory of the agent's pins (its --bpffs-root), read when the
    /// agent does not answer.
    #[arg(long = "bpffs-root", global = true, default_value = crate::datapath::pins::DEFAULT_BPFFS_ROOT)]
    pub bpffs_root: std::path::PathBuf,

    /// Output: an aligned table, or JSON (field names in docs/inspect.md).
    #[arg(
        short = 'o',
        long = "output",
        global = true,
        value_enum,
        default_value = "table"
    )]
    pub output: Output,

    #[command(subcommand)]
    pub what: What,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum What {
    /// Every frontend of the service ports this node serves (ClusterIP, NodePort, external
    /// and load-balancer IPs), its backends with weight and state, and traffic counters
    /// per frontend and backend from the mode's datapath, as `ipvsadm -Ln --stats`.
    Services {
        /// Only this Service, as NAMESPACE/NAME.
        service: Option<String>,
        /// Read the eBPF mode's pinned maps instead of asking the agent (done anyway when
        /// the agent does not answer and pins exist).
        #[arg(long)]
        pinned: bool,
    },
    /// The flows through services on this node: client, frontend, backend, protocol,
    /// state, and how long they have been idle (eBPF) or until they expire (kernel
    /// conntrack, in the netfilter and ipvs modes).
    Conntrack {
        /// Only this Service's flows, as NAMESPACE/NAME.
        #[arg(long)]
        service: Option<String>,
    },
    /// What a new flow from SRC to DST:PORT/PROTO would get on this node, worked out from
    /// what is programmed, without sending a packet or changing any state.
    Trace {
        /// The client's address.
        source: String,
        /// The destination, as ADDRESS:PORT/PROTOCOL (`10.96.0.10:80/TCP`).
        destination: String,
    },
    /// New flows as the eBPF datapath decides them (frontend, backend, verdict, and whether
    /// a packet at tc or a socket hook decided), until Ctrl-C. The datapath records them only
    /// while someone follows; `-o json` prints one object per line.
    Flows {
        /// Keep printing new flows as they come (needed: nothing is recorded otherwise).
        #[arg(long, short = 'f')]
        follow: bool,
        /// Only this Service's flows, as NAMESPACE/NAME.
        #[arg(long)]
        service: Option<String>,
        /// Stop after this many flows.
        #[arg(long)]
        count: Option<u64>,
        /// At most this many flows per second on each CPU; the datapath counts the rest,
        /// and the total is printed at the end.
        #[arg(long, default_value_t = flows::DEFAULT_RATE, value_parser = clap::value_parser!(u32).range(1..=flows::MAX_RATE as i64))]
        rate: u32,
    },
    /// For each endpoint of a Service, whether this node sends it traffic, for each kind of
    /// traffic and frontend, and why (conditions, traffic policies, topology hints,
    /// terminating fallback, frontend conflicts): the decisions the agent's model made.
    Explain {
        /// The Service, as NAMESPACE/NAME.
        service: String,
    },
}

/// How long `inspect` waits for the agent (its own wait for the sync loop, and a margin).
const TIMEOUT: Duration = Duration::from_secs(server::ANSWER_TIMEOUT.as_secs() + 5);

/// Runs `proxy-agent inspect ...`: prints the answer, or one line saying what failed.
pub fn main(args: InspectArgs) -> ExitCode {
    match run(&args) {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &InspectArgs) -> Result<String> {
    let addr = server::address(&args.address).context("--address")?;
    match &args.what {
        What::Services { service, pinned } => {
            let name = service.as_deref().map(object_name).transpose()?;
            let path = match &name {
                Some(n) => format!("/debug/services/{n}"),
                None => "/debug/services".into(),
            };
            let from_pins = |why: Option<anyhow::Error>| -> Result<ServicesView> {
                if let Some(e) = why {
                    eprintln!(
                        "the agent did not answer ({e:#}): reading the pinned maps under {}",
                        args.bpffs_root.display()
                    );
                }
                pinned::services(
                    &args.bpffs_root,
                    name.as_ref(),
                    &crate::cli::default_node_name(),
                )
            };
            let view = if *pinned {
                from_pins(None)?
            } else {
                match get(addr, &path) {
                    Ok(body) => {
                        let view: ServicesView =
                            serde_json::from_str(&body).with_context(|| {
                                format!("the agent's answer is not a services view: {body}")
                            })?;
                        if args.output == Output::Json {
                            return Ok(body);
                        }
                        view
                    }
                    Err(Unanswered::Unreachable(e)) if args.bpffs_root.join("maps").is_dir() => {
                        from_pins(Some(e))?
                    }
                    Err(e) => return Err(e.into()),
                }
            };
            Ok(match args.output {
                Output::Json => serde_json::to_string_pretty(&view)? + "\n",
                Output::Table => table::services(&view),
            })
        }
        What::Conntrack { service } => {
            let name = service.as_deref().map(object_name).transpose()?;
            let path = match &name {
                Some(n) => format!("/debug/conntrack/{n}"),
                None => "/debug/conntrack".into(),
            };
            let view = match get(addr, &path) {
                Ok(body) => {
                    if args.output == Output::Json {
                        return Ok(body);
                    }
                    serde_json::from_str(&body).with_context(|| {
                        format!("the agent's answer is not a conntrack view: {body}")
                    })?
                }
                Err(Unanswered::Unreachable(e)) if args.bpffs_root.join("maps").is_dir() => {
                    eprintln!(
                        "the agent did not answer ({e:#}): reading the pinned maps under {}",
                        args.bpffs_root.display()
                    );
                    let flows = conntrack::from_pins(&args.bpffs_root, name.as_ref())?;
                    conntrack::view(
                        &crate::cli::default_node_name(),
                        "ebpf",
                        conntrack::FROM_PINS,
                        flows,
                    )
                }
                Err(e) => return Err(e.into()),
            };
            Ok(match args.output {
                Output::Json => serde_json::to_string_pretty(&view)? + "\n",
                Output::Table => table::flows(&view),
            })
        }
        What::Trace {
            source,
            destination,
        } => {
            let client = trace::parse_client(source)?;
            let d = trace::parse_destination(destination)?;
            let body = get(
                addr,
                &format!("/debug/trace/{client}/{}/{}/{}", d.addr, d.port, d.protocol),
            )?;
            let view: trace::TraceView = serde_json::from_str(&body)
                .with_context(|| format!("the agent's answer is not a trace: {body}"))?;
            Ok(match args.output {
                Output::Json => body,
                Output::Table => table::trace(&view),
            })
        }
        What::Flows {
            follow: f,
            service,
            count,
            rate,
        } => follow(args, *f, service.as_deref(), *count, *rate),
        What::Explain { service } => {
            let body = get(addr, &format!("/debug/explain/{}", object_name(service)?))?;
            let explanation: Explanation = serde_json::from_str(&body)
                .with_context(|| format!("the agent's answer is not an explanation: {body}"))?;
            Ok(match args.output {
                Output::Json => body,
                Output::Table => table::explanation(&explanation),
            })
        }
    }
}

/// `inspect flows`: printed as they come, straight from the pins (nothing is left to
/// print after).
fn follow(
    args: &InspectArgs,
    follow: bool,
    service: Option<&str>,
    count: Option<u64>,
    rate: u32,
) -> Result<String> {
    if !follow {
        anyhow::bail!(
            "the datapath records new flows only while someone follows them: add --follow"
        );
    }
    let name = service.map(object_name).transpose()?;
    flows::follow(flows::Follow {
        root: &args.bpffs_root,
        service: name.as_ref(),
        count,
        rate,
        output: args.output,
    })?;
    Ok(String::new())
}

/// `NAMESPACE/NAME` as an object name.
fn object_name(service: &str) -> Result<ObjectName> {
    service
        .split_once('/')
        .filter(|(ns, n)| !ns.is_empty() && !n.is_empty() && !n.contains('/'))
        .map(|(namespace, name)| ObjectName {
            namespace: namespace.into(),
            name: name.into(),
        })
        .ok_or_else(|| anyhow!("{service:?}: expected NAMESPACE/NAME"))
}

/// Why a GET gave no answer to use.
#[derive(Debug)]
enum Unanswered {
    /// Nothing answered (no agent, or it hung): the pins may still be read.
    Unreachable(anyhow::Error),
    /// The agent answered, but not with the view (busy, a bad request).
    Refused(anyhow::Error),
}

impl From<Unanswered> for anyhow::Error {
    fn from(u: Unanswered) -> Self {
        match u {
            Unanswered::Unreachable(e) | Unanswered::Refused(e) => e,
        }
    }
}

/// GETs `path` from the agent's inspect endpoint: the body of a 200, else why not (with
/// the agent's own words when it answered).
fn get(addr: SocketAddr, path: &str) -> Result<String, Unanswered> {
    let answer = exchange(addr, path).map_err(Unanswered::Unreachable)?;
    match answer {
        (StatusCode::OK, body) => Ok(body),
        (status, body) => Err(Unanswered::Refused(anyhow!(
            "the agent answered {status}: {}",
            body.trim_end()
        ))),
    }
}

/// One GET exchange with the agent: its status and body.
fn exchange(addr: SocketAddr, path: &str) -> Result<(StatusCode, String)> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(addr).await.with_context(|| {
            format!("connecting to the agent's inspect endpoint {addr} (is the agent running on this node, with this --inspect-address?)")
        })?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(connection);
        let request = Request::get(path)
            .header(header::HOST, addr.to_string())
            .body(Empty::<Bytes>::new())?;
        let response = sender.send_request(request).await?;
        let status = response.status();
        let body = response.into_body().collect().await?.to_bytes();
        anyhow::Ok((status, String::from_utf8_lossy(&body).into_owned()))
    };
    runtime
        .block_on(async { tokio::time::timeout(TIMEOUT, exchange).await })
        .map_err(|_| anyhow!("the agent at {addr} did not answer within {TIMEOUT:?}"))?
}

/// Compares `actual` with the golden file `golden/<file>`; `PROXY_UPDATE_GOLDEN=1` rewrites
/// it instead (then review the diff).
#[cfg(test)]
pub(crate) fn assert_golden(file: &str, actual: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("src/inspect/golden")
        .join(file);
    if std::env::var_os("PROXY_UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (PROXY_UPDATE_GOLDEN=1 writes it)", path.display()));
    assert!(
        expected == actual,
        "{} differs (PROXY_UPDATE_GOLDEN=1 rewrites it):\n--- expected\n{expected}\n--- actual\n{actual}",
        path.display()
    );
}
