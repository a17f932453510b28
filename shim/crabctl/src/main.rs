//! crabctl: crab's command line for people and agent harnesses (`crabctl --help`).
//!
//! Parses the arguments ([`crabctl::cli`]), runs the command ([`crabctl::commands`]) and exits
//! with the status of its error's kind ([`crabctl::error`]): 0 success, 1 failed, 2 usage
//! error, 3 not found, 4 refused. With `-o json` a failure also prints its JSON error object on
//! stdout ([`crabctl::output`]).

use std::process::ExitCode;

use crabctl::{
    cli::Request,
    output::{self, Format},
};

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let invocation = match crabctl::cli::parse(std::env::args_os()) {
        Ok(invocation) => invocation,
        // Prints the usage error (status 2), or the help or version asked for (status 0).
        Err(e) => e.exit(),
    };
    let format = invocation.request.format();
    let prints_its_report = matches!(invocation.request, Request::Prune { .. });
    match crabctl::commands::run(&invocation.global, invocation.request).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("crabctl: {e}");
            // -o json: one document on stdout, the error's (prune has printed its report).
            let report_printed =
                prints_its_report && matches!(e, crabctl::CtlError::PruneFailures { .. });
            if format == Format::Json && !report_printed {
                output::print_json(&output::ErrorReport::of(&e));
            }
            ExitCode::from(e.exit_code())
        }
    }
}
