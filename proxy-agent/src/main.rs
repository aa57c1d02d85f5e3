//! `proxy-agent`: reads its settings, starts logging and the runtime, and hands over to
//! [`proxy_agent::agent::run`].

use std::process::ExitCode;

use clap::CommandFactory;
use proxy_agent::{
    agent,
    cli::{settings, Cli},
};

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let settings = match settings(&matches) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    agent::logging::init(settings.verbosity);
    let runtime = match tokio::runtime::Builder::new_current_thread()
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
