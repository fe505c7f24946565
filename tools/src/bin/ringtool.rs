//! `ringtool`: see inside a live UMBP pool (its report, rings, index and KV events) without
//! disturbing it, and decode protocol records. See `ringtool --help`.

use std::process::ExitCode;

use clap::Parser;
use umbp_tools::ringtool::{run, Cli, STDOUT_CLOSED};

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e == STDOUT_CLOSED => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ringtool: {e}");
            ExitCode::FAILURE
        }
    }
}
