//! Supervising the command: the state machine of `pgleader run` (elect, lead, stop, re-enter),
//! the leader's duty while it leads (a service, a single run, a schedule), the job and its
//! keeper process, the signals pgleader receives, and what `/proc` says about a process group.
//!
//! Everything here works through the election's boundary (`election/`): the supervisor is
//! generic over the backend and knows nothing of SQL or of any backend's types.

pub mod duty;
pub mod inbox;
pub mod job;
pub mod keeper;
pub mod procfs;
pub mod signals;
pub mod spawn;
pub mod supervisor;

use std::time::Duration;

use nix::sys::signal::Signal;

use crate::election::lock::LockKey;
use crate::schedule::Plan;
use job::CommandLine;

/// What the supervisor needs of `pgleader run`'s settings (the backend has the rest).
#[derive(Debug, Clone)]
pub struct Settings {
    pub lock: LockKey,
    /// The name pgleader's sessions carry on the server (`<name>:<pid>@<host>`).
    pub session_name: String,
    pub command: CommandLine,
    pub once: bool,
    pub no_wait: bool,
    pub busy_exit_code: u8,
    pub check_interval: Duration,
    pub check_timeout: Duration,
    pub kill_signal: Signal,
    pub kill_timeout: Duration,
    pub restart_delay: Duration,
    pub takeover_delay: Duration,
    /// See `--restart-fence`; already resolved from `auto`.
    pub restart_fence: Duration,
    pub relinquish_after: Option<Duration>,
    pub relinquish_schedule: Option<croner::Cron>,
    /// `--schedule` and its companions.
    pub schedule: Option<Plan>,
    /// How long connecting may take (bounds preparing a session's ledger too).
    pub connect_timeout: Duration,
}
