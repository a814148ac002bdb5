//! A pgleader process under test: its output collected line by line, waits on its lines and
//! on its exit with hard timeouts, signals, and a dump of everything it printed when a test
//! fails.
//!
//! Its exit counts only once everything it wrote before exiting has been collected, so a test
//! may read its lines right after [`Proc::wait_exit`] and find them all.

use std::fs::File;
use std::io::{ErrorKind, Read};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{FcntlArg, OFlag, fcntl};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::spawner;

/// The hard timeout for anything a test waits for.
pub const WAIT: Duration = Duration::from_secs(20);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

#[derive(Default)]
struct Shared {
    /// Each line with the moment it arrived on the pipe: the benchmarks time faults by it.
    lines: Vec<(Stream, String, Instant)>,
    /// Set only once the lines written before the exit are in `lines`.
    exit: Option<ExitStatus>,
    /// How many of the two pipes have reached their end (a process the command left behind
    /// may hold them open after the exit).
    closed: usize,
}

#[derive(Default)]
struct Output {
    state: Mutex<Shared>,
    changed: Condvar,
}

pub struct Proc {
    pub name: String,
    pub pid: Pid,
    command_line: String,
    output: Arc<Output>,
}

impl Proc {
    /// Starts `command` with stdout and stderr captured.
    pub fn spawn(name: &str, mut command: Command) -> Proc {
        let command_line = format!("{command:?}");
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = spawner::spawn(command, Signal::SIGKILL)
            .unwrap_or_else(|err| panic!("cannot start {command_line}: {err}"));
        let output = Arc::new(Output::default());
        let pid = Pid::from_raw(child.id() as i32);
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1. The pid
        // is our unreaped child's, so it cannot have been reused.
        let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid.as_raw(), 0) } as i32;
        if pidfd < 0 {
            panic!(
                "pidfd_open for {command_line}: {}",
                std::io::Error::last_os_error()
            );
        }
        // SAFETY: pidfd_open returned a new descriptor that nothing else owns.
        let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
        let pipes = [
            Pipe::new(child.stdout.take().expect("stdout"), Stream::Stdout),
            Pipe::new(child.stderr.take().expect("stderr"), Stream::Stderr),
        ];
        let collector = output.clone();
        std::thread::spawn(move || collect(child, pidfd, pipes, &collector));
        Proc {
            name: name.to_owned(),
            pid,
            command_line,
            output,
        }
    }

    /// Waits for a line containing `needle` on `stream`; returns it.
    pub fn wait_for(&self, stream: Stream, needle: &str) -> String {
        self.wait_for_nth(stream, needle, 1)
    }

    /// Waits until `n` lines on `stream` contain `needle`; returns the n-th.
    pub fn wait_for_nth(&self, stream: Stream, needle: &str, n: usize) -> String {
        let found = self.wait_line(stream, needle, n, None, WAIT);
        found.map(|(line, _)| line).unwrap_or_else(|| {
            panic!(
                "{}: no {n}th {stream:?} line containing {needle:?} within {WAIT:?}\n{}",
                self.name,
                self.dump()
            )
        })
    }

    /// Waits up to `timeout` for the `n`-th line on `stream` that contains `needle`, counting
    /// only lines that arrived at or after `since`; returns it with the moment it arrived on
    /// the pipe, or `None` once the timeout has passed (a zero timeout looks once).
    pub fn wait_line(
        &self,
        stream: Stream,
        needle: &str,
        n: usize,
        since: Option<Instant>,
        timeout: Duration,
    ) -> Option<(String, Instant)> {
        self.wait_until(timeout, |state| {
            state
                .lines
                .iter()
                .filter(|(s, line, at)| {
                    *s == stream && line.contains(needle) && since.is_none_or(|since| *at >= since)
                })
                .nth(n - 1)
                .map(|(_, line, at)| (line.clone(), *at))
        })
    }

    /// Waits for a line on `stream` for which `wanted` holds; returns it. `what` says what
    /// such a line shows, for the failure message.
    pub fn wait_line_where(
        &self,
        stream: Stream,
        what: &str,
        wanted: impl Fn(&str) -> bool,
    ) -> String {
        // Lines only ever arrive at the end: each is looked at once, however many there are.
        let mut looked_at = 0;
        let found = self.wait_until(WAIT, |state| {
            let found = state.lines[looked_at..]
                .iter()
                .find(|(s, line, _)| *s == stream && wanted(line))
                .map(|(_, line, _)| line.clone());
            looked_at = state.lines.len();
            found
        });
        found.unwrap_or_else(|| {
            panic!(
                "{}: no {stream:?} line showing {what} within {WAIT:?}\n{}",
                self.name,
                self.dump()
            )
        })
    }

    /// A line the child printed (stdout).
    pub fn wait_stdout(&self, needle: &str) -> String {
        self.wait_for(Stream::Stdout, needle)
    }

    /// A log line (stderr).
    pub fn wait_log(&self, needle: &str) -> String {
        self.wait_for(Stream::Stderr, needle)
    }

    /// Sends SIGTERM, as a service manager stops a service, and asserts that the process exits
    /// 0 (for pgleader: its command stopped and it let go of the lock without an error).
    pub fn terminate_cleanly(&self) {
        self.signal(Signal::SIGTERM);
        assert_eq!(self.wait_code(), 0, "{}", self.dump());
    }

    /// INT, and an exit 0: the commands are stopped at once (a crontab replica's TERM drains,
    /// waiting for its running jobs to end by themselves).
    pub fn interrupt_cleanly(&self) {
        self.signal(Signal::SIGINT);
        assert_eq!(self.wait_code(), 0, "{}", self.dump());
    }

    /// Waits until a leader running a `patient_child` tagged with this process' name loses its
    /// leadership: the command gets TERM and the log says why. Returns that log line.
    pub fn wait_lost_leadership(&self) -> String {
        self.wait_stdout(&format!("{} got TERM", self.name));
        self.wait_log("leadership lost")
    }

    /// Whether a line on `stream` so far contains `needle` (it does not wait: for what must
    /// not have happened).
    pub fn printed(&self, stream: Stream, needle: &str) -> bool {
        self.lines(stream).iter().any(|line| line.contains(needle))
    }

    /// Waits for the process to exit; returns its status. Every line it wrote before it exited
    /// is in [`Proc::lines`] by then.
    pub fn wait_exit(&self) -> ExitStatus {
        self.wait_until(WAIT, |state| state.exit)
            .unwrap_or_else(|| {
                panic!(
                    "{} did not exit within {WAIT:?}\n{}",
                    self.name,
                    self.dump()
                )
            })
    }

    /// The exit code, failing the test if the process died by a signal.
    pub fn wait_code(&self) -> i32 {
        let status = self.wait_exit();
        status
            .code()
            .unwrap_or_else(|| panic!("{} died by a signal: {status}\n{}", self.name, self.dump()))
    }

    /// Waits for the process to exit, asserts that it exited with `code`, and returns its log
    /// (stderr) as one text.
    pub fn log_after_exit(&self, code: i32) -> String {
        let (status, _, stderr) = self.finish();
        assert_eq!(status.code(), Some(code), "{}", self.dump());
        stderr.join("\n")
    }

    /// Whether the process has exited (and what it wrote is collected, as for `wait_exit`).
    pub fn has_exited(&self) -> bool {
        self.output
            .state
            .lock()
            .expect("output lock")
            .exit
            .is_some()
    }

    /// Every line printed so far on `stream`.
    pub fn lines(&self, stream: Stream) -> Vec<String> {
        let state = self.output.state.lock().expect("output lock");
        state
            .lines
            .iter()
            .filter(|(s, _, _)| *s == stream)
            .map(|(_, line, _)| line.clone())
            .collect()
    }

    /// Waits until the process has exited and both pipes are closed; returns all lines.
    pub fn finish(&self) -> (ExitStatus, Vec<String>, Vec<String>) {
        let status = self.wait_exit();
        self.wait_until(WAIT, |state| (state.closed == 2).then_some(()))
            .unwrap_or_else(|| panic!("{}: output not closed\n{}", self.name, self.dump()));
        (
            status,
            self.lines(Stream::Stdout),
            self.lines(Stream::Stderr),
        )
    }

    pub fn signal(&self, signal: Signal) {
        if !self.has_exited() {
            kill(self.pid, signal).unwrap_or_else(|err| panic!("kill {}: {err}", self.name));
        }
    }

    fn wait_until<T>(
        &self,
        timeout: Duration,
        mut found: impl FnMut(&Shared) -> Option<T>,
    ) -> Option<T> {
        let deadline = Instant::now() + timeout;
        let mut state = self.output.state.lock().expect("output lock");
        loop {
            if let Some(value) = found(&state) {
                return Some(value);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            state = self
                .output
                .changed
                .wait_timeout(state, deadline - now)
                .expect("output lock")
                .0;
        }
    }

    /// Everything known about the process, for failure messages.
    pub fn dump(&self) -> String {
        let state = self.output.state.lock().expect("output lock");
        let mut text = format!(
            "--- {} ---\ncommand: {}\nexit: {:?}\n",
            self.name, self.command_line, state.exit
        );
        for (stream, line, _) in &state.lines {
            let tag = match stream {
                Stream::Stdout => "out",
                Stream::Stderr => "err",
            };
            text.push_str(&format!("  {tag}| {line}\n"));
        }
        text
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.dump());
        }
        if !self.has_exited() {
            let _ = kill(self.pid, Signal::SIGKILL);
            let _ = self.wait_until(WAIT, |state| state.exit);
        }
    }
}

/// One output pipe of the process, read without blocking.
struct Pipe {
    file: File,
    stream: Stream,
    /// The start of a line whose end has not arrived yet.
    partial: Vec<u8>,
    open: bool,
}

impl Pipe {
    fn new(pipe: impl Into<OwnedFd>, stream: Stream) -> Pipe {
        let fd: OwnedFd = pipe.into();
        let flags = fcntl(&fd, FcntlArg::F_GETFL).expect("pipe flags");
        fcntl(
            &fd,
            FcntlArg::F_SETFL(OFlag::from_bits_truncate(flags) | OFlag::O_NONBLOCK),
        )
        .expect("a non-blocking pipe");
        Pipe {
            file: File::from(fd),
            stream,
            partial: Vec::new(),
            open: true,
        }
    }

    /// One read: the complete lines it finishes go to `output` (at the end of the pipe, the
    /// last line too, newline or not). Returns how many bytes it took, or `None` if the pipe
    /// was empty.
    fn read_once(&mut self, output: &Output) -> Option<usize> {
        let mut buffer = [0; 8192];
        match self.file.read(&mut buffer) {
            Ok(0) => {
                self.close(output);
                Some(0)
            }
            Ok(read) => {
                let arrived = Instant::now();
                self.partial.extend_from_slice(&buffer[..read]);
                let mut state = output.state.lock().expect("output lock");
                while let Some(end) = self.partial.iter().position(|&byte| byte == b'\n') {
                    let line: Vec<u8> = self.partial.drain(..=end).collect();
                    state.lines.push((self.stream, text_of(&line), arrived));
                }
                output.changed.notify_all();
                Some(read)
            }
            Err(err) if err.kind() == ErrorKind::Interrupted => Some(0),
            Err(err) if err.kind() == ErrorKind::WouldBlock => None,
            Err(_) => {
                self.close(output);
                Some(0)
            }
        }
    }

    /// Takes what the pipe holds now, and no more: a writer that goes on cannot keep this
    /// going.
    fn drain(&mut self, output: &Output) {
        let mut pending: libc::c_int = 0;
        // SAFETY: FIONREAD stores one int through the pointer, which points to one.
        if unsafe { libc::ioctl(self.file.as_raw_fd(), libc::FIONREAD, &mut pending) } < 0 {
            panic!("FIONREAD: {}", std::io::Error::last_os_error());
        }
        let mut left = usize::try_from(pending).unwrap_or(0);
        while self.open && left > 0 {
            match self.read_once(output) {
                Some(read) => left = left.saturating_sub(read),
                None => break,
            }
        }
    }

    fn close(&mut self, output: &Output) {
        let rest = std::mem::take(&mut self.partial);
        let mut state = output.state.lock().expect("output lock");
        if !rest.is_empty() {
            state
                .lines
                .push((self.stream, text_of(&rest), Instant::now()));
        }
        state.closed += 1;
        output.changed.notify_all();
        self.open = false;
    }
}

fn text_of(line: &[u8]) -> String {
    String::from_utf8_lossy(line)
        .trim_end_matches('\n')
        .to_owned()
}

/// Collects the process's output line by line until both pipes are closed, and records its
/// exit.
///
/// The exit is recorded only once the pipes hold nothing more: whatever the process wrote
/// before it exited was in a pipe by then, so a test that reads the output after
/// [`Proc::wait_exit`] sees all of it. (Reading until the pipes close would not do: a process
/// the command left behind may hold them open for much longer.)
fn collect(mut child: Child, pidfd: OwnedFd, mut pipes: [Pipe; 2], output: &Output) {
    let mut running = true;
    loop {
        let mut fds: Vec<PollFd> = pipes
            .iter()
            .filter(|pipe| pipe.open)
            .map(|pipe| PollFd::new(pipe.file.as_fd(), PollFlags::POLLIN))
            .collect();
        if running {
            fds.push(PollFd::new(pidfd.as_fd(), PollFlags::POLLIN));
        }
        if fds.is_empty() {
            return;
        }
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(err) => panic!("poll the output: {err}"),
        }
        let ready = |fd: &PollFd| fd.revents().is_some_and(|events| !events.is_empty());
        let exited = running && fds.last().is_some_and(ready);
        let readable: Vec<bool> = {
            let mut polled = fds.iter();
            pipes
                .iter()
                .map(|pipe| pipe.open && polled.next().is_some_and(ready))
                .collect()
        };
        drop(fds);
        for (pipe, readable) in pipes.iter_mut().zip(readable) {
            if readable {
                pipe.read_once(output);
            }
        }
        if exited {
            running = false;
            for pipe in &mut pipes {
                pipe.drain(output);
            }
            let status = child.wait().expect("wait for the process");
            let mut state = output.state.lock().expect("output lock");
            state.exit = Some(status);
            output.changed.notify_all();
        }
    }
}

/// Waits until a process that is not our child has exited (a pidfd becomes readable when it
/// does), with the hard timeout. True if it is gone.
pub fn wait_gone(pid: i32, timeout: Duration) -> bool {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as i32;
    if fd < 0 {
        return std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
    }
    let mut pollfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd; the descriptor is ours and closed right after.
    let ready = unsafe { libc::poll(&mut pollfd, 1, timeout.as_millis() as i32) };
    // SAFETY: fd is a descriptor we opened above.
    unsafe { libc::close(fd) };
    ready == 1
}

/// The living keepers (`pgleader-keeper`, see `src/supervise/keeper/`) whose parent is `pid`.
pub fn keepers_of(pid: i32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
        .filter(|child| {
            let parent = std::fs::read_to_string(format!("/proc/{child}/stat"))
                .ok()
                .and_then(|stat| {
                    let (_, rest) = stat.rsplit_once(") ")?;
                    rest.split_whitespace().nth(1)?.parse::<i32>().ok()
                });
            let argv0 = std::fs::read(format!("/proc/{child}/cmdline")).unwrap_or_default();
            parent == Some(pid)
                && argv0.split(|b| *b == 0).next() == Some(b"pgleader-keeper".as_slice())
                && is_running(*child)
        })
        .collect()
}

/// Whether a process exists and has not exited (zombies count as gone).
pub fn is_running(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X')),
        Err(_) => false,
    }
}

/// Calls `probe` every `every` until it answers, and returns the answer; fails the test with
/// `failure()` if [`WAIT`] passes first.
pub fn poll_until<T>(
    every: Duration,
    failure: impl Fn() -> String,
    mut probe: impl FnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(answer) = probe() {
            return answer;
        }
        assert!(Instant::now() < deadline, "{}", failure());
        std::thread::sleep(every);
    }
}

/// Asserts that the log `stderr` of a refused `url` says each of `expected`, and that the
/// error was taken as permanent: reported, not retried.
pub fn assert_permanent_error(url: &str, stderr: &str, expected: &[&str]) {
    for words in expected {
        assert!(
            stderr.contains(words),
            "{url}: expected {words:?} in:\n{stderr}"
        );
    }
    assert!(
        !stderr.contains("retrying"),
        "{url}: a permanent error was retried:\n{stderr}"
    );
}

/// Kills process `pid` -9 from outside pgleader (its command, its keeper, a server process),
/// as an operator or the OOM killer would.
pub fn kill_9(pid: i32) {
    kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap_or_else(|err| panic!("kill -9 {pid}: {err}"));
}

/// The pid after `key=` in a line (`backend=`, `backend_pid=`, `keeper=`, `pid=`).
pub fn pid_field(line: &str, key: &str) -> i32 {
    let value = super::field(line, key);
    value
        .parse()
        .unwrap_or_else(|err| panic!("{key}={value:?} in {line:?} is not a pid: {err}"))
}
