//! The keeper's own process: its way in before Rust's `main`, its start-up, and the run of one
//! command from the start message to the end of its tree.
//!
//! Everything here runs in a single-threaded process that does nothing but wait, so plain
//! blocking system calls are the simplest correct tool.

use std::ffi::OsString;
use std::io::{self, Write};
use std::os::fd::{AsFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::errno::Errno;
use nix::fcntl::{FcntlArg, FdFlag, fcntl};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::prctl;
use nix::sys::signal::{SigSet, SigmaskHow, Signal, sigprocmask};
use nix::sys::signalfd::{SfdFlags, SignalFd};

use crate::operate::logging;
use crate::supervise::hook::{Ended, Hook};
use crate::supervise::keeper::channel::{Request, read_request, stopping_waits, wait_for_start};
use crate::supervise::keeper::farewell::{Farewells, Parent};
use crate::supervise::keeper::membership::hold_membership;
use crate::supervise::keeper::output::{Relay, Tag};
use crate::supervise::keeper::protocol::{ARGV0, Options, Output, Report};
use crate::supervise::keeper::tree::{Aside, Reaped, Tree};
use crate::supervise::keeper::{session, spawn};
use crate::supervise::watchdog::{Step, Watch};

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
    // Only hooks log here (their output and how they ended), and a membership's or a
    // session's farewell.
    if let Some(format) = options.log
        && (options.hooks.any() || options.membership || options.session)
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
    if options.session {
        return session::keep(
            channel,
            options.log.map(|format| (format, options.verbosity)),
        );
    }
    let program = args
        .next()
        .ok_or_else(|| io::Error::other("missing program"))?;
    let argv: Vec<OsString> = args.collect();
    let (argv0, rest) = argv
        .split_first()
        .ok_or_else(|| io::Error::other("missing argv[0]"))?;

    // pgleader started us with every signal blocked already (see `handle::Parked::spawn`), so a
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
    // job is gone (`Tree::finish`). The command does not inherit them (they arrived
    // close-on-exec).
    let mut tree = Tree {
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
        aside: Aside::new(options.log.map(|format| (format, options.verbosity))),
        output: None,
    };

    // pgleader stopped (or hung) between its last look at the deadline and this start: the
    // deadline has passed, and nothing starts. Reported as a run killed, as the next leader
    // records an interrupted run.
    let channel = &tree.channel;
    if tree
        .watch
        .as_mut()
        .is_some_and(|watch| watch.check(|| stopping_waits(channel)) == Step::Stop)
    {
        tree.begin_own_stop();
        let _ = tree
            .channel
            .write_all(&Report::Killed(Signal::SIGKILL as i32).encode());
        tree.finish();
        return Ok(0);
    }

    if let Some(line) = tree.hooks.pre_start.clone() {
        let mut ended = tree.run_hook(Hook::PreStart, &line);
        // It passed after the keeper's own stop had begun (it ignored the signal, or ended
        // just then): the leadership is over, and the command must not start.
        if ended == Ended::Passed && tree.watch.as_ref().is_some_and(Watch::stops_by_itself) {
            ended = Ended::Interrupted;
        }
        if ended != Ended::Passed {
            // A failed write means pgleader is gone; post-stop runs all the same.
            let _ = tree
                .channel
                .write_all(&Report::PreStartFailed(ended.code()).encode());
            tree.end();
            return Ok(0);
        }
    }

    // A crontab job's output becomes log lines (`output.rs`); without the relay's thread, it
    // goes where pgleader's does rather than nowhere.
    let mut relay = match options.output {
        Output::Tagged { keep } => {
            Relay::start(Tag::of_run(&tree.env, options.log), keep as usize).ok()
        }
        Output::Inherited => None,
    };
    let spawned = prepared
        .as_mut()
        .map_err(|err| Errno::from_raw(err.raw_os_error().unwrap_or(Errno::EINVAL as i32)))
        .and_then(|prepared| {
            prepared.spawn(&tree.env, relay.as_ref().and_then(Relay::for_command))
        });
    let main_pid = match spawned {
        Ok(pid) => {
            if let Some(relay) = &mut relay {
                relay.command_started();
            }
            tree.output = relay;
            pid
        }
        Err(errno) => {
            let _ = tree
                .channel
                .write_all(&Report::SpawnFailed(errno as i32).encode());
            // What --pre-start did is undone all the same.
            tree.run_post_stop();
            return Ok(if errno == Errno::ENOENT { 127 } else { 126 });
        }
    };
    tree.main_pid = Some(main_pid);
    // A failed write means pgleader is gone; the poll loop (`watch_over`) notices and cleans up.
    let _ = tree
        .channel
        .write_all(&Report::Started(main_pid.as_raw()).encode());
    watch_over(&mut tree)
}

/// Watches over the running command until nothing of its tree is left: pgleader's requests
/// and its end, the children's exits, the deadline. Returns the keeper's exit code.
fn watch_over(tree: &mut Tree) -> io::Result<i32> {
    loop {
        // The deadline's timer third, when there is one (no allocation: a waiting keeper's
        // every page of code and heap stays resident).
        let watched = tree.watch.as_ref().map_or(tree.channel.as_fd(), Watch::fd);
        let mut fds = [
            PollFd::new(tree.channel.as_fd(), PollFlags::POLLIN),
            PollFd::new(tree.signalfd.as_fd(), PollFlags::POLLIN),
            PollFd::new(watched, PollFlags::POLLIN),
        ];
        let polled = if tree.watch.is_some() { 3 } else { 2 };
        match poll(&mut fds[..polled], PollTimeout::NONE) {
            Err(Errno::EINTR) => continue,
            Err(err) => {
                // Unable to watch over the job any more: end it rather than orphan it.
                tree.kill_everything();
                return Err(err.into());
            }
            Ok(_) => {}
        }
        let channel_ready = fds[0].any().unwrap_or(true);
        let children_ready = fds[1].any().unwrap_or(false);
        let watch_ready = polled == 3 && fds[2].any().unwrap_or(true);

        if channel_ready {
            let request = read_request(&mut tree.channel);
            let request_is_gone = matches!(request, Request::PgleaderGone);
            match request {
                Request::None => {}
                Request::Stopping => {
                    if let Some(watch) = &mut tree.watch {
                        watch.pgleader_stops();
                    }
                }
                // pgleader asks for the end (its kill timeout ran out), or died without
                // stopping us: nothing of the job may outlive this moment.
                Request::KillEverything | Request::Abort | Request::PgleaderGone => {
                    tree.pgleader_gone |= request_is_gone;
                    tree.kill_everything();
                    tree.end();
                    return Ok(0);
                }
            }
        }
        if watch_ready && let Some(watch) = &mut tree.watch {
            match watch.check(|| stopping_waits(&tree.channel)) {
                Step::Wait => {}
                Step::Stop => {
                    // SIGKILL at once (the kill signal, or a kill timeout of 0): all is gone.
                    if tree.begin_own_stop() {
                        tree.end();
                        return Ok(0);
                    }
                }
                Step::Escalate => {
                    tree.log_escalation();
                    tree.kill_everything();
                    tree.end();
                    return Ok(0);
                }
            }
        }
        if children_ready && tree.reap() == Reaped::NoChildrenLeft && tree.main_done {
            tree.end();
            return Ok(0);
        }
    }
}
