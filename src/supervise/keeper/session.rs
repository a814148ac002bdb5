//! A session's keeper: one keeper for every command a replica's session runs (`pgleader
//! cron`), where a keeper of its own for each run cost a process, an exec of pgleader and 1.5
//! to 2 MiB per occurrence: 1,000 jobs falling due at one instant held 333 keepers and 590 MiB
//! on each of 3 replicas. pgleader's side of it is `handle::SessionKeeper`; the messages are
//! `protocol/session.rs`'.
//!
//! It keeps each run the promises a run's keeper keeps (see `keeper/mod.rs`), all at once:
//!
//! - started with the session, it holds the session's connection sockets from the start, and
//!   lets them go only once every run's tree is gone (saying the replica's farewell first where
//!   the backend lends one and pgleader died), so no other replica takes a job of this one
//!   while anything of its run lives;
//! - at the end of its channel (pgleader died, by any means) it SIGKILLs every process it
//!   started and everything they started, waits for the last, then lets the sockets go;
//! - it watches the session's deadline for each run (`watchdog.rs`) and stops a run by itself
//!   when news from pgleader stops coming, or follows up a stop pgleader began with SIGKILL;
//! - each command leads a session of its own (`setsid`): its process group is its own to
//!   signal, and its descendants carry its pid as their session. The keeper, a child
//!   subreaper, inherits every orphan of every run, and tells whose an orphan is by its
//!   session, else by `PGLEADER_JOB` and `PGLEADER_SCHEDULED_TIME` in its environment, else
//!   counts it as every unfinished run's: each of those then waits for it, as a run is never
//!   reported done while something that may be its own lives, and it is killed only once each
//!   of them is being killed (one run's end never kills another run's processes);
//! - a run is done once its command is reaped and no orphan counted as its lives: then its
//!   output's last lines and `Done` go to pgleader;
//! - a run's output becomes log lines as under a keeper of its own (`output.rs`), a relay
//!   thread per running command.
//!
//! What it leaves to a keeper per run: hooks (`--pre-start`, `--post-stop`).
//!
//! Its reports wait in memory when pgleader does not read them (frozen, say): a report never
//! blocks the keeper's watch over the runs.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::prctl;
use nix::sys::signal::{SigSet, SigmaskHow, Signal, kill, killpg, sigprocmask};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use tracing::info;

use crate::cli::LogFormat;
use crate::supervise::keeper::channel::wait_for_start;
use crate::supervise::keeper::farewell::{self, Farewells, Parent};
use crate::supervise::keeper::output::{Finishing, Relay, Tag};
use crate::supervise::keeper::protocol::session::{
    self as messages, DISMISS, KILL, RUN, RunSpec, SIGNAL, STOPPING,
};
use crate::supervise::keeper::protocol::{Output, Report};
use crate::supervise::keeper::spawn::Prepared;
use crate::supervise::keeper::tree::{Aside, Reaped, escalation_line, own_stop_line};
use crate::supervise::label::Label;
use crate::supervise::procfs;
use crate::supervise::watchdog::{Step, Watch};

/// One run of the session.
struct Run {
    /// The command, which leads its own session and process group.
    main: Pid,
    main_done: bool,
    /// The session's deadline, watched for this run.
    watch: Option<Watch>,
    relay: Option<Relay>,
    /// Its tree is gone and its last lines are being written (never waited for: other runs
    /// go on meanwhile).
    finishing: Option<Finishing>,
    /// Everything of it is being killed: each reap kills again what it may have forked since.
    killing: bool,
    /// `PGLEADER_JOB` and `PGLEADER_SCHEDULED_TIME`, to know its orphans by.
    job: Option<Vec<u8>>,
    occurrence: Option<Vec<u8>>,
}

/// The session's keeper's state.
struct Keeper {
    channel: UnixStream,
    /// Requests read but not handled yet.
    inbox: Vec<u8>,
    /// Reports not written yet: pgleader reads them when it runs.
    outbox: Vec<u8>,
    /// The channel ended: pgleader is gone.
    pgleader_gone: bool,
    signalfd: SignalFd,
    held: Vec<OwnedFd>,
    farewells: Farewells,
    /// The session's deadline, of which each run gets its own watch.
    deadline: Option<Watch>,
    runs: BTreeMap<u32, Run>,
    /// Each running or unfinished run's command, by pid.
    mains: HashMap<i32, u32>,
    /// The orphans reparented to the keeper, with the runs each is counted as.
    adopted: HashMap<i32, Vec<u32>>,
    aside: Aside,
    log: Option<LogFormat>,
    /// The limit of open files pgleader gave, for the commands.
    open_files: Option<libc::rlimit>,
}

/// Runs a session's keeper on `channel` until pgleader dismisses it or dies. Returns the
/// keeper's exit code.
pub(super) fn keep(channel: UnixStream, log: Option<(LogFormat, i8)>) -> io::Result<i32> {
    sigprocmask(SigmaskHow::SIG_BLOCK, Some(&SigSet::all()), None)?;
    prctl::set_child_subreaper(true)?;
    let open_files = raise_open_files();
    let mut children = SigSet::empty();
    children.add(Signal::SIGCHLD);
    let signalfd = SignalFd::with_flags(&children, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)?;
    let parent = Parent::watch();
    let Some(start) = wait_for_start(&channel)? else {
        return Ok(0);
    };
    channel.set_nonblocking(true)?;
    let mut keeper = Keeper {
        channel,
        inbox: start.rest,
        outbox: Vec::new(),
        pgleader_gone: false,
        signalfd,
        held: start.hold,
        farewells: Farewells {
            parent,
            farewells: start.farewells,
        },
        deadline: start.watch,
        runs: BTreeMap::new(),
        mains: HashMap::new(),
        adopted: HashMap::new(),
        aside: Aside::new(log),
        log: log.map(|(format, _)| format),
        open_files,
    };
    keeper.watch_over();
    keeper.end();
    Ok(0)
}

/// Raises the keeper's limit of open files to the hard limit (each run holds its relay's pipes
/// and its watch's timer and page); returns the limit it had, for the commands.
fn raise_open_files() -> Option<libc::rlimit> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit structure, which `limit` is.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0
        || limit.rlim_cur >= limit.rlim_max
    {
        return None;
    }
    let raised = libc::rlimit {
        rlim_cur: limit.rlim_max,
        rlim_max: limit.rlim_max,
    };
    // SAFETY: setrlimit reads one rlimit structure, which `raised` is.
    (unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0).then_some(limit)
}

impl Keeper {
    /// Serves pgleader's requests and keeps the runs until pgleader dismisses the keeper or is
    /// gone.
    fn watch_over(&mut self) {
        loop {
            if self.handle_requests() {
                return;
            }
            self.finish_done_runs();
            let watched: Vec<u32> = self
                .runs
                .iter()
                .filter(|(_, run)| run.watch.is_some())
                .map(|(id, _)| *id)
                .collect();
            let mut channel_events = PollFlags::POLLIN;
            if !self.outbox.is_empty() {
                channel_events |= PollFlags::POLLOUT;
            }
            let mut fds = vec![
                PollFd::new(self.channel.as_fd(), channel_events),
                PollFd::new(self.signalfd.as_fd(), PollFlags::POLLIN),
            ];
            fds.extend(watched.iter().filter_map(|id| {
                let watch = self.runs.get(id)?.watch.as_ref()?;
                Some(PollFd::new(watch.fd(), PollFlags::POLLIN))
            }));
            // A run's last lines being written are looked at again shortly.
            let timeout = if self.any_finishing() {
                PollTimeout::from(100u8)
            } else {
                PollTimeout::NONE
            };
            match poll(&mut fds, timeout) {
                Err(Errno::EINTR) => continue,
                // Unable to watch over the runs any more: end them rather than orphan them.
                Err(_) => return,
                Ok(_) => {}
            }
            let ready = |fd: &PollFd| fd.any().unwrap_or(true);
            let channel_ready = ready(&fds[0]);
            let children_ready = ready(&fds[1]);
            let watches_ready: Vec<u32> = watched
                .iter()
                .zip(&fds[2..])
                .filter(|(_, fd)| ready(fd))
                .map(|(id, _)| *id)
                .collect();
            drop(fds);
            if channel_ready {
                self.flush();
                read_into(&self.channel, &mut self.inbox, &mut self.pgleader_gone);
            }
            if self.pgleader_gone {
                return;
            }
            for id in watches_ready {
                self.check_watch(id);
            }
            if children_ready {
                self.reap();
            }
        }
    }

    /// Handles the requests read; true once the keeper is dismissed (or pgleader gone).
    fn handle_requests(&mut self) -> bool {
        let mut at = 0;
        while let Some((tag, id, body, len)) = messages::next_request(&self.inbox[at..]) {
            if self.pgleader_gone {
                break;
            }
            let body = body.to_vec();
            at += len;
            match tag {
                RUN => match messages::parse_run(&body) {
                    Ok(spec) => self.start_run(id, spec),
                    Err(_) => {
                        self.report(id, Report::SpawnFailed(Errno::EINVAL as i32));
                        self.report(id, Report::Done(0));
                    }
                },
                STOPPING => {
                    if let Some(watch) = self.runs.get_mut(&id).and_then(|run| run.watch.as_mut()) {
                        watch.pgleader_stops();
                    }
                }
                SIGNAL => {
                    let signal = body
                        .get(..4)
                        .and_then(|bytes| Some(i32::from_le_bytes(bytes.try_into().ok()?)))
                        .and_then(|number| Signal::try_from(number).ok());
                    if let Some(signal) = signal {
                        self.signal_run(id, signal);
                    }
                }
                KILL => self.kill_run(id),
                DISMISS => {
                    self.inbox.drain(..at);
                    return true;
                }
                _ => {}
            }
        }
        self.inbox.drain(..at);
        self.pgleader_gone
    }

    /// Starts a run, unless the deadline has passed already.
    fn start_run(&mut self, id: u32, spec: RunSpec) {
        let mut watch = match &self.deadline {
            Some(deadline) => match deadline.for_another(Label::job(&spec.job)) {
                Ok(watch) => Some(watch),
                Err(err) => {
                    // Unwatched, the run could outlive the leadership: it does not start.
                    let errno = err.raw_os_error().unwrap_or(Errno::EMFILE as i32);
                    self.report(id, Report::SpawnFailed(errno));
                    self.report(id, Report::Done(0));
                    return;
                }
            },
            None => None,
        };
        // pgleader stopped (or hung) between its last look at the deadline and this start:
        // nothing starts, reported as a run killed, as the next leader records an interrupted
        // run.
        if let Some(watch) = &mut watch {
            let (channel, inbox, gone) = (&self.channel, &mut self.inbox, &mut self.pgleader_gone);
            if watch.check(|| stopping_waits(channel, inbox, gone, id)) == Step::Stop {
                self.aside.write(own_stop_line(watch, 0, false));
                self.report(id, Report::Expired(without_news(watch)));
                self.report(id, Report::Killed(Signal::SIGKILL as i32));
                self.report(id, Report::Done(0));
                return;
            }
        }
        let env_value = |name: &str| {
            spec.env
                .iter()
                .find(|(key, _)| key == name)
                .map(|(_, value)| {
                    std::os::unix::ffi::OsStrExt::as_bytes(value.as_os_str()).to_vec()
                })
        };
        let (job, occurrence) = (
            env_value("PGLEADER_JOB"),
            env_value("PGLEADER_SCHEDULED_TIME"),
        );
        let mut relay = match spec.output {
            Output::Tagged { keep } => {
                Relay::start(Tag::of_run(&spec.env, self.log), keep as usize).ok()
            }
            Output::Inherited => None,
        };
        let spawned = Prepared::new(&spec.program, &spec.argv)
            .map_err(|err| Errno::from_raw(err.raw_os_error().unwrap_or(Errno::EINVAL as i32)))
            .and_then(|prepared| {
                let mut prepared = prepared
                    .leading_a_session()
                    .with_open_files(self.open_files);
                prepared.spawn(&spec.env, relay.as_ref().and_then(Relay::for_command))
            });
        match spawned {
            Ok(main) => {
                if let Some(relay) = &mut relay {
                    relay.command_started();
                }
                self.report(id, Report::Started(main.as_raw()));
                self.mains.insert(main.as_raw(), id);
                self.runs.insert(
                    id,
                    Run {
                        main,
                        main_done: false,
                        watch,
                        relay,
                        finishing: None,
                        killing: false,
                        job,
                        occurrence,
                    },
                );
            }
            Err(errno) => {
                self.report(id, Report::SpawnFailed(errno as i32));
                self.report(id, Report::Done(0));
            }
        }
    }

    /// `signal` to run `id`'s process group, as pgleader asks. Not the stop signal once the
    /// keeper's own stop is under way: pgleader asked before it could see the deadline expired
    /// (its word that it stops the command reaches the keeper through its writer, after the
    /// keeper looked), and the command gets the stop signal once, the keeper's.
    fn signal_run(&mut self, id: u32, signal: Signal) {
        let Some(run) = self.runs.get(&id) else {
            return;
        };
        if let Some(watch) = &run.watch
            && watch.stops_by_itself()
            && signal == watch.terms.signal
        {
            return;
        }
        if self.owns_group(id) {
            let _ = killpg(run.main, signal);
        }
    }

    /// Whether run `id`'s command's pid still names its process group: the command runs, or
    /// its pid has not gone to another run's command since it was reaped (a group's id stays
    /// taken while any member lives, and a command leads its own).
    fn owns_group(&self, id: u32) -> bool {
        self.runs
            .get(&id)
            .is_some_and(|run| !run.main_done || self.mains.get(&run.main.as_raw()) == Some(&id))
    }

    /// Looks at a run's deadline, its timer having fired.
    fn check_watch(&mut self, id: u32) {
        let (channel, inbox, gone) = (&self.channel, &mut self.inbox, &mut self.pgleader_gone);
        let Some(run) = self.runs.get_mut(&id) else {
            return;
        };
        let Some(watch) = &mut run.watch else {
            return;
        };
        let main = run.main;
        match watch.check(|| stopping_waits(channel, inbox, gone, id)) {
            Step::Wait => {}
            Step::Stop => {
                let terms = watch.terms;
                let line = own_stop_line(watch, main.as_raw(), true);
                let without_news = without_news(watch);
                self.report(id, Report::Expired(without_news));
                if terms.signal == Signal::SIGKILL || terms.kill_timeout.is_zero() {
                    self.kill_run(id);
                } else if self.owns_group(id) {
                    let _ = killpg(main, terms.signal);
                    let _ = killpg(main, Signal::SIGCONT);
                }
                self.aside.write(line);
            }
            Step::Escalate => {
                self.aside.write(escalation_line(watch, main.as_raw()));
                self.kill_run(id);
            }
        }
    }

    /// SIGKILLs everything of a run, now and at each reap until it is gone.
    fn kill_run(&mut self, id: u32) {
        if let Some(run) = self.runs.get_mut(&id) {
            run.killing = true;
            self.kill_pass(id);
        }
    }

    /// SIGKILLs what of run `id` lives: its command and its descendants, and the orphans
    /// counted as its, with theirs. The whole of it is read before anything is killed (a
    /// process killed first would hand its children over while the walk reads them).
    fn kill_pass(&mut self, id: u32) {
        self.adopt();
        let Some(run) = self.runs.get(&id) else {
            return;
        };
        let mut roots = Vec::new();
        if !run.main_done {
            roots.push(run.main.as_raw());
        }
        // An orphan that may be another run's too goes only once each of those is killed:
        // one run's end never kills another's processes (the run waits for it meanwhile).
        roots.extend(
            self.adopted
                .iter()
                .filter(|(_, owners)| {
                    owners.contains(&id)
                        && owners
                            .iter()
                            .all(|owner| self.runs.get(owner).is_none_or(|run| run.killing))
                })
                .map(|(pid, _)| *pid),
        );
        let mut doomed = Vec::new();
        for root in roots {
            doomed.push(root);
            doomed.extend(procfs::descendants(root));
        }
        for pid in doomed {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }

    /// Reaps every child that has exited, reporting each command's end; counts the orphans
    /// reparented since, and kills again what runs being killed may have forked.
    fn reap(&mut self) -> Reaped {
        while let Ok(Some(_)) = self.signalfd.read_signal() {}
        let left = loop {
            let status = match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => break Reaped::SomeLeft,
                Ok(status) => status,
                Err(Errno::EINTR) => continue,
                Err(_) => break Reaped::NoChildrenLeft,
            };
            let Some(pid) = status.pid() else { continue };
            let report = match status {
                WaitStatus::Exited(_, code) => Report::Exited(code),
                WaitStatus::Signaled(_, signal, _) => Report::Killed(signal as i32),
                _ => continue,
            };
            if self.adopted.remove(&pid.as_raw()).is_some() {
                continue;
            }
            if let Some(&id) = self.mains.get(&pid.as_raw())
                && let Some(run) = self.runs.get_mut(&id)
                && !run.main_done
            {
                run.main_done = true;
                self.report(id, report);
            }
        };
        self.adopt();
        let killing: Vec<u32> = self
            .runs
            .iter()
            .filter(|(_, run)| run.killing)
            .map(|(id, _)| *id)
            .collect();
        for id in killing {
            self.kill_pass(id);
        }
        left
    }

    /// Counts each child the keeper has not met yet (an orphan reparented to it) as a run's.
    fn adopt(&mut self) {
        for pid in procfs::own_children() {
            let running_main = self
                .mains
                .get(&pid)
                .and_then(|id| self.runs.get(id))
                .is_some_and(|run| !run.main_done);
            if running_main || self.adopted.contains_key(&pid) {
                continue;
            }
            // A zombie: its reap is on its way.
            let Some(session) = procfs::session_of(pid) else {
                continue;
            };
            let owners = self.owners_of(pid, session);
            if owners.is_empty() {
                // Nobody's: nothing else may run under the keeper.
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
            self.adopted.insert(pid, owners);
        }
    }

    /// The runs an orphan, `pid` in session `session`, is counted as.
    fn owners_of(&self, pid: i32, session: i32) -> Vec<u32> {
        if let Some(&id) = self.mains.get(&session)
            && self.runs.contains_key(&id)
        {
            return vec![id];
        }
        let job = procfs::environment_value(pid, "PGLEADER_JOB");
        let occurrence = procfs::environment_value(pid, "PGLEADER_SCHEDULED_TIME");
        let by_environment: Vec<u32> = self
            .runs
            .iter()
            .filter(|(_, run)| job.is_some() && run.job == job && run.occurrence == occurrence)
            .map(|(id, _)| *id)
            .collect();
        if by_environment.is_empty() {
            self.runs.keys().copied().collect()
        } else {
            by_environment
        }
    }

    /// Reports each run whose command is reaped and whose orphans are gone, once its output's
    /// last lines are written (or the log has stalled): those lines, then `Done`.
    fn finish_done_runs(&mut self) {
        let done: Vec<u32> = self
            .runs
            .iter()
            .filter(|(id, run)| {
                run.main_done && !self.adopted.values().any(|owners| owners.contains(id))
            })
            .map(|(id, _)| *id)
            .collect();
        for id in done {
            let Some(run) = self.runs.get_mut(&id) else {
                continue;
            };
            let tail = match &mut run.relay {
                Some(relay) => {
                    let finishing = run.finishing.get_or_insert_with(|| relay.finishing());
                    match relay.try_finish(finishing) {
                        Some(tail) => tail,
                        None => continue,
                    }
                }
                None => Vec::new(),
            };
            let main = run.main.as_raw();
            self.runs.remove(&id);
            // Unless its pid went to another run's command since.
            if self.mains.get(&main) == Some(&id) {
                self.mains.remove(&main);
            }
            if !tail.is_empty() {
                self.send(&messages::output_report(id, &tail));
            }
            self.report(id, Report::Done(0));
        }
    }

    /// Whether a run's last lines are being written: the keeper looks again shortly.
    fn any_finishing(&self) -> bool {
        self.runs.values().any(|run| run.finishing.is_some())
    }

    /// The keeper's end: everything of every run killed and reaped, the runs reported done,
    /// then (pgleader being dead) the farewells, and the sockets let go.
    fn end(&mut self) {
        loop {
            for pid in procfs::descendants(nix::unistd::getpid().as_raw()) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
            if self.reap() == Reaped::NoChildrenLeft {
                break;
            }
            let mut fds = [PollFd::new(self.signalfd.as_fd(), PollFlags::POLLIN)];
            let _ = poll(&mut fds, PollTimeout::from(10u8));
        }
        self.adopted.clear();
        for run in self.runs.values_mut() {
            run.main_done = true;
        }
        // The sockets first: the next replica does not wait for the runs' last log lines.
        if self.pgleader_gone || farewell::channel_ended(self.channel.as_fd()) {
            let answered = self.farewells.say_if_orphaned(&self.held);
            if answered > 0 {
                info!(
                    event = "farewell",
                    answered, "released the dead replica's locks on {answered} server(s)"
                );
            }
        }
        self.held.clear();
        // Each run's last lines, until written or stalled (`output::STALLED`).
        loop {
            self.finish_done_runs();
            if self.runs.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        self.aside.wait();
    }

    fn report(&mut self, id: u32, report: Report) {
        self.send(&messages::report(id, report));
    }

    /// Queues `bytes` for pgleader and writes what the channel takes now.
    fn send(&mut self, bytes: &[u8]) {
        self.outbox.extend_from_slice(bytes);
        self.flush();
    }

    fn flush(&mut self) {
        while !self.outbox.is_empty() {
            match self.channel.write(&self.outbox) {
                Ok(n) => {
                    self.outbox.drain(..n);
                }
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => return,
                // pgleader is gone: nobody will read them.
                Err(_) => {
                    self.outbox.clear();
                    return;
                }
            }
        }
    }
}

/// How long without news the deadline's terms allow, in milliseconds, for `Report::Expired`.
fn without_news(watch: &Watch) -> i32 {
    i32::try_from(watch.terms.without_news.as_millis()).unwrap_or(i32::MAX)
}

/// Reads what the channel holds into `inbox`, without blocking; `gone` once it has ended.
fn read_into(mut channel: &UnixStream, inbox: &mut Vec<u8>, gone: &mut bool) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        match channel.read(&mut buf) {
            Ok(0) => {
                *gone = true;
                return;
            }
            Ok(n) => inbox.extend_from_slice(&buf[..n]),
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => return,
            Err(_) => {
                *gone = true;
                return;
            }
        }
    }
}

/// Whether pgleader's word that it stops run `id` itself has come, read or waiting: asked
/// after the deadline is marked expired (see `Watch::check`), so everything pgleader sent is
/// read first.
fn stopping_waits(channel: &UnixStream, inbox: &mut Vec<u8>, gone: &mut bool, id: u32) -> bool {
    read_into(channel, inbox, gone);
    let mut at = 0;
    while let Some((tag, run, _, len)) = messages::next_request(&inbox[at..]) {
        if tag == STOPPING && run == id {
            return true;
        }
        at += len;
    }
    false
}
