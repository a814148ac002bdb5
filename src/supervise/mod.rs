//! Supervising commands. Two rooms run them:
//! - the single leader (`supervisor.rs`, `supervisor/`): the state machine of `pgleader run`
//!   (elect, lead, stop, re-enter), with its duty while it leads (`duty.rs`: a service, a
//!   single run, a schedule);
//! - the shard room (`sharded/`): one holder session, one table of commands (`commands.rs`),
//!   and a duty that says what runs for each item the replica holds: `pgleader run --shards
//!   K` (a command per shard), `--shards K --schedule` (each shard's occurrences once) and
//!   `pgleader cron` (the crontab's jobs shared out among the replicas, each owner running its
//!   jobs' occurrences).
//!
//! Beside them: the keeper, the process every command runs under (`keeper/`: what runs in it,
//! what both sides speak, and pgleader's handle to it), `--pre-start`/`--post-stop` (`hook.rs`), the health probe (`health.rs`), the
//! signals pgleader receives and what each means (`signals.rs`, `inbox.rs`; a crontab's change
//! under `--inotify` arrives as one, from `file_watch.rs`), how the log names
//! a command (`label.rs`), and what `/proc` says about a process group (`procfs.rs`).
//!
//! Every command, whoever runs it, is stopped by one set of rules (`stop.rs`): the single
//! leader awaits them (`inbox.rs`), and the shard room keeps its commands in a table
//! (`commands.rs`) that drives one stop per command. Each leadership shares its deadline with
//! its commands' keepers (`watchdog.rs`), which stop their trees by the same rules should
//! pgleader itself stop running.
//!
//! Everything here works through the election's boundary (`election/`): the supervisor is
//! generic over the backend and knows nothing of SQL or of any backend's types.

pub mod commands;
pub mod duty;
pub mod file_watch;
pub mod health;
pub mod heap;
pub mod hook;
pub mod inbox;
pub mod keeper;
pub mod label;
pub mod procfs;
pub mod ready;
pub mod sharded;
pub mod signals;
pub mod stop;
pub mod supervisor;
pub mod watchdog;

use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::time::Instant;
use tracing::info;

use crate::election::lock::LockKey;
use crate::schedule::Plan;
use crate::time::for_people as fmt;

/// What the supervisor needs of `pgleader run`'s settings (the backend has the rest).
#[derive(Debug, Clone)]
pub struct Settings {
    pub lock: LockKey,
    /// The name pgleader's sessions carry on the server (`<name>:<pid>@<host>`).
    pub session_name: String,
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
    /// `--shards` and `--max-shards`: run the command once per shard (see `sharded/`).
    pub shards: Option<Sharding>,
    /// `--health-cmd` and its companions (see `health.rs`).
    pub health: Option<health::HealthCheck>,
    /// `--pre-start`, `--post-stop` and `--hook-timeout` (see `hook.rs`).
    pub hooks: hook::Hooks,
}

/// How many shards a sharded lock has, and how many this replica takes at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sharding {
    pub count: u32,
    pub cap: Option<u32>,
}

impl Settings {
    /// How long a new leader waits before its command may start: `--takeover-delay`, or what
    /// is left of the restart fence when the server freed every lock a moment ago.
    ///
    /// A server restart, the crash of any server process (after which the postmaster ends
    /// every session) and a failover to a promoted standby all free every lock at once,
    /// possibly before the previous leader has noticed. Its command is gone at most
    /// --restart-fence (check-interval + check-timeout + kill-timeout + margin) later. The
    /// server tells when it last started or reset; a failover shows only on this side, as the
    /// loss of this pgleader's previous session (`last_disturbance`), after which every session
    /// of the new primary, this one included, is younger than the failover.
    pub fn start_delay(
        &self,
        last_disturbance: Option<Instant>,
        since_server_reset: Duration,
        session_age: Duration,
    ) -> Duration {
        let (fence, takeover) = (self.restart_fence, self.takeover_delay);
        let mut since_reset = since_server_reset;
        if last_disturbance.is_some_and(|at| at.elapsed() < fence) {
            since_reset = since_reset.min(session_age);
        }
        let restart_fence = fence.saturating_sub(since_reset);
        let delay = takeover.max(restart_fence);
        if !restart_fence.is_zero() && restart_fence >= takeover {
            info!(
                event = "restart_fence",
                since_reset = %fmt(since_reset),
                "the server restarted, reset or failed over {} ago: starting the command in {} (--restart-fence), in case the previous leader's command still runs",
                fmt(since_reset),
                fmt(restart_fence)
            );
        } else if !delay.is_zero() {
            info!(
                event = "takeover_delay",
                "starting the command in {} (--takeover-delay)",
                fmt(delay)
            );
        }
        delay
    }

    /// The timings every stop of a command follows (`stop.rs`).
    pub fn stop_rules(&self) -> stop::StopRules {
        stop::StopRules {
            kill_timeout: self.kill_timeout,
            hook_timeout: self.hooks.timeout,
        }
    }

    /// How a keeper stops its command by itself once the leadership's deadline passes with
    /// no news from pgleader (`watchdog.rs`): the stop's own signal and kill timeout.
    pub fn deadline_terms(&self) -> watchdog::Terms {
        watchdog::Terms {
            signal: self.kill_signal,
            kill_timeout: self.kill_timeout,
            without_news: self.check_interval + self.check_timeout,
        }
    }

    /// What every leader's command finds in its environment: the lock, the session that holds
    /// it, and the fencing token.
    pub fn leader_env(&self, session_id: i32, epoch: i64) -> Vec<(&'static str, String)> {
        let mut env = vec![
            ("PGLEADER_LOCK_ID", self.lock.key().to_string()),
            ("PGLEADER_BACKEND_PID", session_id.to_string()),
            ("PGLEADER_EPOCH", epoch.to_string()),
        ];
        if let Some(name) = self.lock.name() {
            env.push(("PGLEADER_LOCK_NAME", name.to_owned()));
        }
        env
    }
}
