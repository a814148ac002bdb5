//! The command's tree as the keeper keeps it: the processes it reaps and kills to the last
//! descendant, the channel it reports on, the leader's sockets it holds until the tree is gone,
//! and the keeper's own stop once the leadership's deadline passes.

use std::ffi::OsString;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{Signal, kill, killpg};
use nix::sys::signalfd::SignalFd;
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{Pid, getpid};
use tracing::{info, warn};

use crate::cli::LogFormat;
use crate::operate::logging;
use crate::supervise::hook::Hooks;
use crate::supervise::keeper::farewell::{self, Farewells};
use crate::supervise::keeper::output::Relay;
use crate::supervise::keeper::protocol::{self, Report};
use crate::supervise::procfs;
use crate::supervise::watchdog::Watch;
use crate::time::for_people;

/// How long a keeper about to exit waits for the lines of its own stop to be written.
const LOG_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

#[derive(PartialEq, Eq)]
pub(super) enum Reaped {
    SomeLeft,
    NoChildrenLeft,
}

/// The command's tree, as the keeper keeps it: the command and what it started, the hook
/// that runs, and what goes with them until the last of them is gone (the channel it reports
/// on, the leader's sockets it holds, the deadline it watches).
pub(super) struct Tree {
    /// The command, once it runs.
    pub(super) main_pid: Option<Pid>,
    pub(super) main_done: bool,
    /// How the command ended, for `--post-stop`'s `PGLEADER_EXIT_CODE`.
    pub(super) main_status: Option<i32>,
    pub(super) channel: UnixStream,
    /// The channel read end-of-file: nobody reads the reports any more.
    pub(super) pgleader_gone: bool,
    pub(super) signalfd: SignalFd,
    pub(super) held_connections: Vec<OwnedFd>,
    /// What to say on `held_connections` before closing them, if pgleader died.
    pub(super) farewells: Farewells,
    pub(super) hooks: Hooks,
    /// What pgleader added to the command's environment (the hooks get it too).
    pub(super) env: Vec<(OsString, OsString)>,
    /// The hook that runs, and how it ended once reaped.
    pub(super) hook: Option<(Pid, Option<WaitStatus>)>,
    /// The leadership's deadline, watched while the command (or `--pre-start`) runs.
    pub(super) watch: Option<Watch>,
    /// The lines the keeper writes of its own stop.
    pub(super) aside: Aside,
    /// The command's output turned into log lines, once it runs (`output.rs`).
    pub(super) output: Option<Relay>,
}

impl Tree {
    /// Reaps every child that has exited, reporting the command's own end and noting a
    /// hook's.
    pub(super) fn reap(&mut self) -> Reaped {
        while let Ok(Some(_)) = self.signalfd.read_signal() {}
        loop {
            let status = match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => return Reaped::SomeLeft,
                Ok(status) => status,
                Err(Errno::EINTR) => continue,
                Err(_) => return Reaped::NoChildrenLeft,
            };
            let pid = status.pid();
            if let Some((hook, ended)) = &mut self.hook
                && pid == Some(*hook)
            {
                *ended = Some(status);
                continue;
            }
            if pid.is_none() || pid != self.main_pid {
                continue;
            }
            let report = match status {
                WaitStatus::Exited(_, code) => Report::Exited(code),
                WaitStatus::Signaled(_, signal, _) => Report::Killed(signal as i32),
                _ => continue,
            };
            self.main_done = true;
            self.main_status = Some(match report {
                Report::Killed(signal) => 128 + signal,
                Report::Exited(code) => code,
                _ => 0,
            });
            // A failed write means pgleader is gone; the caller finds out soon enough.
            let _ = self.channel.write_all(&report.encode());
        }
    }

    /// The end of the job once nothing of the command is left: `--post-stop`, then
    /// [`Tree::finish`].
    pub(super) fn end(&mut self) {
        self.run_post_stop();
        self.finish();
    }

    /// Called once nothing of the job is left: lets go of the leader's connections and tells
    /// pgleader so (a failed write means pgleader is gone).
    ///
    /// The sockets are closed here rather than by the exit that follows: the kernel tears down
    /// an exiting process's memory before it closes its files, and when pgleader was killed
    /// these copies are the last, so closing them is what ends the server's session and frees
    /// the lock for the next leader.
    ///
    /// When pgleader died, the farewells go first: they end its leadership on the server now,
    /// the tree being gone, rather than leave that to the followers' next check.
    pub(super) fn finish(&mut self) {
        if self.pgleader_gone || farewell::channel_ended(self.channel.as_fd()) {
            let answered = self.farewells.say_if_orphaned(&self.held_connections);
            if answered > 0 {
                info!(
                    event = "farewell",
                    answered, "released the dead leader's lock on {answered} server(s)"
                );
            }
        }
        self.held_connections.clear();
        // The last lines the tree wrote, before `Done`: pgleader may exit once it reads it,
        // and as a container's PID 1 its exit takes the keeper with it. (A failover after a
        // kill -9 does not wait for them: the sockets are closed already.)
        if let Some(relay) = self.output.take() {
            let tail = relay.finish();
            // Before `Done`, for the run's ledger row (`--keep-output`).
            if !tail.is_empty() {
                let _ = self.channel.write_all(&protocol::output_report(&tail));
            }
        }
        let _ = self.channel.write_all(&Report::Done(0).encode());
        self.aside.wait();
    }

    /// The deadline passed with no news from pgleader (see `watchdog.rs`): tells pgleader (it
    /// reads it once it runs again), then sends the kill signal and SIGCONT to the process
    /// group, as pgleader's own stop does (SIGKILL, or a kill timeout of 0, goes to everything
    /// at once). The keeper blocks every signal, so the group's signals do not reach it.
    /// True if everything went at once: nothing of the tree is left.
    pub(super) fn begin_own_stop(&mut self) -> bool {
        let Some(watch) = &self.watch else {
            return false;
        };
        let terms = watch.terms;
        let without_news = i32::try_from(terms.without_news.as_millis()).unwrap_or(i32::MAX);
        // A failed write means pgleader is gone: the channel's end says so next.
        let _ = self
            .channel
            .write_all(&Report::Expired(without_news).encode());
        let at_once = terms.signal == Signal::SIGKILL || terms.kill_timeout.is_zero();
        let running = self.main_pid.is_some() || self.hook.is_some();
        let line = own_stop_line(watch, getpid().as_raw(), running);
        if running && at_once {
            self.kill_everything();
        } else if running {
            let _ = killpg(getpid(), terms.signal);
            let _ = killpg(getpid(), Signal::SIGCONT);
        }
        self.aside.write(line);
        running && at_once
    }

    /// Logs the keeper's own SIGKILL once `--kill-timeout` ran out: of its own stop, or of one
    /// pgleader began and did not follow up.
    pub(super) fn log_escalation(&mut self) {
        let Some(watch) = &self.watch else {
            return;
        };
        let line = escalation_line(watch, getpid().as_raw());
        self.aside.write(line);
    }

    /// SIGKILLs every descendant, including those that left the process group, until none is
    /// left. Being a subreaper, the keeper inherits whatever a killed process leaves behind, so
    /// repeating until it has no children reaches everything the command ever started.
    pub(super) fn kill_everything(&mut self) {
        // The whole tree is read before anything is killed: a process killed first would hand
        // its children to the keeper while the walk reads their lists, and one missed that way
        // would be found only after the poll below times out.
        loop {
            for pid in procfs::descendants(getpid().as_raw()) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
            if self.reap() == Reaped::NoChildrenLeft {
                return;
            }
            // Wait for the next child to be reaped, then look again, for processes forked
            // while this pass was killing their parents (or shortly, if none is reaped).
            let mut fds = [PollFd::new(self.signalfd.as_fd(), PollFlags::POLLIN)];
            let _ = poll(&mut fds, PollTimeout::from(10u8));
            if self.reap() == Reaped::NoChildrenLeft {
                return;
            }
        }
    }
}

/// The line the keeper logs when it stops `watch`'s command by itself, no news having come from
/// pgleader: `pgid` is the command's process group, `running` whether anything runs (else it
/// starts nothing).
pub(super) fn own_stop_line(
    watch: &Watch,
    pgid: i32,
    running: bool,
) -> impl FnOnce() + Send + 'static {
    let (terms, label) = (watch.terms, watch.label.clone());
    let at_once = terms.signal == Signal::SIGKILL || terms.kill_timeout.is_zero();
    move || {
        let what = if !running {
            "starting nothing".to_owned()
        } else if at_once {
            "SIGKILL to everything it started".to_owned()
        } else {
            format!(
                "{} to its process group, SIGKILL after {} (--kill-timeout)",
                terms.signal.as_str(),
                for_people(terms.kill_timeout)
            )
        };
        warn!(
            event = "keeper_stop",
            shard = label.shard,
            job = label.job.as_deref(),
            pgid,
            signal = terms.signal.as_str(),
            "no news from pgleader for {} (--check-interval + --check-timeout): pgleader is stopped, hung or starved, and the server may soon free the lock; the keeper stops the command{} itself: {what}",
            for_people(terms.without_news),
            label.of(),
        )
    }
}

/// The line the keeper logs when `--kill-timeout` ran out on `watch`'s command (process group
/// `pgid`): of its own stop, or of one pgleader began and did not follow up.
pub(super) fn escalation_line(watch: &Watch, pgid: i32) -> impl FnOnce() + Send + 'static {
    let (terms, label, own) = (watch.terms, watch.label.clone(), watch.stops_by_itself());
    move || {
        let whose = if own {
            "after the keeper's stop signal"
        } else {
            "after pgleader's stop signal, and pgleader did not follow up"
        };
        label.warn_kill(
            pgid,
            None,
            format_args!(
                "the command{} did not exit within {} (--kill-timeout) {whose}; the keeper sends SIGKILL to everything it started",
                label.of(),
                for_people(terms.kill_timeout),
            ),
        )
    }
}

/// The lines a keeper writes of its own stop, each on a thread of its own: the keeper's own
/// stop is for a pgleader that does not run, and that may be because nobody reads the pipe
/// both write their logs to; a write blocked there must not hold up the stop. [`Aside::wait`]
/// waits a little for them before the keeper exits.
pub(super) struct Aside {
    /// How pgleader logs.
    log: Option<(LogFormat, i8)>,
    /// The lines being written, each saying when it is done.
    pending: Vec<std::sync::mpsc::Receiver<()>>,
}

impl Aside {
    pub(super) fn new(log: Option<(LogFormat, i8)>) -> Aside {
        Aside {
            log,
            pending: Vec::new(),
        }
    }

    /// Writes `line` on a thread of its own.
    pub(super) fn write(&mut self, line: impl FnOnce() + Send + 'static) {
        if let Some((format, verbosity)) = self.log {
            logging::init(format, verbosity);
        }
        let (done, logged) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new().spawn(move || {
            line();
            let _ = done.send(());
        });
        if spawned.is_ok() {
            self.pending.push(logged);
        }
    }

    /// Waits for the lines written, unless their write is blocked (nobody reads), at most
    /// [`LOG_WAIT`] in all.
    pub(super) fn wait(&mut self) {
        let until = std::time::Instant::now() + LOG_WAIT;
        for logged in self.pending.drain(..) {
            let left = until.saturating_duration_since(std::time::Instant::now());
            let _ = logged.recv_timeout(left);
        }
    }
}
