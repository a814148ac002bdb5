//! The keeper: a small process of pgleader's own that leads the command's process group, so
//! that nothing in that group outlives pgleader.
//!
//! A parent-death signal reaches only a direct child. When the command is a shell script, the
//! `pg_dump` it started would live on after a `kill -9` of pgleader and overlap with the next
//! leader's run. So pgleader does not start the command itself: it starts this keeper (its own
//! binary, re-executed under the name `pgleader-keeper`) as the leader of a new process group,
//! and the keeper starts the command inside that group.
//!
//! The keeper is started before it is needed: pgleader parks one while it waits for the lock,
//! so that winning costs one fork and exec (the command's), not two. A parked keeper has set
//! itself up (signals blocked, subreaper) and waits on its channel for the one message that
//! only the new leader can send: the command's environment (`PGLEADER_EPOCH` and the rest,
//! known once the fencing token is taken) and, by `SCM_RIGHTS`, the leader's connection sockets
//! to hold. End-of-file instead (pgleader died while following, or dropped it) makes it exit:
//! it has started nothing. A parked keeper serves one command, then exits with it; the next
//! leadership or occurrence gets a fresh one. The keeper:
//!
//! - holds one end of a socket pair whose other end only pgleader holds. When pgleader dies, by
//!   any means, the kernel closes its end, the keeper reads end-of-file and SIGKILLs every
//!   process that descends from it, then exits. Unlike a parent-death signal this does not depend
//!   on which thread of pgleader did the spawning. pgleader uses the same path, by sending one
//!   byte, when its kill timeout runs out;
//! - gives the command a parent-death signal (SIGKILL) of its own, in case the keeper itself is
//!   killed (the keeper is single-threaded, so the thread that spawns is the one that lives);
//! - keeps every signal blocked, so the signals pgleader sends to the group reach the command
//!   and its descendants but not the keeper (SIGKILL, which cannot be blocked, takes it too);
//! - is a child subreaper: descendants orphaned inside the job are reparented to it, so it can
//!   tell when the whole tree is gone (even processes that left the process group with setsid),
//!   and reaps them meanwhile;
//! - starts the command with a child that shares its memory until `execve` (see [`spawn`]),
//!   so that starting costs no copy of the keeper;
//! - reports over the socket: the command's pid once it has been executed (the keeper resumes
//!   only after `execve` succeeded or failed), or why it could not start, and
//!   the command's exit status once it ends, and that nothing is left (then it exits) once it
//!   has no children left: being a subreaper, it has then outlived every descendant, so
//!   pgleader can release the lock without waiting for the keeper's own exit or reading the
//!   process table;
//! - holds copies of the leader's connection sockets (where the backend lends them) until it
//!   has reaped its last child, and closes them then, before its own exit. When pgleader is
//!   killed -9, the server sees that connection close only once the keeper has killed and
//!   reaped the whole tree, so no follower can take over while any of it still runs;
//! - when pgleader died, says the leader's farewell on those sockets before it closes them
//!   (Redis, see [`farewell`]): it ends the leadership on the server at once, so a follower
//!   takes over the moment the old tree is gone rather than at its next check.
//!
//! Everything here runs in a single-threaded process that does nothing but wait, so plain
//! blocking system calls are the simplest correct tool.

use std::ffi::{OsStr, OsString};
use std::io::{self, IoSliceMut, Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;

use nix::errno::Errno;
use nix::fcntl::{FcntlArg, FdFlag, fcntl};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::prctl;
use nix::sys::signal::{SigSet, SigmaskHow, Signal, kill, killpg, sigprocmask};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::socket::{ControlMessageOwned, MsgFlags, recv, recvmsg};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{Pid, getpid};

use tracing::{info, warn};

use crate::cli::LogFormat;
use crate::election::socket::{Farewell, Lent};
use crate::exit::ChildStatus;
use crate::operate::logging;
use crate::supervise::farewell::{self, Farewells, Parent};
use crate::supervise::hook::{self, Ended, Hook, Hooks};
use crate::supervise::watchdog::{self, Step, Watch};
use crate::supervise::{procfs, spawn};
use crate::time::for_people;

/// How long a keeper about to exit waits for the lines of its own stop to be written.
const LOG_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// The name the keeper runs under; the constructor in `main.rs` checks `argv[0]` for it.
pub const ARGV0: &str = "pgleader-keeper";

/// A report from the keeper to pgleader: a tag byte and a little-endian 32-bit value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Report {
    /// The command runs with this pid.
    Started(i32),
    /// The command could not be executed; the value is the errno of `execve`.
    SpawnFailed(i32),
    /// The command called `exit` with this code.
    Exited(i32),
    /// The command was killed by this signal number.
    Killed(i32),
    /// Nothing of the job is left: the command and every process it started are dead and
    /// reaped (and `--post-stop` has run). The keeper exits right after; the value is 0.
    Done(i32),
    /// `--pre-start` did not pass (the value says how it ended, see `hook::describe`): the
    /// command will not start; `--post-stop` runs, then `Done`.
    PreStartFailed(i32),
    /// The command's whole tree is gone and `--post-stop` runs now, bounded by
    /// `--hook-timeout`; `Done` follows once it has finished. The value is the hook's pid, which
    /// leads a process group of its own.
    PostStop(i32),
    /// No news from pgleader for this many milliseconds (`--check-interval +
    /// --check-timeout`): its deadline passed without renewal, and the keeper stops the
    /// command's tree by itself (see `watchdog.rs`). The command's end and `Done` follow.
    Expired(i32),
}

impl Report {
    pub const LEN: usize = 5;

    pub fn encode(self) -> [u8; Self::LEN] {
        let (tag, value) = match self {
            Report::Started(pid) => (b'S', pid),
            Report::SpawnFailed(errno) => (b'E', errno),
            Report::Exited(code) => (b'X', code),
            Report::Killed(signal) => (b'K', signal),
            Report::Done(value) => (b'D', value),
            Report::PreStartFailed(value) => (b'F', value),
            Report::PostStop(value) => (b'P', value),
            Report::Expired(value) => (b'N', value),
        };
        let [a, b, c, d] = value.to_le_bytes();
        [tag, a, b, c, d]
    }

    pub fn decode(bytes: [u8; Self::LEN]) -> Option<Self> {
        let value = i32::from_le_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]);
        Some(match bytes[0] {
            b'S' => Report::Started(value),
            b'E' => Report::SpawnFailed(value),
            b'X' => Report::Exited(value),
            b'K' => Report::Killed(value),
            b'D' => Report::Done(value),
            b'F' => Report::PreStartFailed(value),
            b'P' => Report::PostStop(value),
            b'N' => Report::Expired(value),
            _ => return None,
        })
    }
}

/// Whether this process was started as a keeper.
pub fn is_keeper_invocation() -> bool {
    std::env::args_os().next().is_some_and(|arg0| arg0 == ARGV0)
}

/// The arguments pgleader passes: the channel's descriptor; `KEY=VALUE` options (the hooks,
/// pgleader's log format and verbosity) up to `--`; the program to execute, the command's
/// `argv[0]` and its arguments.
pub fn keeper_args(
    fd: RawFd,
    hooks: &Hooks,
    program: &OsString,
    argv: &[OsString],
) -> Vec<OsString> {
    let mut args = vec![OsString::from(fd.to_string())];
    args.extend(hooks.to_args());
    args.extend(log_args());
    args.push(OsString::from(END_OF_OPTIONS));
    args.push(program.clone());
    args.extend(argv.iter().cloned());
    args
}

/// The arguments of a membership's keeper: the channel's descriptor, [`MEMBERSHIP`] and how to
/// log, no command (see [`hold_membership`]).
pub fn membership_keeper_args(fd: RawFd) -> Vec<OsString> {
    let mut args = vec![OsString::from(fd.to_string()), OsString::from(MEMBERSHIP)];
    args.extend(log_args());
    args.push(OsString::from(END_OF_OPTIONS));
    args
}

/// pgleader's log format and verbosity, for a keeper that logs as it does.
fn log_args() -> Vec<OsString> {
    let Some((format, verbosity)) = logging::current() else {
        return Vec::new();
    };
    let format = match format {
        LogFormat::Text => "text",
        LogFormat::Json => "json",
    };
    vec![
        OsString::from(format!("{LOG}{format}")),
        OsString::from(format!("{VERBOSITY}{verbosity}")),
    ]
}

const LOG: &str = "log=";
const VERBOSITY: &str = "verbosity=";
const MEMBERSHIP: &str = "membership";
const END_OF_OPTIONS: &str = "--";

/// The keeper's options: the hooks, and how to log (as pgleader does).
#[derive(Default)]
struct Options {
    hooks: Hooks,
    log: Option<LogFormat>,
    verbosity: i8,
    /// A membership's keeper: no command, see [`hold_membership`].
    membership: bool,
}

impl Options {
    /// Reads the options up to `--`.
    fn read(args: &mut impl Iterator<Item = OsString>) -> io::Result<Options> {
        let mut options = Options::default();
        for word in args.by_ref() {
            let word = word
                .into_string()
                .map_err(|_| io::Error::other("an option that is not UTF-8"))?;
            if word == END_OF_OPTIONS {
                return Ok(options);
            }
            if let Some(format) = word.strip_prefix(LOG) {
                options.log = Some(if format == "json" {
                    LogFormat::Json
                } else {
                    LogFormat::Text
                });
            } else if let Some(verbosity) = word.strip_prefix(VERBOSITY) {
                options.verbosity = verbosity.parse().unwrap_or(0);
            } else if word == MEMBERSHIP {
                options.membership = true;
            } else if !options.hooks.read_arg(&word) {
                return Err(io::Error::other(format!("unknown option {word:?}")));
            }
        }
        Err(io::Error::other("missing program"))
    }
}

/// The tag of the message that starts the command: then a little-endian 32-bit length and
/// that many bytes: the length of the environment (32 bits), its `KEY=VALUE\0` entries, the
/// length of the deadline's terms (32 bits, 0 for none) and the terms ([`watchdog::encode`]),
/// and the farewells of the sockets to hold ([`farewell::encode`]); the sockets travel with it
/// (SCM_RIGHTS), followed by the deadline's memfd when there are terms.
pub const START: u8 = b'G';

/// The most connection sockets one start message carries (a Redlock quorum lends one per
/// server).
pub const MAX_HELD: usize = 64;

/// The start message for `env`, the farewells of `hold` and the deadline's `watch` terms,
/// without the descriptors themselves.
pub fn start_message(env: &[(&str, String)], hold: &[Lent], watch: Option<&[u8]>) -> Vec<u8> {
    let mut entries = Vec::new();
    for (key, value) in env {
        entries.extend_from_slice(key.as_bytes());
        entries.push(b'=');
        entries.extend_from_slice(value.as_bytes());
        entries.push(0);
    }
    let watch = watch.unwrap_or_default();
    let farewells = farewell::encode(hold);
    let mut message = vec![START];
    let len = 4 + entries.len() + 4 + watch.len() + farewells.len();
    message.extend_from_slice(&(len as u32).to_le_bytes());
    message.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    message.extend_from_slice(&entries);
    message.extend_from_slice(&(watch.len() as u32).to_le_bytes());
    message.extend_from_slice(watch);
    message.extend_from_slice(&farewells);
    message
}

/// The environment entries a start message carries.
type Env = Vec<(OsString, OsString)>;

/// A start message's body: the environment, the deadline's terms (empty for none) and the
/// farewells.
fn parse_body(body: &[u8]) -> io::Result<(Env, Vec<u8>, Vec<Option<Farewell>>)> {
    let bad = || io::Error::other("a start message that does not parse");
    let mut rest = body;
    let mut part = || -> io::Result<&[u8]> {
        let len = u32::from_le_bytes(
            rest.get(..4)
                .ok_or_else(bad)?
                .try_into()
                .map_err(|_| bad())?,
        ) as usize;
        let part = rest.get(4..4 + len).ok_or_else(bad)?;
        rest = &rest[4 + len..];
        Ok(part)
    };
    let env = part()?;
    let watch = part()?.to_vec();
    let farewells = farewell::decode(rest).ok_or_else(bad)?;
    Ok((parse_env(env), watch, farewells))
}

/// The environment entries of a start message's body.
fn parse_env(body: &[u8]) -> Vec<(OsString, OsString)> {
    body.split(|b| *b == 0)
        .filter(|entry| !entry.is_empty())
        .filter_map(|entry| {
            let at = entry.iter().position(|b| *b == b'=')?;
            Some((
                OsStr::from_bytes(&entry[..at]).to_owned(),
                OsStr::from_bytes(&entry[at + 1..]).to_owned(),
            ))
        })
        .collect()
}

/// What a parked keeper receives: the command's environment and the sockets to hold, or
/// nothing (end-of-file: pgleader is gone or no longer needs it).
struct Start {
    env: Vec<(OsString, OsString)>,
    hold: Vec<OwnedFd>,
    /// What to say on each of `hold` if pgleader dies.
    farewells: Vec<Option<Farewell>>,
    /// The leadership's deadline to watch, with its terms.
    watch: Option<Watch>,
    /// pgleader asked for the end right after the start, before the keeper read either.
    kill_now: bool,
}

/// Waits, parked, for the start message.
fn wait_for_start(channel: &UnixStream) -> io::Result<Option<Start>> {
    let mut received = Vec::new();
    let mut hold = Vec::new();
    loop {
        let mut buf = [0u8; 4096];
        let mut cmsg = nix::cmsg_space!([RawFd; MAX_HELD + 1]);
        let mut iov = [IoSliceMut::new(&mut buf)];
        let message = match recvmsg::<()>(
            channel.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(message) => message,
            Err(Errno::EINTR) => continue,
            Err(err) => return Err(err.into()),
        };
        let n = message.bytes;
        for cmsg in message.cmsgs()? {
            if let ControlMessageOwned::ScmRights(fds) = cmsg {
                // SAFETY: the kernel has just installed these descriptors in this process
                // for us alone (close-on-exec, so the command does not inherit them).
                hold.extend(
                    fds.into_iter()
                        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                );
            }
        }
        if n == 0 {
            return Ok(None);
        }
        received.extend_from_slice(&buf[..n]);
        if received[0] != START {
            return Err(io::Error::other("unexpected message from pgleader"));
        }
        if received.len() >= 5 {
            let len = u32::from_le_bytes([received[1], received[2], received[3], received[4]]);
            let end = 5 + len as usize;
            if received.len() >= end {
                let (env, watch, farewells) = parse_body(&received[5..end])?;
                let mut watch = if watch.is_empty() {
                    None
                } else {
                    let (terms, label) = watchdog::decode(&watch)
                        .ok_or_else(|| io::Error::other("a deadline's terms that do not parse"))?;
                    let page = hold
                        .pop()
                        .ok_or_else(|| io::Error::other("a deadline without its memfd"))?;
                    Some(Watch::new(page, terms, label)?)
                };
                // pgleader began stopping the command right after its start.
                if received[end..].contains(&STOPPING)
                    && let Some(watch) = &mut watch
                {
                    watch.pgleader_stops();
                }
                return Ok(Some(Start {
                    env,
                    hold,
                    farewells,
                    watch,
                    kill_now: received[end..].contains(&KILL_EVERYTHING),
                }));
            }
        }
    }
}

/// Runs the keeper; never returns. Called before Rust's runtime has set itself up (see
/// `main.rs`): [`runtime_start`] does the part of that set-up the keeper relies on.
pub fn main() -> ! {
    runtime_start();
    let code = match run() {
        Ok(code) => code,
        Err(err) => {
            eprintln!("{ARGV0}: {err}");
            1
        }
    };
    std::process::exit(code)
}

/// What Rust's runtime does before `main` and the keeper relies on: standard descriptors that
/// are closed become `/dev/null` (so that the channel, a signalfd or a held socket never takes
/// their numbers, to be inherited by the command as its stdin, stdout or stderr), and SIGPIPE
/// is ignored (a write to a channel whose reader is gone gives EPIPE). Not done: the handler
/// that names a stack overflow (the keeper's stack is shallow; an overflow still ends it by
/// SIGSEGV) and the main thread's name.
fn runtime_start() {
    let mut fds = [0, 1, 2].map(|fd| libc::pollfd {
        fd,
        events: 0,
        revents: 0,
    });
    loop {
        // SAFETY: `fds` is an array of three initialised pollfd structures that outlives the
        // call; a zero timeout returns at once.
        if unsafe { libc::poll(fds.as_mut_ptr(), 3, 0) } != -1 {
            break;
        }
        match Errno::last() {
            Errno::EINTR => continue,
            // As std does where poll cannot be used: ask each descriptor on its own.
            _ => {
                for pfd in &mut fds {
                    if fcntl(
                        // SAFETY: only its flags are read; a closed descriptor gives EBADF.
                        unsafe { std::os::fd::BorrowedFd::borrow_raw(pfd.fd) },
                        FcntlArg::F_GETFD,
                    ) == Err(Errno::EBADF)
                    {
                        pfd.revents = libc::POLLNVAL;
                    }
                }
                break;
            }
        }
    }
    for pfd in fds {
        if pfd.revents & libc::POLLNVAL != 0 {
            // SAFETY: a constant, null-terminated path; the descriptor is left open on purpose
            // (it takes the closed standard descriptor's number).
            if unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDWR) } == -1 {
                std::process::abort();
            }
        }
    }
    // SAFETY: setting a signal's disposition to SIG_IGN installs no handler.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
}

fn run() -> io::Result<i32> {
    let mut args = std::env::args_os().skip(1);
    let fd: RawFd = args
        .next()
        .and_then(|fd| fd.to_str()?.parse().ok())
        .ok_or_else(|| io::Error::other("this program is started by pgleader, not by hand"))?;
    let options = Options::read(&mut args)?;
    // Only hooks log here (their output and how they ended), and a membership's farewell.
    if let Some(format) = options.log
        && (options.hooks.any() || options.membership)
    {
        logging::init(format, options.verbosity);
    }
    let hooks = options.hooks;

    // SAFETY: pgleader passes the number of a descriptor it left open for us (and that nothing
    // else in this process owns); a wrong number fails the checks below rather than aliasing.
    let channel = unsafe { OwnedFd::from_raw_fd(fd) };
    fcntl(&channel, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC)).map_err(|err| {
        io::Error::other(format!(
            "the channel from pgleader (descriptor {fd}) was not inherited: {err} (posix_spawn \
             keeps it only with glibc 2.29, musl 1.1.24 or later)"
        ))
    })?;
    let channel = UnixStream::from(channel);
    if options.membership {
        return hold_membership(channel);
    }
    let program = args
        .next()
        .ok_or_else(|| io::Error::other("missing program"))?;
    let argv: Vec<OsString> = args.collect();
    let (argv0, rest) = argv
        .split_first()
        .ok_or_else(|| io::Error::other("missing argv[0]"))?;

    // pgleader started us with every signal blocked already (see `job::Parked::spawn`), so a
    // signal sent to the group before this point cannot kill the keeper; block again in case
    // we were started some other way.
    sigprocmask(SigmaskHow::SIG_BLOCK, Some(&SigSet::all()), None)?;
    prctl::set_child_subreaper(true)?;
    let mut children = SigSet::empty();
    children.add(Signal::SIGCHLD);
    let signalfd = SignalFd::with_flags(&children, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)?;

    // Everything the command's start needs but its added environment, ready before the win.
    let mut argv = vec![argv0.clone()];
    argv.extend(rest.iter().cloned());
    let mut prepared = spawn::Prepared::new(&program, &argv);

    // Watched from now, while pgleader surely is the parent: the farewell is said only once
    // it is dead.
    let parent = Parent::watch();

    // Parked until pgleader wins, or gone with it.
    let Some(start) = wait_for_start(&channel)? else {
        return Ok(0);
    };
    if start.kill_now {
        return Ok(0);
    }
    // The leader's connection sockets: held, never read or written, until every process of the
    // job is gone (`Job::finish`). The command does not inherit them (they arrived
    // close-on-exec).
    let mut job = Job {
        main_pid: None,
        main_done: false,
        main_status: None,
        channel,
        pgleader_gone: false,
        signalfd,
        held_connections: start.hold,
        farewells: Farewells {
            parent,
            farewells: start.farewells,
        },
        hooks,
        env: start.env,
        hook: None,
        watch: start.watch,
        log: options.log.map(|format| (format, options.verbosity)),
        logging: Vec::new(),
    };

    // pgleader stopped (or hung) between its last look at the deadline and this start: the
    // deadline has passed, and nothing starts. Reported as a run killed, as the next leader
    // records an interrupted run.
    let channel = &job.channel;
    if job
        .watch
        .as_mut()
        .is_some_and(|watch| watch.check(|| stopping_waits(channel)) == Step::Stop)
    {
        job.begin_own_stop();
        let _ = job
            .channel
            .write_all(&Report::Killed(Signal::SIGKILL as i32).encode());
        job.finish();
        return Ok(0);
    }

    if let Some(line) = job.hooks.pre_start.clone() {
        let mut ended = job.run_hook(Hook::PreStart, &line);
        // It passed after the keeper's own stop had begun (it ignored the signal, or ended
        // just then): the leadership is over, and the command must not start.
        if ended == Ended::Passed && job.watch.as_ref().is_some_and(Watch::stops_by_itself) {
            ended = Ended::Interrupted;
        }
        if ended != Ended::Passed {
            // A failed write means pgleader is gone; post-stop runs all the same.
            let _ = job
                .channel
                .write_all(&Report::PreStartFailed(ended.code()).encode());
            job.end();
            return Ok(0);
        }
    }

    let spawned = prepared
        .as_mut()
        .map_err(|err| Errno::from_raw(err.raw_os_error().unwrap_or(Errno::EINVAL as i32)))
        .and_then(|prepared| prepared.spawn(&job.env));
    let main_pid = match spawned {
        Ok(pid) => pid,
        Err(errno) => {
            let _ = job
                .channel
                .write_all(&Report::SpawnFailed(errno as i32).encode());
            // What --pre-start did is undone all the same.
            job.run_post_stop();
            return Ok(if errno == Errno::ENOENT { 127 } else { 126 });
        }
    };
    job.main_pid = Some(main_pid);
    // A failed write means pgleader is gone; the poll loop below notices and cleans up.
    let _ = job
        .channel
        .write_all(&Report::Started(main_pid.as_raw()).encode());

    loop {
        // The deadline's timer third, when there is one (no allocation: a waiting keeper's
        // every page of code and heap stays resident).
        let watched = job.watch.as_ref().map_or(job.channel.as_fd(), Watch::fd);
        let mut fds = [
            PollFd::new(job.channel.as_fd(), PollFlags::POLLIN),
            PollFd::new(job.signalfd.as_fd(), PollFlags::POLLIN),
            PollFd::new(watched, PollFlags::POLLIN),
        ];
        let polled = if job.watch.is_some() { 3 } else { 2 };
        match poll(&mut fds[..polled], PollTimeout::NONE) {
            Err(Errno::EINTR) => continue,
            Err(err) => {
                // Unable to watch over the job any more: end it rather than orphan it.
                job.kill_everything();
                return Err(err.into());
            }
            Ok(_) => {}
        }
        let channel_ready = fds[0].any().unwrap_or(true);
        let children_ready = fds[1].any().unwrap_or(false);
        let watch_ready = polled == 3 && fds[2].any().unwrap_or(true);

        if channel_ready {
            let request = read_request(&mut job.channel);
            let request_is_gone = matches!(request, Request::PgleaderGone);
            match request {
                Request::None => {}
                Request::Stopping => {
                    if let Some(watch) = &mut job.watch {
                        watch.pgleader_stops();
                    }
                }
                // pgleader asks for the end (its kill timeout ran out), or died without
                // stopping us: nothing of the job may outlive this moment.
                Request::KillEverything | Request::Abort | Request::PgleaderGone => {
                    job.pgleader_gone |= request_is_gone;
                    job.kill_everything();
                    job.end();
                    return Ok(0);
                }
            }
        }
        if watch_ready && let Some(watch) = &mut job.watch {
            match watch.check(|| stopping_waits(&job.channel)) {
                Step::Wait => {}
                Step::Stop => {
                    // SIGKILL at once (the kill signal, or a kill timeout of 0): all is gone.
                    if job.begin_own_stop() {
                        job.end();
                        return Ok(0);
                    }
                }
                Step::Escalate => {
                    job.log_escalation();
                    job.kill_everything();
                    job.end();
                    return Ok(0);
                }
            }
        }
        if children_ready && job.reap() == Reaped::NoChildrenLeft && job.main_done {
            job.end();
            return Ok(0);
        }
    }
}

/// A membership's keeper: it starts no command and holds a replica's connection sockets, so
/// that when pgleader dies between its commands' runs someone is left to end the replica's
/// membership on the server at once (Redis: nobody is told when a connection closes; the
/// others' watcher would find it only at its next check).
///
/// Its channel ends only when every copy of pgleader's end is closed: pgleader's own, and the
/// copy each command's keeper holds (lent with the command's sockets, closed once that
/// command's whole tree is gone). So the end of the channel means pgleader is gone and no
/// command of the replica runs any more: its farewell may free everything the replica held,
/// the others take its jobs, and no run of them overlaps with one of the dead replica's.
/// [`KILL_EVERYTHING`] on the channel instead is pgleader, alive, dismissing it (the session is
/// over, or pgleader releases by itself): it exits without a word.
fn hold_membership(mut channel: UnixStream) -> io::Result<i32> {
    let parent = Parent::watch();
    let Some(start) = wait_for_start(&channel)? else {
        return Ok(0);
    };
    if start.kill_now {
        return Ok(0);
    }
    loop {
        let mut fds = [PollFd::new(channel.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::NONE) {
            Err(Errno::EINTR) => continue,
            Err(err) => return Err(err.into()),
            Ok(_) => {}
        }
        match read_request(&mut channel) {
            Request::None | Request::Stopping => {}
            Request::KillEverything | Request::Abort => return Ok(0),
            Request::PgleaderGone => {
                let farewells = Farewells {
                    parent,
                    farewells: start.farewells,
                };
                if farewells.say_if_orphaned(&start.hold) > 0 {
                    info!(
                        event = "farewell",
                        "ended the dead replica's membership on the server: the others take its jobs"
                    );
                }
                return Ok(0);
            }
        }
    }
}

/// The request byte pgleader sends when the command's tree must end now (its kill timeout
/// ran out, or the stop signal is SIGKILL): everything the command (or `--pre-start`) started.
/// A `--post-stop` that runs already is not touched: the tree it follows is gone.
pub const KILL_EVERYTHING: u8 = b'K';

/// The request byte pgleader sends when everything must end now, a running hook included (a
/// second TERM or INT while `--post-stop` runs).
pub const ABORT: u8 = b'A';

/// The request byte pgleader sends when it has begun stopping the command itself (its stop
/// signal went to the group): the keeper stops watching the deadline and only makes sure that
/// SIGKILL follows after `--kill-timeout` (see `watchdog.rs`).
pub const STOPPING: u8 = b'S';

enum Request {
    None,
    Stopping,
    KillEverything,
    Abort,
    PgleaderGone,
}

/// Whether pgleader's word that it stops the command itself ([`STOPPING`]) waits unread on the
/// channel; nothing is consumed.
fn stopping_waits(channel: &UnixStream) -> bool {
    let mut buf = [0u8; 64];
    matches!(
        recv(channel.as_raw_fd(), &mut buf, MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT),
        Ok(n) if buf[..n].contains(&STOPPING)
    )
}

/// Reads what is waiting on the channel.
fn read_request(channel: &mut UnixStream) -> Request {
    let mut buf = [0u8; 64];
    match channel.read(&mut buf) {
        Ok(0) => Request::PgleaderGone,
        Ok(n) if buf[..n].contains(&ABORT) => Request::Abort,
        Ok(n) if buf[..n].contains(&KILL_EVERYTHING) => Request::KillEverything,
        Ok(n) if buf[..n].contains(&STOPPING) => Request::Stopping,
        Ok(_) => Request::None,
        Err(err) if err.kind() == io::ErrorKind::Interrupted => Request::None,
        Err(_) => Request::PgleaderGone,
    }
}

#[derive(PartialEq, Eq)]
enum Reaped {
    SomeLeft,
    NoChildrenLeft,
}

/// The keeper's side of a running job.
struct Job {
    /// The command, once it runs.
    main_pid: Option<Pid>,
    main_done: bool,
    /// How the command ended, for `--post-stop`'s `PGLEADER_EXIT_CODE`.
    main_status: Option<i32>,
    channel: UnixStream,
    /// The channel read end-of-file: nobody reads the reports any more.
    pgleader_gone: bool,
    signalfd: SignalFd,
    held_connections: Vec<OwnedFd>,
    /// What to say on `held_connections` before closing them, if pgleader died.
    farewells: Farewells,
    hooks: Hooks,
    /// What pgleader added to the command's environment (the hooks get it too).
    env: Vec<(OsString, OsString)>,
    /// The hook that runs, and how it ended once reaped.
    hook: Option<(Pid, Option<WaitStatus>)>,
    /// The leadership's deadline, watched while the command (or `--pre-start`) runs.
    watch: Option<Watch>,
    /// How pgleader logs, for the lines the keeper writes of its own stop.
    log: Option<(LogFormat, i8)>,
    /// Lines being written beside the keeper's work (see [`Job::log_aside`]), each saying
    /// when it is done.
    logging: Vec<std::sync::mpsc::Receiver<()>>,
}

impl Job {
    /// Reaps every child that has exited, reporting the command's own end and noting a
    /// hook's.
    fn reap(&mut self) -> Reaped {
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
    /// [`Job::finish`].
    fn end(&mut self) {
        self.run_post_stop();
        self.finish();
    }

    /// Runs `--post-stop`, if set, once the command's tree is gone.
    fn run_post_stop(&mut self) {
        let Some(line) = self.hooks.post_stop.clone() else {
            return;
        };
        if let Some(code) = self.main_status {
            self.env
                .push(("PGLEADER_EXIT_CODE".into(), code.to_string().into()));
        }
        self.run_hook(Hook::PostStop, &line);
    }

    /// Runs a hook to its end: its exit, its timeout, or (for `--pre-start`) pgleader's
    /// request to end everything or pgleader's death. A `--post-stop` goes on when pgleader
    /// dies: undoing what the leader did is why it exists. Whatever the hook leaves running
    /// is killed when it ends, so nothing of it is left when this returns.
    fn run_hook(&mut self, hook: Hook, line: &str) -> Ended {
        let own_group = hook == Hook::PostStop;
        let mut running = match hook::Running::spawn(hook, line, &self.env, own_group) {
            Ok(running) => running,
            Err(err) => {
                warn!(event = "hook_failed", hook = hook.name(), reason = %err, "cannot run --{hook}");
                return Ended::Failed(ChildStatus::Exited(127));
            }
        };
        self.hook = Some((running.pid, None));
        if hook == Hook::PostStop {
            // pgleader's stop sequence gives the hook its own timeout from here on, and knows
            // its process group (out of the job's) should the keeper itself have to be killed.
            let _ = self
                .channel
                .write_all(&Report::PostStop(running.pid.as_raw()).encode());
        }
        let deadline = running.started + self.hooks.timeout;
        let ended = loop {
            if let Some((_, Some(status))) = self.hook {
                break match status {
                    WaitStatus::Exited(_, 0) => Ended::Passed,
                    WaitStatus::Exited(_, code) => Ended::Failed(ChildStatus::Exited(code)),
                    WaitStatus::Signaled(_, signal, _) => {
                        Ended::Failed(ChildStatus::Signaled(signal))
                    }
                    _ => Ended::Failed(ChildStatus::Exited(1)),
                };
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break Ended::TimedOut;
            }
            // The channel is watched until pgleader is gone (end-of-file stays readable).
            let mut fds = vec![PollFd::new(self.signalfd.as_fd(), PollFlags::POLLIN)];
            let channel_at = (!self.pgleader_gone).then(|| {
                fds.push(PollFd::new(self.channel.as_fd(), PollFlags::POLLIN));
                fds.len() - 1
            });
            let output_at = running.output_fd().map(|fd| {
                fds.push(PollFd::new(fd, PollFlags::POLLIN));
                fds.len() - 1
            });
            // `--pre-start` stands where the command will, deadline included; `--post-stop`
            // follows a tree that is gone.
            let watch_at = self
                .watch
                .as_ref()
                .filter(|_| hook == Hook::PreStart)
                .map(|watch| {
                    fds.push(PollFd::new(watch.fd(), PollFlags::POLLIN));
                    fds.len() - 1
                });
            let wait = PollTimeout::try_from(left.as_millis().clamp(1, 60_000) as i32)
                .unwrap_or(PollTimeout::MAX);
            match poll(&mut fds, wait) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(_) => break Ended::Interrupted,
            }
            let ready: Vec<bool> = fds.iter().map(|fd| fd.any().unwrap_or(true)).collect();
            drop(fds);
            if output_at.is_some_and(|at| ready[at]) {
                running.read_output();
            }
            if channel_at.is_some_and(|at| ready[at]) {
                match read_request(&mut self.channel) {
                    Request::None => {}
                    Request::Stopping => {
                        if let Some(watch) = self.watch.as_mut().filter(|_| hook == Hook::PreStart)
                        {
                            watch.pgleader_stops();
                        }
                    }
                    // Pre-start stands where the command will: its kill timeout covers it.
                    Request::KillEverything if hook == Hook::PreStart => break Ended::Interrupted,
                    // A kill timeout that ran out as the tree ended: that tree is gone.
                    Request::KillEverything => {}
                    Request::Abort => break Ended::Interrupted,
                    Request::PgleaderGone => {
                        self.pgleader_gone = true;
                        if hook == Hook::PreStart {
                            break Ended::Interrupted;
                        }
                    }
                }
            }
            if watch_at.is_some_and(|at| ready[at])
                && let Some(watch) = &mut self.watch
            {
                match watch.check(|| stopping_waits(&self.channel)) {
                    Step::Wait => {}
                    Step::Stop => {
                        if self.begin_own_stop() {
                            break Ended::Interrupted;
                        }
                    }
                    Step::Escalate => {
                        self.log_escalation();
                        break Ended::Interrupted;
                    }
                }
            }
            if ready[0] {
                self.reap();
            }
        };
        // Whatever is left of the hook (its leftovers, or all of it) goes now, and its output
        // is read to the end.
        self.kill_everything();
        self.hook = None;
        // Every writer is dead now, so the pipe ends soon; a copy handed to some process out
        // of the keeper's reach is not waited for.
        for _ in 0..10 {
            let Some(fd) = running.output_fd() else {
                break;
            };
            let _ = poll(
                &mut [PollFd::new(fd, PollFlags::POLLIN)],
                PollTimeout::from(10u8),
            );
            running.read_output();
        }
        let took = running.started.elapsed();
        match ended {
            Ended::Passed => info!(
                event = "hook_finished",
                hook = hook.name(),
                elapsed_ms = took.as_millis() as u64,
                "--{hook} finished in {}",
                for_people(took)
            ),
            ended => warn!(
                event = "hook_failed",
                hook = hook.name(),
                elapsed_ms = took.as_millis() as u64,
                "--{hook} failed: {}",
                hook::describe(ended.code())
            ),
        }
        ended
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
    fn finish(&mut self) {
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
        let _ = self.channel.write_all(&Report::Done(0).encode());
        // The lines of the keeper's own stop, unless their write is blocked (nobody reads).
        let until = std::time::Instant::now() + LOG_WAIT;
        for logged in self.logging.drain(..) {
            let left = until.saturating_duration_since(std::time::Instant::now());
            let _ = logged.recv_timeout(left);
        }
    }

    /// The deadline passed with no news from pgleader (see `watchdog.rs`): tells pgleader (it
    /// reads it once it runs again), then sends the kill signal and SIGCONT to the process
    /// group, as pgleader's own stop does (SIGKILL, or a kill timeout of 0, goes to everything
    /// at once). The keeper blocks every signal, so the group's signals do not reach it.
    /// True if everything went at once: nothing of the tree is left.
    fn begin_own_stop(&mut self) -> bool {
        let Some(watch) = &self.watch else {
            return false;
        };
        let (terms, label) = (watch.terms, watch.label.clone());
        let without_news = i32::try_from(terms.without_news.as_millis()).unwrap_or(i32::MAX);
        // A failed write means pgleader is gone: the channel's end says so next.
        let _ = self
            .channel
            .write_all(&Report::Expired(without_news).encode());
        let at_once = terms.signal == Signal::SIGKILL || terms.kill_timeout.is_zero();
        let running = self.main_pid.is_some() || self.hook.is_some();
        if running && at_once {
            self.kill_everything();
        } else if running {
            let _ = killpg(getpid(), terms.signal);
            let _ = killpg(getpid(), Signal::SIGCONT);
        }
        let pgid = getpid().as_raw();
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
        self.log_aside(move || {
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
        });
        running && at_once
    }

    /// Logs the keeper's own SIGKILL once `--kill-timeout` ran out: of its own stop, or of one
    /// pgleader began and did not follow up.
    fn log_escalation(&mut self) {
        let Some(watch) = &self.watch else {
            return;
        };
        let (terms, label, own) = (watch.terms, watch.label.clone(), watch.stops_by_itself());
        let pgid = getpid().as_raw();
        self.log_aside(move || {
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
        });
    }

    /// Writes a log line on a thread of its own: the keeper's own stop is for a pgleader that
    /// does not run, and that may be because nobody reads the pipe both write their logs to; a
    /// write blocked there must not hold up the stop. [`Job::finish`] waits a little for these
    /// lines before the keeper exits.
    fn log_aside(&mut self, line: impl FnOnce() + Send + 'static) {
        if let Some((format, verbosity)) = self.log {
            logging::init(format, verbosity);
        }
        let (done, logged) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new().spawn(move || {
            line();
            let _ = done.send(());
        });
        if spawned.is_ok() {
            self.logging.push(logged);
        }
    }

    /// SIGKILLs every descendant, including those that left the process group, until none is
    /// left. Being a subreaper, the keeper inherits whatever a killed process leaves behind, so
    /// repeating until it has no children reaches everything the command ever started.
    fn kill_everything(&mut self) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_survives_a_round_trip() {
        let env = [
            ("PGLEADER_EPOCH", "42".to_owned()),
            ("PGLEADER_LOCK_NAME", "a=b c".to_owned()),
            ("EMPTY", String::new()),
        ];
        let hold = [
            Lent::hold(3),
            Lent {
                fd: 4,
                farewell: Some(Farewell {
                    command: b"*1\r\n$4\r\nPING\r\n".to_vec(),
                    marker: b"PONG".to_vec(),
                }),
            },
        ];
        let terms = b"the deadline's terms";
        let message = start_message(&env, &hold, Some(terms));
        assert_eq!(message[0], START);
        let len = u32::from_le_bytes([message[1], message[2], message[3], message[4]]);
        assert_eq!(len as usize, message.len() - 5);
        let (env_parsed, watch, farewells) = parse_body(&message[5..]).expect("a start message");
        assert_eq!(watch, terms);
        assert_eq!(
            farewells,
            hold.iter().map(|l| l.farewell.clone()).collect::<Vec<_>>()
        );
        let parsed: Vec<(String, String)> = env_parsed
            .into_iter()
            .map(|(k, v)| {
                (
                    k.into_string().expect("UTF-8"),
                    v.into_string().expect("UTF-8"),
                )
            })
            .collect();
        let expected: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect();
        assert_eq!(parsed, expected);
    }

    #[test]
    fn reports_survive_a_round_trip() {
        for report in [
            Report::Started(4242),
            Report::SpawnFailed(2),
            Report::Exited(-1),
            Report::Killed(9),
            Report::Done(0),
            Report::PreStartFailed(-1),
            Report::PostStop(4242),
            Report::Expired(700),
        ] {
            assert_eq!(Report::decode(report.encode()), Some(report));
        }
        assert_eq!(Report::decode(*b"?\0\0\0\0"), None);
    }
}
