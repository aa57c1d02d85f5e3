//! `proxy-agent`: reads its settings, starts logging and the runtime, and hands over to
//! [`proxy_agent::agent::run`].

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};
use proxy_agent::{
    agent,
    cli::{settings, Cli, Command},
    inspect,
};

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    if let Some(("inspect", sub)) = matches.subcommand() {
        return match Command::from_arg_matches(&matches) {
            Ok(Command::Inspect(args)) => inspect::main(args),
            Err(e) => {
                eprintln!("error: {e} ({sub:?})");
                ExitCode::FAILURE
            }
        };
    }
    let settings = match settings(&matches) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    agent::logging::init(settings.verbosity);
    // The sync loop runs on this thread and blocks it while a sync lasts (an `nft` run over
    // 100 000 services takes minutes); the health, metrics and healthCheckNodePort servers,
    // the watches and the userspace relays run on the workers and keep answering. Two are
    // enough for that light work on any node size, and leave the node's cores to its pods.
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("proxy-agent-io")
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(agent::run(settings)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line, outermost context first: what failed and how to fix it.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
