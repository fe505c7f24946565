//! The daemon's flags take their default, environment variable, value name, help and
//! `--help` section from the pool's settings table (`umbp_pool::config::settings`), so the
//! clap arguments say only how a value is parsed and nothing the table says.

use clap::{Arg, ArgMatches, Command, CommandFactory, FromArgMatches};
use umbp_pool::config::settings::{self, Setting};

/// `C`'s command with every flag filled from its row. A flag without a row is a bug the
/// daemon's tests catch (`every_flag_comes_from_the_settings_table`); it panics here.
pub fn command<C: CommandFactory>() -> Command {
    let mut cmd = C::command();
    let flags: Vec<(String, String)> =
        cmd.get_arguments().filter_map(|a| Some((a.get_id().to_string(), a.get_long()?.to_string()))).collect();
    for (id, flag) in flags {
        let row = settings::by_flag(&flag).unwrap_or_else(|| panic!("--{flag} has no row in the settings table"));
        cmd = cmd.mut_arg(id, |a| from_row(a, row));
    }
    cmd
}

fn from_row(a: Arg, row: &'static Setting) -> Arg {
    let mut a = a.help(row.help);
    if a.get_action().takes_values() {
        a = a.value_name(row.kind);
    }
    if let Some(default) = row.default {
        // A derived non-`Option` field is required unless it has a default: it has one now.
        a = a.default_value(default).required(false);
    }
    if let Some(env) = row.env {
        a = a.env(env);
    }
    if let Some(heading) = row.heading {
        a = a.help_heading(heading);
    }
    a
}

/// Parses `args` (program name first) with the table's defaults and variables.
pub fn try_parse_from<C, I, T>(args: I) -> Result<C, clap::Error>
where
    C: CommandFactory + FromArgMatches,
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let matches: ArgMatches = command::<C>().try_get_matches_from(args)?;
    C::from_arg_matches(&matches)
}

/// Parses the process's arguments; on an error prints it (or the help) and exits as clap does.
pub fn parse<C: CommandFactory + FromArgMatches>() -> C {
    try_parse_from(std::env::args_os()).unwrap_or_else(|e| e.exit())
}
