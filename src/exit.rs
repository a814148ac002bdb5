//! Every exit code pgleader returns, in one place. docs/reference.md and the manual page list the
//! same table (README.md the common codes); scripts, systemd units (`SuccessExitStatus=`) and cron
//! wrappers depend on it.

use std::fmt;

use nix::sys::signal::Signal;

/// Success; also what `run` returns when it was shut down while no child was running.
pub const SUCCESS: u8 = 0;
/// A fatal runtime error: a permanent connection error (bad password, unknown database), an
/// unreachable database under `--no-wait`, an internal failure.
pub const FAILURE: u8 = 1;
/// A usage error: bad option values, a missing command, an unsafe combination of timings.
pub const USAGE: u8 = 2;
/// `status`: nobody holds the lock. `step-down`: there was no leader to step down.
pub const LOCK_FREE: u8 = 3;
/// `step-down`: no replica waited to take over, so the request was not sent; the leader keeps
/// leading.
pub const NO_FOLLOWER: u8 = 4;
/// `step-down`: the request was sent, but no other replica leads within `--timeout` (or the
/// leader did not hear it).
pub const NOT_MOVED: u8 = 5;
/// `--once`: leadership was lost while the command ran; the command was stopped. Chosen from
/// sysexits.h (EX_TEMPFAIL): running again later is the right reaction.
pub const LOST_LEADERSHIP: u8 = 75;
/// The command exists but cannot be executed (permissions, not a regular file, bad format).
pub const CANNOT_EXECUTE: u8 = 126;
/// The command was not found.
pub const NOT_FOUND: u8 = 127;

/// How a child process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChildStatus {
    /// It called `exit` with this code.
    Exited(i32),
    /// It was killed by this signal.
    Signaled(Signal),
}

impl ChildStatus {
    /// The status pgleader passes on: the exit code, or 128+N for death by signal N, as shells
    /// and tini report it.
    pub fn exit_code(self) -> u8 {
        match self {
            ChildStatus::Exited(code) => (code & 0xff) as u8,
            ChildStatus::Signaled(signal) => 128u8.wrapping_add(signal as i32 as u8),
        }
    }
}

impl fmt::Display for ChildStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChildStatus::Exited(code) => write!(f, "exit code {code}"),
            ChildStatus::Signaled(signal) => write!(f, "signal {}", signal.as_str()),
        }
    }
}

/// How `pgleader run` ended, short of an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The command ran and ended: under `--once`, or when pgleader was shut down while it ran.
    ChildExited(ChildStatus),
    /// pgleader was shut down while no command was running.
    Shutdown,
    /// `--no-wait` found the lock held by someone else; the value is `--busy-exit-code`.
    Busy(u8),
    /// `--once` lost leadership while the command ran.
    LostLeadership,
}

impl Outcome {
    pub fn exit_code(self) -> u8 {
        match self {
            Outcome::ChildExited(status) => status.exit_code(),
            Outcome::Shutdown => SUCCESS,
            Outcome::Busy(code) => code,
            Outcome::LostLeadership => LOST_LEADERSHIP,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signal_death_maps_to_128_plus_the_signal() {
        assert_eq!(ChildStatus::Signaled(Signal::SIGKILL).exit_code(), 137);
        assert_eq!(ChildStatus::Signaled(Signal::SIGTERM).exit_code(), 143);
        assert_eq!(ChildStatus::Exited(3).exit_code(), 3);
        assert_eq!(ChildStatus::Exited(256 + 4).exit_code(), 4);
    }
}
