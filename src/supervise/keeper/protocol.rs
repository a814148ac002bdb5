//! What pgleader and the keeper say to each other, the one format both processes speak: the
//! keeper's arguments, the start message, the request bytes pgleader sends and the reports the
//! keeper sends back. Each format's writer sits beside its reader, and a test reads back what
//! the other side writes.
//!
//! pgleader writes the arguments and the start message (`handle.rs`) and reads the reports;
//! the keeper reads the first two (`process.rs`, `channel.rs`) and writes the reports. So this
//! file stays low: it uses nothing of either side's machinery.

use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;

use crate::cli::LogFormat;
use crate::election::socket::{Farewell, Lent};
use crate::operate::logging;
use crate::supervise::hook::Hooks;

pub mod session;

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

/// The tag of the report of the end of a run's output, sent before `Done` when the keeper keeps
/// it: then a little-endian 32-bit length and that many bytes, the run's last lines.
pub const OUTPUT: u8 = b'O';

/// The report of a run's last lines `tail` ([`OUTPUT`]).
pub fn output_report(tail: &[u8]) -> Vec<u8> {
    let mut report = Vec::with_capacity(5 + tail.len());
    report.push(OUTPUT);
    report.extend_from_slice(&(tail.len() as u32).to_le_bytes());
    report.extend_from_slice(tail);
    report
}

/// Where the command's stdout and stderr go.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Output {
    /// To pgleader's own stdout and stderr, as they are (`pgleader run`, and `pgleader cron
    /// --passthrough-logs`).
    #[default]
    Inherited,
    /// Each line a log line of pgleader's, naming the job, the stream, the occurrence and the
    /// replica (`pgleader cron`; see `output.rs`); the last `keep` bytes of the run's lines are
    /// reported before `Done` ([`OUTPUT`]), for the ledger (`--keep-output`).
    Tagged { keep: u32 },
}

/// Whether this process was started as a keeper.
pub fn is_keeper_invocation() -> bool {
    std::env::args_os().next().is_some_and(|arg0| arg0 == ARGV0)
}

/// The arguments pgleader passes: the channel's descriptor; `KEY=VALUE` options (the hooks,
/// pgleader's log format and verbosity, where the output goes) up to `--`; the program to
/// execute, the command's `argv[0]` and its arguments.
pub fn keeper_args(
    fd: RawFd,
    hooks: &Hooks,
    output: Output,
    program: &OsString,
    argv: &[OsString],
) -> Vec<OsString> {
    let mut args = vec![OsString::from(fd.to_string())];
    args.extend(hooks.to_args());
    args.extend(log_args());
    if let Output::Tagged { keep } = output {
        args.push(OsString::from(TAGGED));
        if keep > 0 {
            args.push(OsString::from(format!("{KEEP}{keep}")));
        }
    }
    args.push(OsString::from(END_OF_OPTIONS));
    args.push(program.clone());
    args.extend(argv.iter().cloned());
    args
}

/// The arguments of a membership's keeper: the channel's descriptor, [`MEMBERSHIP`] and how to
/// log, no command (see `membership.rs`).
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
const TAGGED: &str = "output=tagged";
const KEEP: &str = "keep=";
const END_OF_OPTIONS: &str = "--";

/// The keeper's options: the hooks, how to log (as pgleader does) and where the command's
/// output goes.
#[derive(Default)]
pub(super) struct Options {
    pub(super) hooks: Hooks,
    pub(super) log: Option<LogFormat>,
    pub(super) verbosity: i8,
    pub(super) output: Output,
    /// A membership's keeper: no command, see `membership.rs`.
    pub(super) membership: bool,
    /// A session's keeper: no command on its line, see `session.rs`.
    pub(super) session: bool,
}

impl Options {
    /// Reads the options up to `--`.
    pub(super) fn read(args: &mut impl Iterator<Item = OsString>) -> io::Result<Options> {
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
            } else if word == session::SESSION {
                options.session = true;
            } else if word == TAGGED {
                options.output = Output::Tagged { keep: 0 };
            } else if let Some(keep) = word.strip_prefix(KEEP) {
                options.output = Output::Tagged {
                    keep: keep.parse().unwrap_or(0),
                };
            } else if !options.hooks.read_arg(&word) {
                return Err(io::Error::other(format!("unknown option {word:?}")));
            }
        }
        Err(io::Error::other("missing program"))
    }
}

/// The tag of the message that starts the command: then a little-endian 32-bit length and
/// that many bytes: the length of the environment (32 bits), its `KEY=VALUE\0` entries, the
/// length of the deadline's terms (32 bits, 0 for none) and the terms ([`watchdog::encode`](crate::supervise::watchdog::encode)),
/// and the farewells of the sockets to hold ([`encode_farewells`]); the sockets travel with it
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
    let farewells = encode_farewells(hold);
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
pub(super) fn parse_body(body: &[u8]) -> io::Result<(Env, Vec<u8>, Vec<Option<Farewell>>)> {
    let bad = || io::Error::other("a start message that does not parse");
    let mut rest = body;
    let env = take_part(&mut rest).ok_or_else(bad)?;
    let watch = take_part(&mut rest).ok_or_else(bad)?.to_vec();
    let farewells = decode_farewells(rest).ok_or_else(bad)?;
    Ok((parse_env(env), watch, farewells))
}

/// The part `rest` begins with (a little-endian 32-bit length and that many bytes), `rest`
/// moved past it; `None` if it does not hold a whole one.
pub(super) fn take_part<'a>(rest: &mut &'a [u8]) -> Option<&'a [u8]> {
    let len = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
    let part = rest.get(4..4 + len)?;
    *rest = &rest[4 + len..];
    Some(part)
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

/// The farewells of a start message, in the order of its sockets: for each, the command's
/// length (little-endian 32 bits, 0 for none), the command, the marker's length, the marker.
pub fn encode_farewells(lent: &[Lent]) -> Vec<u8> {
    let mut out = Vec::new();
    for lent in lent {
        let (command, marker) = match &lent.farewell {
            Some(farewell) => (&farewell.command[..], &farewell.marker[..]),
            None => (&[][..], &[][..]),
        };
        for part in [command, marker] {
            out.extend_from_slice(&(part.len() as u32).to_le_bytes());
            out.extend_from_slice(part);
        }
    }
    out
}

/// The farewells [`encode_farewells`] wrote; `None` if the bytes are not such a list.
pub fn decode_farewells(mut bytes: &[u8]) -> Option<Vec<Option<Farewell>>> {
    let mut farewells = Vec::new();
    while !bytes.is_empty() {
        let command = take_part(&mut bytes)?.to_vec();
        let marker = take_part(&mut bytes)?.to_vec();
        farewells.push(
            (!command.is_empty() && !marker.is_empty()).then_some(Farewell { command, marker }),
        );
    }
    Some(farewells)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A socket lent with a farewell.
    fn with_farewell(fd: RawFd, command: &[u8], marker: &[u8]) -> Lent {
        let (command, marker) = (command.to_vec(), marker.to_vec());
        let farewell = Some(Farewell { command, marker });
        Lent { fd, farewell }
    }

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

    #[test]
    fn the_output_options_survive_a_round_trip() {
        for output in [
            Output::Inherited,
            Output::Tagged { keep: 0 },
            Output::Tagged { keep: 4096 },
        ] {
            let args = keeper_args(3, &Hooks::default(), output, &"sh".into(), &["sh".into()]);
            let mut rest = args.into_iter().skip(1);
            let options = Options::read(&mut rest).expect("options");
            assert_eq!(options.output, output);
        }
        let report = output_report(b"last\n");
        assert_eq!(report[0], OUTPUT);
        assert_eq!(
            u32::from_le_bytes([report[1], report[2], report[3], report[4]]),
            5
        );
        assert_eq!(&report[5..], b"last\n");
    }

    #[test]
    fn farewells_survive_a_round_trip() {
        let lent = [
            with_farewell(3, b"*1\r\n$4\r\nPING\r\n", b"m1"),
            Lent::hold(4),
            with_farewell(5, b"x", b"m2"),
        ];
        let expected: Vec<Option<Farewell>> = lent.iter().map(|l| l.farewell.clone()).collect();
        assert_eq!(decode_farewells(&encode_farewells(&lent)), Some(expected));
        assert_eq!(decode_farewells(&[]), Some(vec![]));
        assert_eq!(decode_farewells(&[9, 0, 0, 0, b'a']), None);
    }
}
