//! The log: plain text on stderr (what `kubectl logs` shows), colours only on a terminal,
//! and kube-proxy's `-v` levels mapped onto this agent's own output.

use std::io::IsTerminal;

/// The filter for a verbosity, unless `RUST_LOG` sets one. Levels 2-3 turn on this agent's
/// debug lines; 4 and up also the datapath's per-flow lines (`proxy_ebpf`, through
/// aya-log). Dependencies stay at info (aya's loader at warn below 2): their debug and
/// trace output (mio, notify, hyper polling) says nothing about Services.
pub fn filter(verbosity: u32) -> &'static str {
    match verbosity {
        0 | 1 => "info,aya=warn,aya_obj=warn",
        2 | 3 => "info,proxy_agent=debug",
        _ => "info,proxy_agent=debug,proxy_ebpf=debug",
    }
}

pub fn init(verbosity: u32) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(filter(verbosity)));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
}
