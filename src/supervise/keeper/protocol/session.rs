//! What pgleader and a session's keeper (`keeper/session.rs`) say to each other: one channel
//! for every run of the session, so each message names its run.
//!
//! The session's keeper is started with the arguments [`session_keeper_args`] gives and is
//! handed, once, the session's start message (`protocol::start_message`, no environment): the
//! session's connection sockets with their farewells and the session's deadline. Then pgleader
//! sends requests, each `[tag][run, 32 bits][length, 32 bits][body]`, little-endian: a run to
//! start ([`RUN`], [`run_request`]), the stop of one pgleader begins ([`STOPPING`]), a signal to
//! a run's process group ([`SIGNAL`]), the end of a run's whole tree ([`KILL`]), and the end of
//! the session's keeper ([`DISMISS`]). The keeper answers with each run's reports, each
//! `[run, 32 bits]` followed by a run's keeper's report as `protocol.rs` writes it
//! (`Report::encode`, or the output's tail).

use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;

use crate::supervise::keeper::protocol::{self, Output, Report};

/// The keeper's option that makes it a session's keeper: no command on its line, the runs come
/// over the channel.
pub const SESSION: &str = "session";

/// The arguments of a session's keeper: the channel's descriptor, [`SESSION`] and how to log.
pub fn session_keeper_args(fd: RawFd) -> Vec<OsString> {
    let mut args = vec![OsString::from(fd.to_string()), OsString::from(SESSION)];
    args.extend(protocol::log_args());
    args.push(OsString::from(protocol::END_OF_OPTIONS));
    args
}

/// Start a run: the body is [`run_request`]'s.
pub const RUN: u8 = b'R';
/// pgleader has begun stopping the run itself (as `protocol::STOPPING` for a run's keeper).
pub const STOPPING: u8 = b'S';
/// SIGKILL to everything the run started, wherever it went; `Done` follows once it is gone.
pub const KILL: u8 = b'K';
/// A signal to the run's process group: the body is its number (32 bits).
pub const SIGNAL: u8 = b'Z';
/// pgleader, alive, no longer needs the keeper: it kills what still runs, waits for it, and
/// exits without a farewell.
pub const DISMISS: u8 = b'Q';

/// The length of a request's head: the tag, the run, the body's length.
pub const HEAD: usize = 9;

/// A request: `tag` for `run`, with `body`.
pub fn request(tag: u8, run: u32, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEAD + body.len());
    out.push(tag);
    out.extend_from_slice(&run.to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// The first whole request in `bytes`: its tag, run and body, and how many bytes it took.
pub fn next_request(bytes: &[u8]) -> Option<(u8, u32, &[u8], usize)> {
    let head = bytes.get(..HEAD)?;
    let run = u32::from_le_bytes([head[1], head[2], head[3], head[4]]);
    let len = u32::from_le_bytes([head[5], head[6], head[7], head[8]]) as usize;
    let body = bytes.get(HEAD..HEAD + len)?;
    Some((head[0], run, body, HEAD + len))
}

/// A run to start, as the keeper reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunSpec {
    /// Where its output goes.
    pub output: Output,
    /// The job's name, for the keeper's log lines.
    pub job: String,
    /// The file to execute.
    pub program: OsString,
    /// Its `argv[0]` and arguments.
    pub argv: Vec<OsString>,
    /// What pgleader adds to its environment.
    pub env: Vec<(OsString, OsString)>,
}

/// The body of a [`RUN`] request: where the output goes (32 bits: `u32::MAX` for inherited,
/// else the bytes of its tail to keep), then parts, each a 32-bit length and its bytes: the
/// job, the program, the number of arguments, the arguments, then the environment's
/// `KEY=VALUE` entries.
pub fn run_request(
    output: Output,
    job: &str,
    program: &OsStr,
    argv: &[OsString],
    env: &[(&str, String)],
) -> Vec<u8> {
    let mut out = Vec::new();
    let output = match output {
        Output::Inherited => u32::MAX,
        Output::Tagged { keep } => keep.min(u32::MAX - 1),
    };
    out.extend_from_slice(&output.to_le_bytes());
    let mut part = |bytes: &[u8]| {
        out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        out.extend_from_slice(bytes);
    };
    part(job.as_bytes());
    part(program.as_bytes());
    part(&(argv.len() as u32).to_le_bytes());
    for arg in argv {
        part(arg.as_bytes());
    }
    for (key, value) in env {
        part(format!("{key}={value}").as_bytes());
    }
    out
}

/// What [`run_request`] wrote.
pub fn parse_run(body: &[u8]) -> io::Result<RunSpec> {
    let bad = || io::Error::other("a run request that does not parse");
    let output = u32::from_le_bytes(
        body.get(..4)
            .ok_or_else(bad)?
            .try_into()
            .map_err(|_| bad())?,
    );
    let mut rest = &body[4..];
    let mut parts = Vec::new();
    while !rest.is_empty() {
        parts.push(protocol::take_part(&mut rest).ok_or_else(bad)?);
    }
    let [job, program, argc, rest @ ..] = &parts[..] else {
        return Err(bad());
    };
    let argc = u32::from_le_bytes((*argc).try_into().map_err(|_| bad())?) as usize;
    if rest.len() < argc {
        return Err(bad());
    }
    let (argv, env) = rest.split_at(argc);
    let os = |bytes: &[u8]| OsStr::from_bytes(bytes).to_owned();
    Ok(RunSpec {
        output: if output == u32::MAX {
            Output::Inherited
        } else {
            Output::Tagged { keep: output }
        },
        job: String::from_utf8_lossy(job).into_owned(),
        program: os(program),
        argv: argv.iter().map(|arg| os(arg)).collect(),
        env: env
            .iter()
            .filter_map(|entry| {
                let at = entry.iter().position(|b| *b == b'=')?;
                Some((os(&entry[..at]), os(&entry[at + 1..])))
            })
            .collect(),
    })
}

/// A report of `run`'s.
pub fn report(run: u32, report: Report) -> [u8; 4 + Report::LEN] {
    let mut out = [0u8; 4 + Report::LEN];
    out[..4].copy_from_slice(&run.to_le_bytes());
    out[4..].copy_from_slice(&report.encode());
    out
}

/// The report of `run`'s last lines, `tail`.
pub fn output_report(run: u32, tail: &[u8]) -> Vec<u8> {
    let mut out = run.to_le_bytes().to_vec();
    out.extend_from_slice(&protocol::output_report(tail));
    out
}

/// What the keeper reported, as pgleader reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reported {
    Report(u32, Report),
    /// A run's last lines.
    Output(u32, Vec<u8>),
}

/// The first whole report in `bytes`, and how many bytes it took; `Err` if the bytes are not
/// reports.
pub fn next_report(bytes: &[u8]) -> io::Result<Option<(Reported, usize)>> {
    let Some(head) = bytes.get(..4 + Report::LEN) else {
        return Ok(None);
    };
    let run = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
    if head[4] == protocol::OUTPUT {
        let len = u32::from_le_bytes([head[5], head[6], head[7], head[8]]) as usize;
        let Some(tail) = bytes.get(4 + Report::LEN..4 + Report::LEN + len) else {
            return Ok(None);
        };
        return Ok(Some((
            Reported::Output(run, tail.to_vec()),
            4 + Report::LEN + len,
        )));
    }
    let mut encoded = [0u8; Report::LEN];
    encoded.copy_from_slice(&head[4..]);
    let report = Report::decode(encoded).ok_or_else(|| {
        io::Error::other("a report from the session's keeper that does not parse")
    })?;
    Ok(Some((Reported::Report(run, report), 4 + Report::LEN)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_survives_a_round_trip() {
        for output in [
            Output::Inherited,
            Output::Tagged { keep: 0 },
            Output::Tagged { keep: 4096 },
        ] {
            let argv = [
                OsString::from("sh"),
                OsString::from("-c"),
                OsString::from("echo a=b"),
            ];
            let env = [
                ("PGLEADER_JOB", "nightly".to_owned()),
                ("EMPTY", String::new()),
            ];
            let body = run_request(output, "nightly", OsStr::new("/bin/sh"), &argv, &env);
            let message = request(RUN, 7, &body);
            let (tag, run, parsed, len) = next_request(&message).expect("a whole request");
            assert_eq!((tag, run, len), (RUN, 7, message.len()));
            let spec = parse_run(parsed).expect("a run");
            assert_eq!(
                spec,
                RunSpec {
                    output,
                    job: "nightly".to_owned(),
                    program: OsString::from("/bin/sh"),
                    argv: argv.to_vec(),
                    env: vec![
                        (OsString::from("PGLEADER_JOB"), OsString::from("nightly")),
                        (OsString::from("EMPTY"), OsString::new()),
                    ],
                }
            );
            assert_eq!(next_request(&message[..message.len() - 1]), None);
        }
        assert!(parse_run(&[0, 0, 0, 0, 9]).is_err());
    }

    #[test]
    fn reports_name_their_run() {
        let mut bytes = report(3, Report::Started(42)).to_vec();
        bytes.extend(output_report(4, b"last\n"));
        bytes.extend(report(4, Report::Done(0)));
        let mut got = Vec::new();
        let mut at = 0;
        while let Some((reported, len)) = next_report(&bytes[at..]).expect("reports") {
            got.push(reported);
            at += len;
        }
        assert_eq!(
            got,
            [
                Reported::Report(3, Report::Started(42)),
                Reported::Output(4, b"last\n".to_vec()),
                Reported::Report(4, Report::Done(0)),
            ]
        );
        assert_eq!(at, bytes.len());
        assert!(next_report(&[0, 0, 0, 0, b'?', 0, 0, 0, 0]).is_err());
    }
}
