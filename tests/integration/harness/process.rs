//! A pgleader process under test: its output collected line by line, waits on its lines and
//! on its exit with hard timeouts, signals, and a dump of everything it printed when a test
//! fails.

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

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
    exit: Option<ExitStatus>,
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
        let stdout = child.stdout.take().expect("stdout");
        let stderr = child.stderr.take().expect("stderr");
        collect(stdout, Stream::Stdout, output.clone());
        collect(stderr, Stream::Stderr, output.clone());
        let pid = Pid::from_raw(child.id() as i32);
        let waiter = output.clone();
        std::thread::spawn(move || {
            let status = child.wait().expect("wait for the process");
            let mut state = waiter.state.lock().expect("output lock");
            state.exit = Some(status);
            waiter.changed.notify_all();
        });
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

    /// A line the child printed (stdout).
    pub fn wait_stdout(&self, needle: &str) -> String {
        self.wait_for(Stream::Stdout, needle)
    }

    /// A log line (stderr).
    pub fn wait_log(&self, needle: &str) -> String {
        self.wait_for(Stream::Stderr, needle)
    }

    /// Waits for the process to exit; returns its status.
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

fn collect(pipe: impl Read + Send + 'static, stream: Stream, output: Arc<Output>) {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(pipe);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let arrived = Instant::now();
                    let text = String::from_utf8_lossy(&line)
                        .trim_end_matches('\n')
                        .to_owned();
                    let mut state = output.state.lock().expect("output lock");
                    state.lines.push((stream, text, arrived));
                    output.changed.notify_all();
                }
            }
        }
        let mut state = output.state.lock().expect("output lock");
        state.closed += 1;
        output.changed.notify_all();
    });
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

/// Whether a process exists and has not exited (zombies count as gone).
pub fn is_running(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X')),
        Err(_) => false,
    }
}
