//! A crontab job's output as log lines (`pgleader cron` without `--passthrough-logs`): each
//! line the command writes on stdout or stderr becomes one line of pgleader's log, in its
//! format (text or JSON), naming the job, the stream, the occurrence and the replica, as
//! supercronic does. Twenty jobs' lines in one `docker logs` then say whose they are.
//!
//! The keeper reads the command's pipes, not pgleader: the keeper outlives a pgleader killed
//! -9 or frozen, so a run's last lines still reach the log once its tree is killed (a pipe is
//! read to its end, which comes when the last process holding it is gone). Reading and writing
//! happen on a thread of their own: a log nobody reads blocks that thread, and then the
//! command once its pipe is full (as a terminal nobody reads would), but never the keeper's
//! watch over the deadline and the tree. Each job has its own keeper and thread, so a job that
//! writes a lot slows no other.
//!
//! Each log line goes out in one `write` of at most [`PIPE_BUF`] bytes, which a pipe writes
//! whole: the lines of jobs whose keepers share pgleader's stderr never mix. A line too long for
//! that is split into parts marked `part=1`, `part=2`, ...; bytes that are not UTF-8 are
//! written `\xNN`, and so are control characters other than the tab in the text format (JSON
//! escapes them its own way).
//!
//! The relay also keeps the last lines of the run (`--keep-output` bytes, [`Tail`]), which the
//! keeper reports to pgleader once the tree is gone, for the run's ledger row: what a run
//! printed can be read after the fact with `pgleader status --job`.

use std::collections::VecDeque;
use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::unistd::pipe2;

use crate::cli::LogFormat;

/// The most bytes a write to a pipe puts in whole, never interleaved with another writer's
/// (PIPE_BUF, 4096 on Linux): the longest log line written.
pub const PIPE_BUF: usize = 4096;

/// How long the keeper, its tree gone, waits for a log that takes nothing more before it
/// exits without the output still unwritten.
const STALLED: Duration = Duration::from_secs(5);

/// What each log line of a run says besides the text.
pub struct Tag {
    pub format: LogFormat,
    pub job: String,
    /// `PGLEADER_SCHEDULED_TIME`, if the run has one.
    pub occurrence: Option<String>,
    /// `<pid>@<host>`, pgleader's, as in its session names.
    pub replica: String,
}

impl Tag {
    /// What the log lines of a run's output say besides its text: the job and the occurrence
    /// (from the environment pgleader gave it, `env`), in `format`, and the replica,
    /// pgleader's pid (the keeper's parent) and host.
    pub fn of_run(
        env: &[(std::ffi::OsString, std::ffi::OsString)],
        format: Option<LogFormat>,
    ) -> Tag {
        let var = |name: &str| {
            env.iter()
                .find(|(key, _)| key == name)
                .map(|(_, value)| value.to_string_lossy().into_owned())
        };
        Tag {
            format: format.unwrap_or(LogFormat::Text),
            job: var("PGLEADER_JOB").unwrap_or_default(),
            occurrence: var("PGLEADER_SCHEDULED_TIME"),
            replica: format!(
                "{}@{}",
                nix::unistd::getppid(),
                crate::election::participant::host_name()
            ),
        }
    }
}

/// The thread that turns the command's output into log lines, and the pipes' write ends until
/// the command has its own copies.
pub struct Relay {
    writers: Option<[OwnedFd; 2]>,
    done: mpsc::Receiver<()>,
    /// Bytes read or written so far, for [`Relay::finish`] to tell a slow log from one nobody
    /// reads.
    progress: Arc<AtomicU64>,
    /// The run's last lines, as far as they were read.
    tail: Arc<Mutex<Tail>>,
}

/// The last bytes of a run's lines, both streams in the order their lines ended, for the
/// run's ledger row: at most `keep` bytes, from the first whole line once older ones were
/// dropped (unless a single line fills them all).
#[derive(Debug, Default)]
pub struct Tail {
    keep: usize,
    bytes: VecDeque<u8>,
    cut: bool,
}

impl Tail {
    pub fn new(keep: usize) -> Tail {
        Tail {
            keep,
            ..Tail::default()
        }
    }

    /// Keeps `text`, a line or a part of one (`ends`: the line ends with it).
    fn push(&mut self, text: &[u8], ends: bool) {
        if self.keep == 0 {
            return;
        }
        let from = text.len().saturating_sub(self.keep);
        self.bytes.extend(&text[from..]);
        if ends {
            self.bytes.push_back(b'\n');
        }
        let over = self.bytes.len().saturating_sub(self.keep);
        if from > 0 {
            // The line alone fills what is kept: it begins in its middle.
            self.cut = true;
        } else if over > 0 {
            // Cut mid-line, unless what went ended with a line.
            self.cut = self.bytes[over - 1] != b'\n';
        }
        if over > 0 {
            self.bytes.drain(..over);
        }
    }

    /// What is kept, from its first whole line.
    pub fn take(&mut self) -> Vec<u8> {
        let mut bytes: Vec<u8> = self.bytes.drain(..).collect();
        if std::mem::take(&mut self.cut)
            && let Some(end) = bytes.iter().position(|b| *b == b'\n')
            && end + 1 < bytes.len()
        {
            bytes.drain(..=end);
        }
        bytes
    }
}

impl Relay {
    /// Makes the command's pipes and starts reading them on a thread of its own.
    /// Keeps the last `keep` bytes of the run's lines ([`Relay::finish`] returns them).
    pub fn start(tag: Tag, keep: usize) -> io::Result<Relay> {
        let (out_read, out_write) = pipe2(OFlag::O_CLOEXEC)?;
        let (err_read, err_write) = pipe2(OFlag::O_CLOEXEC)?;
        let progress = Arc::new(AtomicU64::new(0));
        let tail = Arc::new(Mutex::new(Tail::new(keep)));
        let (finished, done) = mpsc::channel();
        let (counted, kept) = (Arc::clone(&progress), Arc::clone(&tail));
        std::thread::Builder::new()
            .name("output".into())
            .stack_size(64 * 1024)
            .spawn(move || {
                relay([out_read, err_read], &tag, &counted, &kept);
                let _ = finished.send(());
            })?;
        Ok(Relay {
            writers: Some([out_write, err_write]),
            done,
            progress,
            tail,
        })
    }

    /// The descriptors the command gets as its stdout and stderr.
    pub fn for_command(&self) -> Option<[RawFd; 2]> {
        self.writers
            .as_ref()
            .map(|[out, err]| [out.as_raw_fd(), err.as_raw_fd()])
    }

    /// The command has its copies: the keeper lets go of its own, so that the pipes end with
    /// the last process of the tree.
    pub fn command_started(&mut self) {
        self.writers = None;
    }

    /// Waits for every line to be written, the tree being gone; gives up once the log has
    /// taken nothing for [`STALLED`] (nobody reads it, or something outside the tree holds a
    /// pipe open). Returns the run's last lines, as far as they were read.
    pub fn finish(mut self) -> Vec<u8> {
        let mut watch = self.finishing();
        loop {
            match self.done.recv_timeout(Duration::from_millis(100)) {
                Ok(()) | Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {}
            }
            if watch.stalled(&self) {
                break;
            }
        }
        self.take_tail()
    }

    /// Begins the end of the relay, the tree being gone, for [`Relay::try_finish`] to follow:
    /// for a keeper that keeps other runs meanwhile.
    pub fn finishing(&mut self) -> Finishing {
        self.writers = None;
        Finishing {
            seen: self.progress.load(Ordering::Relaxed),
            since: Instant::now(),
        }
    }

    /// The run's last lines once every line is written, or the log has taken nothing for
    /// [`STALLED`] since `finishing` began; `None` while lines are still being written.
    pub fn try_finish(&mut self, finishing: &mut Finishing) -> Option<Vec<u8>> {
        let done = matches!(
            self.done.try_recv(),
            Ok(()) | Err(mpsc::TryRecvError::Disconnected)
        );
        (done || finishing.stalled(self)).then(|| self.take_tail())
    }

    fn take_tail(&self) -> Vec<u8> {
        let mut tail = self
            .tail
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        tail.take()
    }
}

/// A relay's end under way ([`Relay::finishing`]): the progress last seen, and since when.
#[derive(Debug)]
pub struct Finishing {
    seen: u64,
    since: Instant,
}

impl Finishing {
    /// Whether the log has taken nothing for [`STALLED`].
    fn stalled(&mut self, relay: &Relay) -> bool {
        let now = relay.progress.load(Ordering::Relaxed);
        if now != self.seen {
            (self.seen, self.since) = (now, Instant::now());
        }
        self.since.elapsed() >= STALLED
    }
}

/// The relay's thread: reads both pipes to their end, writing each line as it is complete.
fn relay(pipes: [OwnedFd; 2], tag: &Tag, progress: &AtomicU64, tail: &Mutex<Tail>) {
    let mut streams = [Stream::new("stdout"), Stream::new("stderr")];
    let mut open = [true, true];
    let mut chunk = vec![0u8; 16 * 1024];
    let mut log = Log {
        tag,
        progress,
        tail: Some(tail),
    };
    while open.iter().any(|open| *open) {
        let which: Vec<usize> = (0..2).filter(|i| open[*i]).collect();
        let mut fds: Vec<PollFd> = which
            .iter()
            .map(|i| PollFd::new(pipes[*i].as_fd(), PollFlags::POLLIN))
            .collect();
        match poll(&mut fds, PollTimeout::NONE) {
            Err(Errno::EINTR) => continue,
            Err(_) => return,
            Ok(_) => {}
        }
        let ready: Vec<usize> = which
            .iter()
            .zip(&fds)
            .filter(|(_, fd)| fd.any().unwrap_or(true))
            .map(|(i, _)| *i)
            .collect();
        for i in ready {
            match nix::unistd::read(&pipes[i], &mut chunk) {
                Ok(0) => {
                    streams[i].end(&mut log);
                    open[i] = false;
                }
                Ok(read) => {
                    progress.fetch_add(read as u64, Ordering::Relaxed);
                    streams[i].take(&chunk[..read], &mut log);
                }
                Err(Errno::EINTR | Errno::EAGAIN) => {}
                Err(_) => {
                    streams[i].end(&mut log);
                    open[i] = false;
                }
            }
        }
    }
}

/// One of the command's streams: what it wrote of a line not yet ended.
struct Stream {
    name: &'static str,
    pending: Vec<u8>,
    /// The last part written of a line too long for one log line; 0 if none.
    part: u32,
}

impl Stream {
    fn new(name: &'static str) -> Self {
        Stream {
            name,
            pending: Vec::new(),
            part: 0,
        }
    }

    /// Takes what the command wrote: each line it ends goes out, and of a line longer than a log
    /// line holds, its whole characters so far.
    fn take(&mut self, bytes: &[u8], log: &mut Log) {
        self.pending.extend_from_slice(bytes);
        let mut start = 0;
        while let Some(at) = self.pending[start..].iter().position(|b| *b == b'\n') {
            let line = &self.pending[start..start + at];
            log.line(self.name, line, &mut self.part, true);
            start += at + 1;
        }
        self.pending.drain(..start);
        if self.pending.len() >= PIPE_BUF {
            let whole = self.pending.len() - incomplete_tail(&self.pending);
            log.line(self.name, &self.pending[..whole], &mut self.part, false);
            self.pending.drain(..whole);
        }
    }

    /// The stream ended: a last line without its newline goes out all the same.
    fn end(&mut self, log: &mut Log) {
        if !self.pending.is_empty() || self.part > 0 {
            log.line(self.name, &self.pending, &mut self.part, true);
            self.pending.clear();
        }
    }
}

/// How many bytes at the end of `bytes` begin a UTF-8 character not yet complete (0 to 3).
fn incomplete_tail(bytes: &[u8]) -> usize {
    match std::str::from_utf8(&bytes[bytes.len().saturating_sub(3)..]) {
        Err(err) if err.error_len().is_none() => bytes.len().min(3) - err.valid_up_to(),
        _ => 0,
    }
}

/// Where the lines go: pgleader's stderr, as its own log lines.
struct Log<'a> {
    tag: &'a Tag,
    progress: &'a AtomicU64,
    /// Where the run's last lines are kept.
    tail: Option<&'a Mutex<Tail>>,
}

impl Log<'_> {
    /// Writes `text`, a line of `stream` or a part of one: whole in one log line if it fits and
    /// is not a part already, else in parts numbered on from `part`. `ends` says whether the
    /// line ends with `text` (then `part` goes back to 0).
    fn line(&mut self, stream: &str, text: &[u8], part: &mut u32, ends: bool) {
        if let Some(tail) = self.tail {
            let mut tail = tail.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            tail.push(text, ends);
        }
        let units = units(text, self.tag.format);
        let time = crate::time::rfc3339_millis(jiff::Timestamp::now());
        if *part == 0 && ends {
            let (head, tail) = self.frame(&time, stream, None);
            let len: usize = units.iter().map(String::len).sum();
            if head.len() + len + tail.len() <= PIPE_BUF {
                self.write(&head, &units, &tail);
                return;
            }
        }
        let mut rest = &units[..];
        // A part ends where the line does, or once it is full, never with nothing.
        while !rest.is_empty() || (ends && *part == 0) {
            *part += 1;
            let (head, tail) = self.frame(&time, stream, Some(*part));
            let room = PIPE_BUF.saturating_sub(head.len() + tail.len());
            let mut len = 0;
            let taken = rest
                .iter()
                .take_while(|unit| {
                    len += unit.len();
                    len <= room
                })
                .count()
                .max(1)
                .min(rest.len());
            self.write(&head, &rest[..taken], &tail);
            rest = &rest[taken..];
        }
        if ends {
            *part = 0;
        }
    }

    /// What goes before the text and after it, in the log's format.
    fn frame(&self, time: &str, stream: &str, part: Option<u32>) -> (String, String) {
        let tag = self.tag;
        match tag.format {
            LogFormat::Text => {
                let field = |name: &str, value: &str| {
                    if crate::operate::logging::needs_quotes(value) {
                        format!(" {name}={value:?}")
                    } else {
                        format!(" {name}={value}")
                    }
                };
                let mut tail = field("job", &tag.job);
                tail.push_str(&field("stream", stream));
                if let Some(occurrence) = &tag.occurrence {
                    tail.push_str(&field("occurrence", occurrence));
                }
                tail.push_str(&field("replica", &tag.replica));
                if let Some(part) = part {
                    tail.push_str(&format!(" part={part}"));
                }
                tail.push('\n');
                (format!("{time} INFO  "), tail)
            }
            LogFormat::Json => {
                let string = |value: &str| serde_json::Value::from(value).to_string();
                let head = format!(
                    "{{\"time\":{},\"level\":\"info\",\"event\":\"output\",\"message\":\"",
                    string(time)
                );
                let mut tail = format!(
                    "\",\"job\":{},\"stream\":{}",
                    string(&tag.job),
                    string(stream)
                );
                if let Some(occurrence) = &tag.occurrence {
                    tail.push_str(&format!(",\"occurrence\":{}", string(occurrence)));
                }
                tail.push_str(&format!(",\"replica\":{}", string(&tag.replica)));
                if let Some(part) = part {
                    tail.push_str(&format!(",\"part\":{part}"));
                }
                tail.push_str("}\n");
                (head, tail)
            }
        }
    }

    /// One log line, in one write (a blocked log blocks here, and only here).
    fn write(&mut self, head: &str, units: &[String], tail: &str) {
        let mut record = String::with_capacity(PIPE_BUF);
        record.push_str(head);
        units.iter().for_each(|unit| record.push_str(unit));
        record.push_str(tail);
        let mut bytes = record.as_bytes();
        while !bytes.is_empty() {
            match io::stderr().write(bytes) {
                Ok(0) => return,
                Ok(written) => {
                    bytes = &bytes[written..];
                    self.progress.fetch_add(written as u64, Ordering::Relaxed);
                }
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                // A stderr someone made non-blocking: wait until it takes more.
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                    let stderr = io::stderr();
                    let mut fds = [PollFd::new(stderr.as_fd(), PollFlags::POLLOUT)];
                    let _ = poll(&mut fds, PollTimeout::NONE);
                }
                // Nobody reads the log any more: the lines have nowhere to go.
                Err(_) => return,
            }
        }
    }
}

/// `text` as the pieces a log line may be cut between, each as it is written in `format`:
/// a character, or `\xNN` for a byte that is not UTF-8 (and for a control character in text).
fn units(text: &[u8], format: LogFormat) -> Vec<String> {
    let mut units = Vec::with_capacity(text.len());
    for chunk in text.utf8_chunks() {
        for c in chunk.valid().chars() {
            units.push(match format {
                LogFormat::Text if c.is_control() && c != '\t' => hex(c as u32),
                LogFormat::Text => c.to_string(),
                LogFormat::Json => json_escaped(c),
            });
        }
        for byte in chunk.invalid() {
            let escaped = hex(u32::from(*byte));
            units.push(match format {
                LogFormat::Text => escaped,
                LogFormat::Json => escaped.replace('\\', "\\\\"),
            });
        }
    }
    units
}

/// A run's last lines as text for its ledger row: each line escaped as in the text log
/// ([`units`]: bytes that are not UTF-8, and control characters other than the tab, written
/// `\xNN`), the newlines between them kept.
pub fn tail_text(tail: &[u8]) -> String {
    let lines: Vec<String> = tail
        .split(|byte| *byte == b'\n')
        .map(|line| units(line, LogFormat::Text).concat())
        .collect();
    lines.join("\n")
}

/// `\xNN`.
fn hex(value: u32) -> String {
    format!("\\x{value:02x}")
}

/// A character as it is written inside a JSON string.
fn json_escaped(c: char) -> String {
    match c {
        '"' => "\\\"".into(),
        '\\' => "\\\\".into(),
        '\n' => "\\n".into(),
        '\r' => "\\r".into(),
        '\t' => "\\t".into(),
        c if (c as u32) < 0x20 => format!("\\u{:04x}", c as u32),
        c => c.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(format: LogFormat) -> Tag {
        Tag {
            format,
            job: "nightly backup".into(),
            occurrence: Some("2026-11-28T03:00:00Z".into()),
            replica: "42@host".into(),
        }
    }

    #[test]
    fn a_character_cut_at_the_end_waits_for_its_last_bytes() {
        let euro = "€".as_bytes();
        assert_eq!(incomplete_tail(b"abc"), 0);
        assert_eq!(incomplete_tail(&euro[..1]), 1);
        assert_eq!(incomplete_tail(&[b'a', euro[0], euro[1]]), 2);
        assert_eq!(incomplete_tail(euro), 0);
        // A byte that can never begin a character is not waited for.
        assert_eq!(incomplete_tail(b"a\xff"), 0);
    }

    #[test]
    fn bytes_that_are_not_utf8_and_control_characters_are_escaped_not_lost() {
        let text: String = units(b"a\xffb\x1b[0m\tc\"", LogFormat::Text).concat();
        assert_eq!(text, "a\\xffb\\x1b[0m\tc\"");
        let json: String = units(b"a\xffb\x1b\"\\", LogFormat::Json).concat();
        let parsed: String =
            serde_json::from_str(&format!("\"{json}\"")).expect("a valid JSON string");
        assert_eq!(parsed, "a\\xffb\u{1b}\"\\");
    }

    #[test]
    fn a_tail_as_text_escapes_what_is_not_text_and_keeps_its_lines() {
        assert_eq!(tail_text(b"a\xff\0b\tc\nd\x1b"), "a\\xff\\x00b\tc\nd\\x1b");
    }

    #[test]
    fn the_tail_keeps_the_last_whole_lines_that_fit() {
        let mut tail = Tail::new(10);
        tail.push(b"first", true);
        tail.push(b"second", true);
        tail.push(b"thi", false);
        tail.push(b"rd", true);
        // "first" went for lack of room, and what was left of "second" with it.
        assert_eq!(tail.take(), b"third\n");
        // Cut where a line ends: the next line is whole, and kept.
        tail.push(b"abcd", true);
        tail.push(b"efgh", true);
        tail.push(b"ijkl", true);
        assert_eq!(tail.take(), b"efgh\nijkl\n");
        tail.push(b"a line longer than what is kept", true);
        assert_eq!(tail.take(), b"t is kept\n");
        let mut none = Tail::new(0);
        none.push(b"x", true);
        assert!(none.take().is_empty());
        let mut whole = Tail::new(64);
        whole.push(b"one", true);
        whole.push(b"two", false);
        assert_eq!(whole.take(), b"one\ntwo");
    }

    #[test]
    fn frames_name_the_job_the_stream_the_occurrence_and_the_replica() {
        let log = Log {
            tag: &tag(LogFormat::Text),
            progress: &AtomicU64::new(0),
            tail: None,
        };
        let (head, tail) = log.frame("T", "stderr", Some(2));
        assert_eq!(head, "T INFO  ");
        assert_eq!(
            tail,
            " job=\"nightly backup\" stream=stderr occurrence=2026-11-28T03:00:00Z replica=42@host part=2\n"
        );
        let log = Log {
            tag: &tag(LogFormat::Json),
            progress: &AtomicU64::new(0),
            tail: None,
        };
        let (head, tail) = log.frame("T", "stdout", None);
        let line = format!("{head}hello{tail}");
        let value: serde_json::Value = serde_json::from_str(&line).expect("one JSON object");
        assert_eq!(value["message"], "hello");
        assert_eq!(value["event"], "output");
        assert_eq!(value["job"], "nightly backup");
        assert_eq!(value["stream"], "stdout");
        assert_eq!(value["occurrence"], "2026-11-28T03:00:00Z");
        assert_eq!(value["replica"], "42@host");
        assert!(value.get("part").is_none());
    }
}
