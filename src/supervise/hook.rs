//! Hooks: `--pre-start` and `--post-stop`, shell command lines run around each run of the
//! command, in order and once per transition.
//!
//! They run in the keeper (`keeper/hooks.rs`), not in pgleader, because only the keeper is there on
//! every path: `--pre-start` after the win, before the command (a failure means the command
//! never starts), `--post-stop` once the command's whole tree is gone, whatever ended it, and
//! while the keeper still holds the leader's connection sockets, so that the lock is released
//! only after it finished, even when pgleader was killed -9. A hook is `sh -c LINE` with the
//! command's environment plus `PGLEADER_HOOK`, bounded by `--hook-timeout`, after which its
//! whole tree is killed; whatever it leaves running when it exits is killed too, so a hook
//! never outlives its turn. Its output goes to pgleader's log line by line, tagged with the
//! hook's name (the keeper logs in pgleader's format).
//!
//! `--pre-start` runs in the job's process group, so that stopping the job (a lost lock, a
//! shutdown) stops it as it would the command; `--post-stop` runs in a group of its own, out of
//! reach of the stop signals meant for the command it follows.

use std::ffi::OsString;
use std::fmt;
use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::fcntl::OFlag;
use nix::unistd::{Pid, pipe2};
use tracing::info;

use crate::exit::ChildStatus;

/// The hooks of `pgleader run`, as the keeper needs them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Hooks {
    pub pre_start: Option<String>,
    pub post_stop: Option<String>,
    /// `--hook-timeout`: how long each may run before its tree is killed.
    pub timeout: Duration,
}

/// Which hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hook {
    PreStart,
    PostStop,
}

impl Hook {
    /// The name in logs and in `PGLEADER_HOOK`.
    pub fn name(self) -> &'static str {
        match self {
            Hook::PreStart => "pre-start",
            Hook::PostStop => "post-stop",
        }
    }
}

impl fmt::Display for Hook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The keeper's arguments that carry the hooks: `KEY=VALUE` words.
const PRE_START: &str = "pre-start=";
const POST_STOP: &str = "post-stop=";
const TIMEOUT_MS: &str = "hook-timeout-ms=";

impl Hooks {
    /// Whether any hook is set.
    pub fn any(&self) -> bool {
        self.pre_start.is_some() || self.post_stop.is_some()
    }

    /// The words that carry the hooks to the keeper.
    pub fn to_args(&self) -> Vec<OsString> {
        let mut args = Vec::new();
        if let Some(line) = &self.pre_start {
            args.push(OsString::from(format!("{PRE_START}{line}")));
        }
        if let Some(line) = &self.post_stop {
            args.push(OsString::from(format!("{POST_STOP}{line}")));
        }
        if self.any() {
            args.push(OsString::from(format!(
                "{TIMEOUT_MS}{}",
                self.timeout.as_millis()
            )));
        }
        args
    }

    /// Takes in one of the keeper's option words; false if it is not a hook's.
    pub fn read_arg(&mut self, word: &str) -> bool {
        if let Some(line) = word.strip_prefix(PRE_START) {
            self.pre_start = Some(line.to_owned());
        } else if let Some(line) = word.strip_prefix(POST_STOP) {
            self.post_stop = Some(line.to_owned());
        } else if let Some(ms) = word.strip_prefix(TIMEOUT_MS) {
            self.timeout = Duration::from_millis(ms.parse().unwrap_or(0));
        } else {
            return false;
        }
        true
    }
}

/// How a hook ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// It exited with 0.
    Passed,
    /// It exited otherwise, or was killed by a signal.
    Failed(ChildStatus),
    /// It ran past `--hook-timeout`; its tree was killed.
    TimedOut,
    /// pgleader asked for everything to end; its tree was killed.
    Interrupted,
}

impl Ended {
    /// The value a report carries: the exit code, 128+N for signal N, -1 for a timeout, -2
    /// when it was interrupted.
    pub fn code(self) -> i32 {
        match self {
            Ended::Passed => 0,
            Ended::Failed(status) => i32::from(status.exit_code()),
            Ended::TimedOut => TIMED_OUT,
            Ended::Interrupted => INTERRUPTED,
        }
    }
}

pub const TIMED_OUT: i32 = -1;
pub const INTERRUPTED: i32 = -2;

/// What a report's value says about a hook, for people.
pub fn describe(code: i32) -> String {
    match code {
        TIMED_OUT => "it ran past --hook-timeout and was killed".to_owned(),
        INTERRUPTED => "it was interrupted".to_owned(),
        code if code > 128 => match nix::sys::signal::Signal::try_from(code - 128) {
            Ok(signal) => format!("it was killed by {}", signal.as_str()),
            Err(_) => format!("exit code {code}"),
        },
        code => format!("exit code {code}"),
    }
}

/// How long a replica (or a shard) whose `--pre-start` failed `failures` times in a row stays
/// out: 1s, doubling up to a minute, so that a healthy follower takes over at once and a
/// broken hook does not spin.
pub fn sit_out_after(failures: u32) -> Duration {
    const FIRST: Duration = Duration::from_secs(1);
    const LONGEST: Duration = Duration::from_secs(60);
    FIRST
        .saturating_mul(1 << failures.saturating_sub(1).min(6))
        .min(LONGEST)
}

/// A hook that runs in the keeper: its pid and the read end of its output.
#[derive(Debug)]
pub struct Running {
    pub hook: Hook,
    pub pid: Pid,
    pub started: Instant,
    output: Option<OwnedFd>,
    partial: Vec<u8>,
}

/// The longest line logged as one; longer ones are cut into pieces of this size.
const MAX_LINE: usize = 4096;

impl Running {
    /// Starts `sh -c LINE` with `env` added to the keeper's environment, its output into a
    /// pipe, in a process group of its own if `own_group`.
    pub fn spawn(
        hook: Hook,
        line: &str,
        env: &[(OsString, OsString)],
        own_group: bool,
    ) -> io::Result<Running> {
        let (read, write) = pipe2(OFlag::O_CLOEXEC)?;
        let parent = std::process::id() as libc::pid_t;
        let mut command = Command::new("/bin/sh");
        command
            .arg("-c")
            .arg(line)
            .envs(env.iter().map(|(key, value)| (key, value)))
            .env("PGLEADER_HOOK", hook.name())
            .stdin(Stdio::null())
            .stdout(Stdio::from(write.try_clone()?))
            .stderr(Stdio::from(write));
        if own_group {
            command.process_group(0);
        }
        // SAFETY: only async-signal-safe system calls, on values computed before the fork.
        unsafe {
            command.pre_exec(move || {
                // Until its own group was set, the child was in the job's group: a stop
                // signal meant for the command may be pending (blocked) here. Ignoring a
                // signal discards it; then back to the default.
                if own_group {
                    for signal in 1..32 {
                        if signal != libc::SIGKILL && signal != libc::SIGSTOP {
                            libc::signal(signal, libc::SIG_IGN);
                            libc::signal(signal, libc::SIG_DFL);
                        }
                    }
                }
                // The keeper blocks every signal; the hook starts with none blocked.
                let mut none: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut none);
                libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                    return Err(io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    return Err(io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
        let child = command.spawn()?;
        // The command's end of the pipe is closed here once `command` is dropped.
        drop(command);
        nix::fcntl::fcntl(&read, nix::fcntl::FcntlArg::F_SETFL(OFlag::O_NONBLOCK))?;
        info!(
            event = "hook_started",
            hook = hook.name(),
            pid = child.id(),
            "running --{hook}"
        );
        Ok(Running {
            hook,
            pid: Pid::from_raw(child.id() as i32),
            started: Instant::now(),
            output: Some(read),
            partial: Vec::new(),
        })
    }

    /// The read end of the output pipe, while it is open.
    pub fn output_fd(&self) -> Option<BorrowedFd<'_>> {
        self.output.as_ref().map(|fd| fd.as_fd())
    }

    /// Reads what the pipe holds and logs each complete line; closes it at end-of-file.
    pub fn read_output(&mut self) {
        let Some(fd) = &self.output else {
            return;
        };
        let mut file = std::fs::File::from(match fd.try_clone() {
            Ok(fd) => fd,
            Err(_) => return,
        });
        let mut buf = [0u8; 4096];
        loop {
            match file.read(&mut buf) {
                Ok(0) => {
                    self.output = None;
                    self.flush();
                    return;
                }
                Ok(n) => {
                    self.partial.extend_from_slice(&buf[..n]);
                    self.log_lines();
                }
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => return,
                Err(_) => {
                    self.output = None;
                    self.flush();
                    return;
                }
            }
        }
    }

    fn log_lines(&mut self) {
        while let Some(at) = self.partial.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=at).collect();
            self.log(&line[..line.len() - 1]);
        }
        while self.partial.len() >= MAX_LINE {
            let piece: Vec<u8> = self.partial.drain(..MAX_LINE).collect();
            self.log(&piece);
        }
    }

    /// Logs what is left of a last line without a newline.
    fn flush(&mut self) {
        if !self.partial.is_empty() {
            let rest = std::mem::take(&mut self.partial);
            self.log(&rest);
        }
    }

    fn log(&self, line: &[u8]) {
        let line = String::from_utf8_lossy(line);
        info!(event = "hook_output", hook = self.hook.name(), "{line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hooks_survive_the_keepers_arguments() {
        let hooks = Hooks {
            pre_start: Some("ip addr add 10.0.0.5/24 dev eth0 && echo 'a=b'".to_owned()),
            post_stop: Some(String::new()),
            timeout: Duration::from_millis(2500),
        };
        let mut read = Hooks::default();
        for word in hooks.to_args() {
            assert!(read.read_arg(word.to_str().expect("UTF-8")));
        }
        assert_eq!(read, hooks);
        assert!(!read.read_arg("log=json"));
        assert!(Hooks::default().to_args().is_empty());
    }

    #[test]
    fn a_failing_pre_start_sits_out_longer_each_time_up_to_a_minute() {
        let secs: Vec<u64> = (1..=9).map(|n| sit_out_after(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
    }

    #[test]
    fn report_values_read_for_people() {
        assert_eq!(
            describe(TIMED_OUT),
            "it ran past --hook-timeout and was killed"
        );
        assert_eq!(describe(3), "exit code 3");
        assert_eq!(describe(137), "it was killed by SIGKILL");
        assert_eq!(Ended::Failed(ChildStatus::Exited(4)).code(), 4);
    }
}
