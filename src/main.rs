//! The `pgleader` binary: parse the command line, set up logging and a single-threaded
//! runtime, run, map the result to an exit code. Everything else lives in the library.
//!
//! The same binary is the keeper (`pgleader-keeper`, see `supervise::keeper`), which starts
//! from [`KEEPER`] before Rust's runtime sets itself up for `main`.

use std::process::ExitCode;

use clap::Parser;
use pgleader::cli::Cli;
use pgleader::exit;
use pgleader::operate::logging;
use pgleader::supervise::keeper;

/// The keeper's way in: a constructor, which the C runtime calls before `main`. A keeper
/// needs none of what Rust's runtime sets up before `main` (its stack-overflow handler reads
/// `/proc/self/maps` through stdio and `sscanf`), and every page of code it runs stays
/// resident for as long as it waits: it does the little of that set-up it relies on itself
/// (`keeper::main`). pgleader passes through untouched. It runs after std's own constructor,
/// which records the arguments (that one has a priority, this one none).
#[used]
#[unsafe(link_section = ".init_array")]
static KEEPER: extern "C" fn() = keeper_entry;

extern "C" fn keeper_entry() {
    if keeper::is_keeper_invocation() {
        keeper::main();
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => {
            let _ = err.print();
            return ExitCode::from(if err.use_stderr() {
                exit::USAGE
            } else {
                exit::SUCCESS
            });
        }
    };
    let verbosity = cli.logging.verbose as i8 - cli.logging.quiet as i8;
    logging::init(cli.logging.log_format, verbosity);

    // One thread: the thread that spawns the command's keeper lives as long as pgleader.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            tracing::error!(event = "fatal", "cannot start the runtime: {err}");
            return ExitCode::from(exit::FAILURE);
        }
    };
    match runtime.block_on(pgleader::execute(cli.command)) {
        Ok(code) => ExitCode::from(code),
        Err(err) => {
            tracing::error!(event = "fatal", "{err:#}");
            ExitCode::from(pgleader::exit_code_of(&err))
        }
    }
}
