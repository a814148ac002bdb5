//! Whose command a log line is about: the single leader's, a shard's or a crontab job's. Both
//! processes name commands this way, pgleader in its stops and the keeper in the lines of its
//! own stop (`watchdog.rs`), so it lives below both.

use nix::sys::signal::Signal;
use tracing::{info, warn};

use crate::exit::ChildStatus;

/// Whose command a log line is about: the single leader's (no field, "the command"), or one of
/// many (a `shard` field, "the command of shard 3"; a `job` field, "the command of job report").
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Label {
    /// The `shard` field of the log lines, for a shard's command.
    pub shard: Option<u32>,
    /// The `job` field of the log lines, for a crontab job's command.
    pub job: Option<String>,
    /// What the command is called among many ("shard 3"); `None` for the single leader's.
    name: Option<String>,
}

impl Label {
    /// The single leader's command.
    pub fn leader() -> Label {
        Label::default()
    }

    /// Shard `index`'s command.
    pub fn shard(index: u32) -> Label {
        Label {
            shard: Some(index),
            job: None,
            name: Some(format!("shard {index}")),
        }
    }

    /// A crontab job's command.
    pub fn job(name: &str) -> Label {
        Label {
            shard: None,
            job: Some(name.to_owned()),
            name: Some(format!("job {name}")),
        }
    }

    /// What follows "the command" or "the keeper" in a message: nothing, or " of shard 3".
    pub fn of(&self) -> String {
        self.name
            .as_ref()
            .map_or_else(String::new, |name| format!(" of {name}"))
    }

    /// What the command is called among many ("shard 3"), or "the command".
    pub fn name(&self) -> &str {
        self.name.as_deref().unwrap_or("the command")
    }

    /// Logs an event about this command at info level, with its `shard` or `job` field.
    pub fn info(&self, event: &'static str, message: std::fmt::Arguments) {
        info!(
            event,
            shard = self.shard,
            job = self.job.as_deref(),
            "{message}"
        );
    }

    /// Logs a SIGKILL sent to this command's group (`--kill-timeout`, a second TERM, a keeper
    /// that does not finish), with the group and the signal received if one was.
    pub fn warn_kill(&self, pgid: i32, received: Option<Signal>, message: std::fmt::Arguments) {
        warn!(
            event = "kill",
            shard = self.shard,
            job = self.job.as_deref(),
            pgid,
            signal = received.map(Signal::as_str),
            "{message}"
        );
    }

    /// Logs that the command exited, with how.
    pub fn log_exited(&self, status: ChildStatus) {
        info!(event = "child_exited", shard = self.shard, job = self.job.as_deref(), status = %status, exit_code = status.exit_code(), "the command{} exited", self.of());
    }
}
