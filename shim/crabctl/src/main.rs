//! crabctl: crab's command line for people and agent harnesses (`crabctl --help`).
//!
//! Parses the arguments ([`crabctl::cli`]), runs the command ([`crabctl::commands`]) and exits
//! with the status of its error's kind ([`crabctl::error`]): 0 success, 1 failed, 2 usage
//! error, 3 not found, 4 refused.

use std::process::ExitCode;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let invocation = match crabctl::cli::parse(std::env::args_os()) {
        Ok(invocation) => invocation,
        // Prints the usage error (status 2), or the help or version asked for (status 0).
        Err(e) => e.exit(),
    };
    match crabctl::commands::run(&invocation.global, invocation.request).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("crabctl: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
