//! The command pgleader runs, seen from pgleader: checking it before the election, parking a
//! keeper for it while following, starting it under that keeper in its own process group once
//! leading, signalling that group, and learning how it ended.
//!
//! pgleader never waits for a specific child with a blocking call. Every SIGCHLD leads to
//! [`reap_all`], which collects every exited child: the job's keeper, and, when pgleader is
//! PID 1 in a container, any orphan the kernel reparented to it. The keeper's reports arrive on
//! a socket read without blocking the runtime.

use std::ffi::{CString, OsStr, OsString};
use std::io::{self, IoSlice};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::spawn::{PosixSpawnAttr, PosixSpawnFileActions, PosixSpawnFlags, posix_spawn};
use nix::sys::signal::{SigSet, Signal, killpg};
use nix::sys::socket::{ControlMessage, MsgFlags, send, sendmsg};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{AccessFlags, Pid, access};
use thiserror::Error;

use crate::election::socket::Lent;
use crate::exit::{self, ChildStatus};
use crate::supervise::hook::Hooks;
use crate::supervise::keeper::protocol::{self, Output, Report};
use crate::supervise::label::Label;
use crate::supervise::procfs;
use crate::supervise::watchdog::{self, Deadline};

mod session;
pub use session::SessionKeeper;

/// The command could not be run; pgleader stops before taking part in the election.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum CommandError {
    #[error("command not found: {0}")]
    NotFound(String),
    #[error("cannot execute {0}: {1}")]
    NotExecutable(String, &'static str),
}

impl CommandError {
    /// 127 or 126, as shells report these failures.
    pub fn exit_code(&self) -> u8 {
        match self {
            CommandError::NotFound(_) => exit::NOT_FOUND,
            CommandError::NotExecutable(..) => exit::CANNOT_EXECUTE,
        }
    }

    /// The error an `execve` failure in the keeper stands for.
    pub fn from_errno(program: &OsStr, errno: i32) -> Self {
        let name = program.to_string_lossy().into_owned();
        match Errno::from_raw(errno) {
            Errno::ENOENT | Errno::ENOTDIR => CommandError::NotFound(name),
            errno => CommandError::NotExecutable(name, errno.desc()),
        }
    }
}

/// A command ready to run: the file to execute and the arguments as the user gave them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommandLine {
    program: PathBuf,
    argv: Vec<OsString>,
    output: Output,
}

impl CommandLine {
    /// Finds the program the way `execvp` would (in `PATH` unless the name has a slash) and
    /// checks that it can be executed, so that a typo fails at once with 127 or 126 instead of
    /// after winning the election.
    pub fn resolve(argv: Vec<OsString>, path_var: Option<&OsStr>) -> Result<Self, CommandError> {
        let name = argv
            .first()
            .ok_or_else(|| CommandError::NotFound(String::new()))?;
        let display = name.to_string_lossy().into_owned();
        if name.is_empty() {
            return Err(CommandError::NotFound(display));
        }
        if name.as_bytes().contains(&b'/') {
            let program = PathBuf::from(name);
            check_executable(&program).map_err(|reason| match reason {
                None => CommandError::NotFound(display),
                Some(reason) => CommandError::NotExecutable(program.display().to_string(), reason),
            })?;
            return Ok(CommandLine {
                program,
                argv,
                output: Output::Inherited,
            });
        }
        let search = path_var.unwrap_or(OsStr::new("/usr/local/bin:/usr/bin:/bin"));
        let mut not_executable = None;
        for dir in search.as_bytes().split(|b| *b == b':') {
            let dir = if dir.is_empty() {
                Path::new(".")
            } else {
                Path::new(OsStr::from_bytes(dir))
            };
            let candidate = dir.join(name);
            match check_executable(&candidate) {
                Ok(()) => {
                    return Ok(CommandLine {
                        program: candidate,
                        argv,
                        output: Output::Inherited,
                    });
                }
                Err(None) => {}
                Err(Some(reason)) => {
                    not_executable.get_or_insert((candidate, reason));
                }
            }
        }
        Err(match not_executable {
            Some((candidate, reason)) => {
                CommandError::NotExecutable(candidate.display().to_string(), reason)
            }
            None => CommandError::NotFound(display),
        })
    }

    /// The same command, its output sent where `output` says.
    pub fn with_output(self, output: Output) -> Self {
        CommandLine { output, ..self }
    }

    pub fn program(&self) -> &Path {
        &self.program
    }

    /// The command as the user typed it, for logs.
    pub fn display(&self) -> String {
        self.argv
            .iter()
            .map(|arg| arg.to_string_lossy())
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// `Ok` if the file can be executed, `Err(None)` if it does not exist, `Err(Some(reason))` if
/// it exists but cannot be executed.
fn check_executable(path: &Path) -> Result<(), Option<&'static str>> {
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Err(None),
        Err(_) => return Err(Some("cannot read its metadata")),
    };
    if meta.is_dir() {
        return Err(Some("it is a directory"));
    }
    if !meta.is_file() {
        return Err(Some("it is not a regular file"));
    }
    // access(2) also answers for root, who may execute a file only if some execute bit is set.
    if meta.permissions().mode() & 0o111 == 0 || access(path, AccessFlags::X_OK).is_err() {
        return Err(Some("permission denied"));
    }
    Ok(())
}

/// A keeper started ahead of time, parked until pgleader wins: it has set itself up and waits
/// for the command's environment and the sockets to hold (see `keeper/`). Dropping it closes
/// its channel, and the keeper exits without having started anything.
#[derive(Debug)]
pub struct Parked {
    pub(super) keeper: Pid,
    pub(super) channel: std::os::unix::net::UnixStream,
}

impl Parked {
    /// Starts a keeper for `command` (and its `hooks`) in a process group of its own, parked.
    /// The keeper's
    /// environment is pgleader's, without what only pgleader may use ([`notify::PRIVATE_ENV`]).
    ///
    /// Any thread may call this (pgleader calls it on a blocking thread, so that the keeper's
    /// exec overlaps with connecting): the keeper notices pgleader's death by the end of its
    /// channel, not by a parent-death signal, which would fire when the spawning thread exits.
    ///
    /// Spawned with `posix_spawn`, which the C library does with a vfork-style clone: no copy
    /// of pgleader's page tables for a child that execs at once (a fork, with the copy undone
    /// by the exec, cost about as much CPU as the keeper's own start-up, on the cores a
    /// starting pgleader shares with the server). What the keeper needs from the spawn is an
    /// attribute: its own process group, every signal blocked from its first instruction (it
    /// must not die of a signal meant for the command), and its end of the channel inherited,
    /// which a dup2 onto itself does (it clears close-on-exec: POSIX.1-2024, glibc 2.29 and
    /// musl 1.1.24 or later).
    ///
    /// [`notify::PRIVATE_ENV`]: crate::operate::notify::PRIVATE_ENV
    pub fn spawn(command: &CommandLine, hooks: &Hooks) -> io::Result<Parked> {
        Parked::spawn_with(|fd| {
            protocol::keeper_args(
                fd,
                hooks,
                command.output,
                &command.program.clone().into_os_string(),
                &command.argv,
            )
        })
    }

    /// Starts a membership's keeper, parked: it will run no command, only hold the sockets
    /// [`Parked::into_membership`] hands it (see `membership.rs`).
    pub fn spawn_membership() -> io::Result<Parked> {
        Parked::spawn_with(protocol::membership_keeper_args)
    }

    /// Starts a keeper with the arguments `args` gives for its end of the channel.
    pub(super) fn spawn_with(args: impl FnOnce(RawFd) -> Vec<OsString>) -> io::Result<Parked> {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
        let theirs_fd = theirs.as_raw_fd();
        let mut argv = vec![c_string(protocol::ARGV0.as_bytes())?];
        for arg in args(theirs_fd) {
            argv.push(c_string(arg.as_bytes())?);
        }
        let mut env = Vec::new();
        for (name, value) in std::env::vars_os() {
            if crate::operate::notify::PRIVATE_ENV
                .iter()
                .any(|private| name == *private)
            {
                continue;
            }
            let mut entry = name.into_vec();
            entry.push(b'=');
            entry.extend_from_slice(value.as_bytes());
            env.push(c_string(&entry)?);
        }
        let mut actions = PosixSpawnFileActions::init()?;
        actions.add_dup2(theirs_fd, theirs_fd)?;
        let mut attr = PosixSpawnAttr::init()?;
        attr.set_pgroup(Pid::from_raw(0))?;
        attr.set_sigmask(&SigSet::all())?;
        // As std's spawn did: SIGPIPE back to its default (Rust ignores it in pgleader).
        let mut pipe = SigSet::empty();
        pipe.add(Signal::SIGPIPE);
        attr.set_sigdefault(&pipe)?;
        attr.set_flags(
            PosixSpawnFlags::POSIX_SPAWN_SETPGROUP
                | PosixSpawnFlags::POSIX_SPAWN_SETSIGMASK
                | PosixSpawnFlags::POSIX_SPAWN_SETSIGDEF,
        )?;
        let keeper = posix_spawn(keeper_executable().as_path(), &actions, &attr, &argv, &env)?;
        drop(theirs);
        Ok(Parked {
            keeper,
            channel: ours,
        })
    }

    /// The keeper's pid.
    pub fn pid(&self) -> Pid {
        self.keeper
    }

    /// Whether the keeper still waits: a parked keeper never writes, so a readable channel
    /// means it has closed its end (it was killed from outside).
    pub fn is_waiting(&self) -> bool {
        let mut fds = [PollFd::new(self.channel.as_fd(), PollFlags::POLLIN)];
        matches!(poll(&mut fds, PollTimeout::ZERO), Ok(0))
    }

    /// Starts the command: sends the keeper `env` (added to its environment), copies of
    /// `hold` (the leader's connection sockets, with their farewells), which it keeps open until
    /// the command's whole tree is gone, and the leadership's deadline to `watch` (with the
    /// label its log lines give the command), past which it stops the tree by itself (see
    /// `watchdog.rs`). An error means the keeper is gone; nothing was started.
    pub fn start(
        self,
        env: &[(&str, String)],
        hold: &[Lent],
        watch: Option<(&Deadline, &Label)>,
    ) -> io::Result<Job> {
        self.send_start(env, hold, watch)?;
        self.channel.set_nonblocking(true)?;
        Ok(Job {
            keeper: self.keeper,
            link: Link::Own {
                channel: tokio::net::UnixStream::from_std(self.channel)?,
                pending: Vec::new(),
                channel_closed: false,
            },
            keeper_status: None,
            done: false,
            post_stop: None,
            deadline: watch.map(|(deadline, _)| deadline.clone()),
            expired: false,
            output: None,
        })
    }

    /// Starts the command under `parked` (a keeper started ahead of time), else under a fresh
    /// keeper for `command` and its `hooks`; as [`Parked::start`] otherwise. A parked keeper
    /// killed since it was last checked fails its start (nothing was started), so a fresh one
    /// is the fallback then too.
    pub fn start_or_fresh(
        parked: Option<Parked>,
        command: &CommandLine,
        hooks: &Hooks,
        env: &[(&str, String)],
        hold: &[Lent],
        watch: Option<(&Deadline, &Label)>,
    ) -> io::Result<Job> {
        let fresh = || Parked::spawn(command, hooks)?.start(env, hold, watch);
        match parked {
            Some(parked) => parked.start(env, hold, watch).or_else(|_| fresh()),
            None => fresh(),
        }
    }

    /// Hands a membership's keeper ([`Parked::spawn_membership`]) the sockets to hold, with
    /// their farewells: it is at work from now on.
    pub fn into_membership(self, hold: &[Lent]) -> io::Result<MembershipKeeper> {
        self.send_start(&[], hold, None)?;
        Ok(MembershipKeeper {
            keeper: self.keeper,
            channel: self.channel,
        })
    }

    /// Sends the start message: `env`, copies of the sockets of `hold`, and the deadline to
    /// watch (its memfd last).
    pub(super) fn send_start(
        &self,
        env: &[(&str, String)],
        hold: &[Lent],
        watch: Option<(&Deadline, &Label)>,
    ) -> io::Result<()> {
        let terms = watch.map(|(deadline, label)| watchdog::encode(deadline.terms(), label));
        let message = protocol::start_message(env, hold, terms.as_deref());
        let mut hold: Vec<RawFd> = hold.iter().map(|lent| lent.fd).collect();
        hold.extend(watch.map(|(deadline, _)| deadline.fd()));
        if hold.len() > protocol::MAX_HELD + usize::from(watch.is_some()) {
            return Err(io::Error::other(format!(
                "{} connection sockets to hand to the keeper, at most {} fit in one message",
                hold.len(),
                protocol::MAX_HELD
            )));
        }
        let rights = [ControlMessage::ScmRights(&hold)];
        let cmsgs: &[ControlMessage] = if hold.is_empty() { &[] } else { &rights };
        // A blocking socket: the message is small, the keeper reads it at once.
        let mut sent = loop {
            match sendmsg::<()>(
                self.channel.as_raw_fd(),
                &[IoSlice::new(&message)],
                cmsgs,
                MsgFlags::MSG_NOSIGNAL,
                None,
            ) {
                Ok(sent) => break sent,
                Err(Errno::EINTR) => continue,
                Err(err) => return Err(err.into()),
            }
        };
        while sent < message.len() {
            match send(
                self.channel.as_raw_fd(),
                &message[sent..],
                MsgFlags::MSG_NOSIGNAL,
            ) {
                Ok(n) => sent += n,
                Err(Errno::EINTR) => {}
                Err(err) => return Err(err.into()),
            }
        }
        Ok(())
    }
}

/// A membership's keeper at work (see `membership.rs`): it holds the replica's
/// connection sockets, and says the membership's farewell once pgleader and every command's
/// keeper that holds a copy of [`MembershipKeeper::lent`] are gone.
#[derive(Debug)]
pub struct MembershipKeeper {
    keeper: Pid,
    channel: std::os::unix::net::UnixStream,
}

impl MembershipKeeper {
    /// pgleader's end of the channel, for each command's keeper to hold until its tree is gone:
    /// while any does, the membership's keeper waits.
    pub fn lent(&self) -> Lent {
        Lent::hold(self.channel.as_raw_fd())
    }

    /// Tells the keeper that pgleader, alive, no longer needs it: it exits without its farewell,
    /// whatever command keepers still hold its channel. Returns its pid, to wait for.
    pub fn dismiss(self) -> Pid {
        // A failed write means the keeper is gone already.
        let _ = send(
            self.channel.as_raw_fd(),
            &[protocol::KILL_EVERYTHING],
            MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT,
        );
        self.keeper
    }
}

/// Waits up to `within` in all for the keepers `pids`, let go (their channel closed: each exits
/// having started nothing), to exit, reaping them, so that pgleader leaves none behind.
pub async fn await_let_go(pids: Vec<Pid>, within: std::time::Duration) {
    let deadline = tokio::time::Instant::now() + within;
    for pid in pids {
        while tokio::time::Instant::now() < deadline {
            match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) | Err(Errno::EINTR) => {
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                }
                // Exited, or reaped already by a SIGCHLD handled meanwhile.
                _ => break,
            }
        }
    }
}

/// A running job: its keeper and what it has reported.
#[derive(Debug)]
pub struct Job {
    /// The job's own keeper (leader of the command's process group), or the session's keeper
    /// that runs it.
    keeper: Pid,
    link: Link,
    keeper_status: Option<WaitStatus>,
    /// The keeper reported that nothing of the job is left (it exits next).
    done: bool,
    /// The process group of the `--post-stop` the keeper runs, once it said so.
    post_stop: Option<Pid>,
    /// The leadership's deadline the keeper watches.
    deadline: Option<Deadline>,
    /// The keeper reported that it stops the command by itself, the deadline having passed.
    expired: bool,
    /// The run's last lines, once the keeper has reported them (`--keep-output`).
    output: Option<Vec<u8>>,
}

/// How pgleader hears from a job's keeper and speaks to it.
#[derive(Debug)]
enum Link {
    /// A keeper of the job's own, on a channel of its own.
    Own {
        channel: tokio::net::UnixStream,
        pending: Vec<u8>,
        channel_closed: bool,
    },
    /// A run of the session's keeper (`session.rs`).
    Session(session::SessionRun),
}

impl Job {
    /// The process group of the job: its own keeper's pid, or the command's under a session's
    /// keeper (the session keeper's until the command's start has been read).
    pub fn pgid(&self) -> Pid {
        match &self.link {
            Link::Session(run) => run.main().unwrap_or(self.keeper),
            Link::Own { .. } => self.keeper,
        }
    }

    /// Sends a signal to the whole process group (the command's, and its own keeper, which
    /// blocks all but SIGKILL; a session's keeper sends it, after the command's start). A group
    /// that is already gone is not an error.
    pub fn signal(&self, signal: Signal) -> io::Result<()> {
        if let Link::Session(run) = &self.link {
            run.signal(signal);
            return Ok(());
        }
        match killpg(self.keeper, signal) {
            Ok(()) | Err(Errno::ESRCH) => Ok(()),
            Err(err) => Err(err.into()),
        }
    }

    /// Whether a signal sent before the command's start reaches the command once it runs: a
    /// session's keeper handles pgleader's requests in order, the start first. (A keeper of the
    /// job's own leads the group, alone until the command starts, and blocks every signal.)
    pub fn signals_follow_start(&self) -> bool {
        matches!(self.link, Link::Session(_))
    }

    /// Asks the keeper to SIGKILL everything the command started, wherever it went (setsid
    /// included), and to report once nothing is left.
    pub fn kill_everything(&self) -> io::Result<()> {
        if let Link::Session(run) = &self.link {
            run.kill();
            return Ok(());
        }
        self.request(protocol::KILL_EVERYTHING)
    }

    /// Whether the keeper stops the command by itself: the leadership's deadline passed while
    /// pgleader did not run (see `watchdog.rs`), so no stop signal of pgleader's is needed.
    pub fn keeper_stops_itself(&self) -> bool {
        self.expired || self.deadline.as_ref().is_some_and(Deadline::has_expired)
    }

    /// Tells a keeper that watches a deadline that pgleader has begun stopping the command
    /// itself: it then only makes sure that SIGKILL follows.
    pub fn tell_stopping(&self) {
        if self.deadline.is_none() {
            return;
        }
        if let Link::Session(run) = &self.link {
            run.tell_stopping();
        } else {
            let _ = self.request(protocol::STOPPING);
        }
    }

    /// Asks the keeper to end everything now, a running `--post-stop` included.
    pub fn abort(&self) -> io::Result<()> {
        if let Link::Session(run) = &self.link {
            run.kill();
            return Ok(());
        }
        self.request(protocol::ABORT)
    }

    /// Sends the job's own keeper a request byte; a keeper that is gone already is not an
    /// error.
    fn request(&self, byte: u8) -> io::Result<()> {
        let Link::Own { channel, .. } = &self.link else {
            return Ok(());
        };
        match channel.try_write(&[byte]) {
            Ok(_) => Ok(()),
            Err(err) if err.kind() == io::ErrorKind::BrokenPipe => Ok(()),
            Err(err) => Err(err),
        }
    }

    /// SIGKILL to the job's process group (its own keeper with it) and to the group of a
    /// `--post-stop` the keeper runs: for a keeper that does not finish.
    pub fn kill_groups(&self) {
        if let Link::Session(run) = &self.link {
            if let Some(main) = run.live_main() {
                let _ = killpg(main, Signal::SIGKILL);
            }
            run.kill();
            return;
        }
        let _ = self.signal(Signal::SIGKILL);
        if let Some(hook) = self.post_stop {
            let _ = killpg(hook, Signal::SIGKILL);
        }
    }

    /// The living members of the job's process group, and of its `--post-stop`'s. Normally
    /// none is left once the keeper is reaped; if the keeper was killed from outside, its
    /// group may outlive it.
    pub fn group_members(&self) -> Vec<i32> {
        let mut members = match self.link {
            Link::Session(ref run) => run
                .live_main()
                .map(|main| procfs::group_members(main.as_raw()))
                .unwrap_or_default(),
            Link::Own { .. } => procfs::group_members(self.keeper.as_raw()),
        };
        if let Some(hook) = self.post_stop {
            members.extend(procfs::group_members(hook.as_raw()));
        }
        members
    }

    /// The next report from the keeper. Cancel-safe; never completes once the keeper has closed
    /// its end and every report has been read.
    pub async fn next_report(&mut self) -> Report {
        std::future::poll_fn(|cx| self.poll_report(cx)).await
    }

    /// Polls for the next report from the keeper, so that one task can wait on many jobs (a
    /// sharded replica's). Pending for good once the keeper has closed its end and every
    /// report has been read.
    pub fn poll_report(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Report> {
        if let Link::Session(run) = &mut self.link {
            let report = std::task::ready!(run.poll_report(cx));
            if let Some(output) = run.take_output() {
                self.output = Some(output);
            }
            self.note(report);
            return std::task::Poll::Ready(report);
        }
        loop {
            if let Some(report) = self.take_buffered() {
                return std::task::Poll::Ready(report);
            }
            let Link::Own {
                channel,
                channel_closed,
                ..
            } = &mut self.link
            else {
                return std::task::Poll::Pending;
            };
            if *channel_closed {
                return std::task::Poll::Pending;
            }
            match channel.poll_read_ready(cx) {
                std::task::Poll::Pending => return std::task::Poll::Pending,
                std::task::Poll::Ready(Err(_)) => *channel_closed = true,
                // A read that would block clears the readiness: the next poll waits again.
                std::task::Poll::Ready(Ok(())) => {
                    self.read_available();
                }
            }
        }
    }

    /// The run's last lines, if the keeper kept and reported them. Called once the job is
    /// over: the keeper sends them just before `Done` and exits, and pgleader may have reaped
    /// it (its SIGCHLD handled first) before reading that far, so what it left on the channel
    /// is read here.
    pub fn take_output(&mut self) -> Option<Vec<u8>> {
        if let Link::Session(run) = &mut self.link
            && let Some(output) = run.take_output()
        {
            self.output = Some(output);
        }
        if self.output.is_none() && self.keeper_status.is_some() {
            let _ = self.remaining_reports();
        }
        self.output.take()
    }

    /// Records a reaped child if it is this job's keeper; true if it was.
    pub fn note_reaped(&mut self, pid: Pid, status: WaitStatus) -> bool {
        if pid == self.keeper && matches!(self.link, Link::Own { .. }) {
            self.keeper_status = Some(status);
            true
        } else {
            false
        }
    }

    /// Whether the whole job is gone: the keeper reported that nothing is left, or it has
    /// exited and been reaped.
    pub fn is_finished(&self) -> bool {
        self.done
            || self.keeper_status.is_some()
            || matches!(&self.link, Link::Session(run) if run.keeper_gone())
    }

    /// Whether the keeper itself reported that nothing of the job is left. It reports so only
    /// once it has reaped every child; as a subreaper it inherits every orphan of the tree, so
    /// nothing the command started can be left, in the process group or out of it.
    pub fn reported_done(&self) -> bool {
        self.done
    }

    /// Once the keeper is reaped, the reports it sent but pgleader has not read yet.
    pub fn remaining_reports(&mut self) -> Vec<Report> {
        if let Link::Session(run) = &mut self.link {
            let reports = run.remaining_reports();
            if let Some(output) = run.take_output() {
                self.output = Some(output);
            }
            for report in &reports {
                self.note(*report);
            }
            return reports;
        }
        let mut reports = Vec::new();
        loop {
            if let Some(report) = self.take_buffered() {
                reports.push(report);
                continue;
            }
            let closed = matches!(
                self.link,
                Link::Own {
                    channel_closed: true,
                    ..
                }
            );
            if closed || !self.read_available() {
                return reports;
            }
        }
    }

    /// How the keeper itself ended, for the case where it never reported the command's end
    /// (it was SIGKILLed with the rest of the group).
    pub fn keeper_status(&self) -> Option<ChildStatus> {
        match self.keeper_status? {
            WaitStatus::Exited(_, code) => Some(ChildStatus::Exited(code)),
            WaitStatus::Signaled(_, signal, _) => Some(ChildStatus::Signaled(signal)),
            _ => None,
        }
    }

    fn take_buffered(&mut self) -> Option<Report> {
        let Link::Own { pending, .. } = &mut self.link else {
            return None;
        };
        while pending.len() >= Report::LEN {
            // The run's last lines: kept aside, whole once all of them have come.
            if pending[0] == protocol::OUTPUT {
                let len =
                    u32::from_le_bytes([pending[1], pending[2], pending[3], pending[4]]) as usize;
                if pending.len() < Report::LEN + len {
                    return None;
                }
                let tail = pending[Report::LEN..Report::LEN + len].to_vec();
                pending.drain(..Report::LEN + len);
                self.output = Some(tail);
                continue;
            }
            let mut bytes = [0u8; Report::LEN];
            bytes.copy_from_slice(&pending[..Report::LEN]);
            pending.drain(..Report::LEN);
            if let Some(report) = Report::decode(bytes) {
                self.note(report);
                return Some(report);
            }
        }
        None
    }

    /// Notes what a report says of the job as a whole.
    fn note(&mut self, report: Report) {
        self.done |= matches!(report, Report::Done(_));
        self.expired |= matches!(report, Report::Expired(_));
        if let Report::PostStop(pid) = report {
            self.post_stop = Some(Pid::from_raw(pid));
        }
    }

    /// Reads what the socket holds without blocking; false when nothing more can come now.
    fn read_available(&mut self) -> bool {
        let Link::Own {
            channel,
            pending,
            channel_closed,
        } = &mut self.link
        else {
            return false;
        };
        let mut buf = [0u8; 4096];
        match channel.try_read(&mut buf) {
            Ok(0) => {
                *channel_closed = true;
                false
            }
            Ok(n) => {
                pending.extend_from_slice(&buf[..n]);
                true
            }
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => false,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => true,
            Err(_) => {
                *channel_closed = true;
                false
            }
        }
    }
}

/// The keeper is pgleader's own binary. `/proc/self/exe` names the very file this process runs
/// from even if a package upgrade has replaced or removed it since.
fn keeper_executable() -> PathBuf {
    let proc_exe = PathBuf::from("/proc/self/exe");
    if proc_exe.exists() {
        proc_exe
    } else {
        std::env::current_exe().unwrap_or(proc_exe)
    }
}

/// `bytes` for an argument or environment entry of an exec; the system never hands pgleader
/// one with a NUL byte inside.
fn c_string(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in an argument"))
}

/// Reaps every child that has exited, without blocking.
pub fn reap_all() -> Vec<(Pid, WaitStatus)> {
    let mut reaped = Vec::new();
    loop {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => return reaped,
            Ok(status) => {
                if let Some(pid) = status.pid() {
                    reaped.push((pid, status));
                }
            }
            Err(Errno::EINTR) => {}
            Err(_) => return reaped,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(words: &[&str]) -> Vec<OsString> {
        words.iter().map(OsString::from).collect()
    }

    #[test]
    fn finds_programs_in_path() {
        let resolved = CommandLine::resolve(
            argv(&["sh", "-c", "true"]),
            Some(OsStr::new("/nonexistent:/bin:/usr/bin")),
        )
        .expect("sh is in /bin");
        assert!(resolved.program().ends_with("sh"));
        assert_eq!(resolved.display(), "sh -c true");
    }

    #[test]
    fn a_missing_command_is_127_and_a_directory_is_126() {
        let missing = CommandLine::resolve(
            argv(&["no-such-command-pgleader"]),
            Some(OsStr::new("/bin")),
        )
        .expect_err("missing");
        assert_eq!(missing.exit_code(), 127);
        let missing_path =
            CommandLine::resolve(argv(&["/no/such/file"]), None).expect_err("missing");
        assert_eq!(missing_path.exit_code(), 127);
        let directory = CommandLine::resolve(argv(&["/tmp"]), None).expect_err("directory");
        assert_eq!(directory.exit_code(), 126);
    }

    #[test]
    fn a_file_without_execute_permission_is_126() {
        let path = std::env::temp_dir().join(format!("pgleader-noexec-{}", std::process::id()));
        std::fs::write(&path, "#!/bin/sh\n").expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let err =
            CommandLine::resolve(vec![path.clone().into_os_string()], None).expect_err("noexec");
        assert_eq!(err.exit_code(), 126);
        std::fs::remove_file(&path).ok();
    }
}
