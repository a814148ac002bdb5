//! A session's keeper seen from pgleader (the keeper's side is `keeper/session.rs`): started
//! with a sharded replica's session and handed its sockets and deadline once, then asked for
//! each run, whose reports come back on the one channel.
//!
//! Requests go out through a thread of their own, in order: a keeper busy starting a burst's
//! commands reads them a little later, and pgleader's loop never waits for it. Reports are read
//! by whichever run's poll comes first and kept for their run; one that was another's wakes
//! that run's waker, left by its last poll, so that only it is polled again
//! (`Commands::next_report`, which also polls its first active run at every turn: the channel
//! wakes only the run that polled it last, which may be gone).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::Signal;
use nix::sys::socket::{MsgFlags, send};
use nix::unistd::Pid;

use crate::election::socket::Lent;
use crate::supervise::keeper::handle::{CommandLine, Job, Link, Parked};
use crate::supervise::keeper::protocol::Report;
use crate::supervise::keeper::protocol::session::{
    self as messages, DISMISS, KILL, RUN, Reported, SIGNAL, STOPPING, session_keeper_args,
};
use crate::supervise::label::Label;
use crate::supervise::watchdog::Deadline;

/// A session's keeper at work: it holds the session's sockets and runs its commands.
#[derive(Debug)]
pub struct SessionKeeper {
    keeper: Pid,
    shared: Arc<Shared>,
    deadline: Option<Deadline>,
    next_run: u32,
}

/// What the session's keeper and its runs share.
#[derive(Debug)]
struct Shared {
    requests: Mutex<Option<mpsc::Sender<Vec<u8>>>>,
    reports: Mutex<Reports>,
}

/// The reports read, by run.
#[derive(Debug)]
struct Reports {
    channel: tokio::net::UnixStream,
    pending: Vec<u8>,
    closed: bool,
    runs: HashMap<u32, RunReports>,
}

#[derive(Debug, Default)]
struct RunReports {
    reports: VecDeque<Report>,
    output: Option<Vec<u8>>,
    main: Option<Pid>,
    /// The command's end was reported: its pid may go to another process (another run's
    /// command, which leads a group of that id) and is signalled no more.
    main_ended: bool,
    /// Who waits for this run's next report: woken when one is read, whichever run's poll
    /// read it (the channel is shared, and wakes only the last run that polled it).
    waker: Option<Waker>,
}

/// One run of a session's keeper, as a [`Job`] holds it.
#[derive(Debug)]
pub(super) struct SessionRun {
    id: u32,
    shared: Arc<Shared>,
}

impl SessionKeeper {
    /// Starts a session's keeper, handing it `hold` (the session's sockets, with their
    /// farewells) and the session's `deadline`.
    pub fn start(hold: &[Lent], deadline: Option<&Deadline>) -> io::Result<SessionKeeper> {
        let parked = Parked::spawn_with(session_keeper_args)?;
        let label = Label::leader();
        parked.send_start(&[], hold, deadline.map(|deadline| (deadline, &label)))?;
        let Parked { keeper, channel } = parked;
        let writer = OwnedFd::from(channel.try_clone()?);
        channel.set_nonblocking(true)?;
        let (requests, queued) = mpsc::channel::<Vec<u8>>();
        std::thread::Builder::new()
            .name("session-keeper".into())
            .spawn(move || write_requests(writer, queued))?;
        Ok(SessionKeeper {
            keeper,
            shared: Arc::new(Shared {
                requests: Mutex::new(Some(requests)),
                reports: Mutex::new(Reports {
                    channel: tokio::net::UnixStream::from_std(channel)?,
                    pending: Vec::new(),
                    closed: false,
                    runs: HashMap::new(),
                }),
            }),
            deadline: deadline.cloned(),
            next_run: 0,
        })
    }

    /// The keeper's pid.
    pub fn pid(&self) -> Pid {
        self.keeper
    }

    /// Whether the keeper is gone (its channel ended): it runs nothing more.
    pub fn is_gone(&self) -> bool {
        let mut reports = lock(&self.shared.reports);
        reports.read_available();
        reports.closed
    }

    /// Runs `command` for the job `job` with `env` added to its environment, watched by the
    /// session's deadline.
    pub fn run(
        &mut self,
        command: &CommandLine,
        job: &str,
        env: &[(&str, String)],
    ) -> io::Result<Job> {
        if self.is_gone() {
            return Err(io::Error::other("the session's keeper is gone"));
        }
        self.next_run = self.next_run.wrapping_add(1);
        let id = self.next_run;
        lock(&self.shared.reports)
            .runs
            .insert(id, RunReports::default());
        let body = messages::run_request(
            command.output,
            job,
            command.program.as_os_str(),
            &command.argv,
            env,
        );
        self.shared.request(messages::request(RUN, id, &body));
        Ok(Job {
            keeper: self.keeper,
            link: Link::Session(SessionRun {
                id,
                shared: Arc::clone(&self.shared),
            }),
            keeper_status: None,
            done: false,
            post_stop: None,
            deadline: self.deadline.clone(),
            expired: false,
            output: None,
        })
    }

    /// Tells the keeper that pgleader, alive, no longer needs it: it kills whatever still
    /// runs, waits for it and exits without a farewell. Returns its pid, to wait for.
    pub fn dismiss(self) -> Pid {
        self.shared.request(messages::request(DISMISS, 0, &[]));
        // The writer ends once every run's handle is gone too.
        self.keeper
    }
}

impl Shared {
    fn request(&self, message: Vec<u8>) {
        if let Some(requests) = lock(&self.requests).as_ref() {
            // A writer that ended means the keeper is gone: its runs are over.
            let _ = requests.send(message);
        }
    }
}

impl Reports {
    /// Reads what the channel holds without blocking, and sorts it by run.
    fn read_available(&mut self) {
        let mut buf = [0u8; 16 * 1024];
        while !self.closed {
            match self.channel.try_read(&mut buf) {
                Ok(0) => self.close(),
                Ok(n) => self.pending.extend_from_slice(&buf[..n]),
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => break,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => self.close(),
            }
        }
        let mut at = 0;
        loop {
            match messages::next_report(&self.pending[at..]) {
                Ok(Some((reported, len))) => {
                    at += len;
                    self.sort(reported);
                }
                Ok(None) => break,
                Err(_) => {
                    // Not the keeper's words: nothing more can be trusted of it.
                    self.close();
                    break;
                }
            }
        }
        self.pending.drain(..at);
    }

    fn sort(&mut self, reported: Reported) {
        let (Reported::Report(id, _) | Reported::Output(id, _)) = &reported;
        let Some(run) = self.runs.get_mut(id) else {
            return;
        };
        match reported {
            Reported::Report(_, report) => {
                match report {
                    Report::Started(pid) => run.main = Some(Pid::from_raw(pid)),
                    Report::Exited(_) | Report::Killed(_) => run.main_ended = true,
                    _ => {}
                }
                run.reports.push_back(report);
            }
            Reported::Output(_, tail) => run.output = Some(tail),
        }
        if let Some(waker) = run.waker.take() {
            waker.wake();
        }
    }

    /// The keeper is gone: every run waiting for a report is told (it reads the end).
    fn close(&mut self) {
        self.closed = true;
        for run in self.runs.values_mut() {
            if let Some(waker) = run.waker.take() {
                waker.wake();
            }
        }
    }
}

impl SessionRun {
    /// The command's pid (its process group's), once its start has been read.
    pub(super) fn main(&self) -> Option<Pid> {
        lock(&self.shared.reports)
            .runs
            .get(&self.id)
            .and_then(|run| run.main)
    }

    /// The command's pid while it runs (as far as the reports read say): the process group
    /// pgleader may signal itself.
    pub(super) fn live_main(&self) -> Option<Pid> {
        lock(&self.shared.reports)
            .runs
            .get(&self.id)
            .filter(|run| !run.main_ended)
            .and_then(|run| run.main)
    }

    pub(super) fn signal(&self, signal: Signal) {
        let body = (signal as i32).to_le_bytes();
        self.shared
            .request(messages::request(SIGNAL, self.id, &body));
    }

    pub(super) fn kill(&self) {
        self.shared.request(messages::request(KILL, self.id, &[]));
    }

    pub(super) fn tell_stopping(&self) {
        self.shared
            .request(messages::request(STOPPING, self.id, &[]));
    }

    /// Whether the session's keeper is gone: the run is over, whatever it reported.
    pub(super) fn keeper_gone(&self) -> bool {
        let reports = lock(&self.shared.reports);
        reports.closed
            && reports
                .runs
                .get(&self.id)
                .is_none_or(|run| run.reports.is_empty())
    }

    /// The run's next report. A report read for another run wakes that run's waker (left
    /// here by its last poll), so that its owner polls that run alone.
    pub(super) fn poll_report(&mut self, cx: &mut Context<'_>) -> Poll<Report> {
        let mut reports = lock(&self.shared.reports);
        loop {
            let Some(run) = reports.runs.get_mut(&self.id) else {
                return Poll::Pending;
            };
            if let Some(report) = run.reports.pop_front() {
                return Poll::Ready(report);
            }
            if !run.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                run.waker = Some(cx.waker().clone());
            }
            if reports.closed {
                return Poll::Pending;
            }
            match reports.channel.poll_read_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(_)) => reports.close(),
                Poll::Ready(Ok(())) => reports.read_available(),
            }
        }
    }

    /// The run's last lines, once reported.
    pub(super) fn take_output(&mut self) -> Option<Vec<u8>> {
        lock(&self.shared.reports)
            .runs
            .get_mut(&self.id)
            .and_then(|run| run.output.take())
    }

    /// The reports read or readable now, without waiting.
    pub(super) fn remaining_reports(&mut self) -> Vec<Report> {
        let mut reports = lock(&self.shared.reports);
        reports.read_available();
        reports
            .runs
            .get_mut(&self.id)
            .map(|run| run.reports.drain(..).collect())
            .unwrap_or_default()
    }
}

impl Drop for SessionRun {
    fn drop(&mut self) {
        let mut reports = lock(&self.shared.reports);
        reports.runs.remove(&self.id);
        // The channel may have been left waking this run alone: another that waits polls it
        // from now on.
        if let Some(waker) = reports.runs.values_mut().find_map(|run| run.waker.take()) {
            waker.wake();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The writer's thread: writes each request whole, in order, waiting for the keeper to read
/// when the channel is full; gives up once the keeper is gone.
fn write_requests(channel: OwnedFd, queued: mpsc::Receiver<Vec<u8>>) {
    for message in queued {
        let mut sent = 0;
        while sent < message.len() {
            match send(
                std::os::fd::AsRawFd::as_raw_fd(&channel),
                &message[sent..],
                MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT,
            ) {
                Ok(n) => sent += n,
                Err(Errno::EINTR) => {}
                Err(Errno::EAGAIN) => {
                    let mut fds = [PollFd::new(channel.as_fd(), PollFlags::POLLOUT)];
                    let _ = poll(&mut fds, PollTimeout::NONE);
                }
                Err(_) => return,
            }
        }
    }
}
