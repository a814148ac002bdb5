//! The `pgleader` binary: parse the command line, set up logging and a single-threaded
//! runtime, run, map the result to an exit code. Everything else lives in the library.

use std::process::ExitCode;

use clap::Parser;
use pgleader::cli::Cli;
use pgleader::exit;
use pgleader::operate::logging;
use pgleader::supervise::keeper;

fn main() -> ExitCode {
    if keeper::is_keeper_invocation() {
        keeper::main();
    }
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
