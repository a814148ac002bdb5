//! A crontab file, read the way supercronic reads it, for `pgleader cron`: an image's existing
//! crontab runs unchanged, with the same meaning.
//!
//! A line is blank, a comment (`#`), an environment line (`NAME=value`, quotes stripped as
//! Vixie cron does; `SHELL=` picks the shell, `CRON_TZ=` the zone the schedules are read in), or
//! a job: a schedule and a command run through `$SHELL -c` (`/bin/sh` by default). A schedule
//! is cut as supercronic cuts it: seven fields (seconds first, year last), then six (year last),
//! then five (`minute hour day month weekday`), then a nickname (`@hourly`, `@daily`,
//! `@weekly`, `@monthly`, `@yearly`, and pgleader's own `@every DURATION`), the first reading
//! that parses in supercronic's grammar (`fields.rs`) winning, whether or not it ever occurs
//! again (a past year, 31 February: accepted, warned of, never run). Note that `--schedule`'s
//! six fields put seconds first: in a crontab file the file's meaning wins.
//!
//! As supercronic does, every environment line applies to every job, the last value of a name
//! winning, `CRON_TZ` and `SHELL` included; with no `CRON_TZ`, the local zone (`zone.rs`). Cron
//! reads such a file otherwise (each line applies to the jobs below it), so the reader notes
//! where the two differ: a name set twice, or below a job. A job that needs a zone of its own
//! says so in its directive (`zone=`).
//!
//! Per-job options ride in a comment directly above the job, which cron and supercronic ignore:
//! `# pgleader: name=report overlap=skip catch-up=1h timeout=30m jitter=30s zone=Europe/Paris`. A job is
//! known by its name; without one, by its command (a stable name made from it, with `-2`, `-3`
//! after a command that more than one line runs), so that changing a line's schedule keeps the
//! job.

mod fields;
mod zone;

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use jiff::Timestamp;
use jiff::tz::TimeZone;

use crate::election::lock::LockKey;
use crate::environment::ProcessEnvironment;
use crate::operate::pings::Target;
use crate::schedule::calendar::{self, Schedule};
use crate::time::for_people;
pub use zone::{Host, ZoneSource};

/// The shell a job's command runs through when no `SHELL=` line says otherwise.
pub const DEFAULT_SHELL: &str = "/bin/sh";

/// The catch-up window of a job whose directive names none: as `--catch-up`'s default.
pub const DEFAULT_CATCH_UP: Duration = Duration::from_secs(3600);

/// The longest job name.
const MAX_NAME: usize = 64;

/// The environment line that gives every job of the file a monitor (`ping=` in a job's directive
/// wins, `ping=none` opts out).
pub const PING_VARIABLE: &str = "PGLEADER_PING";

/// The directive comment's opening.
const DIRECTIVE: &str = "pgleader:";

/// A crontab, read and checked.
#[derive(Clone, Debug)]
pub struct Crontab {
    pub path: PathBuf,
    pub jobs: Vec<CronJob>,
    /// What the file may not mean to its author, by line: where cron would read it otherwise,
    /// where supercronic would refuse it.
    pub notes: Vec<(usize, String)>,
}

/// One job of a crontab.
#[derive(Clone, Debug, PartialEq)]
pub struct CronJob {
    /// What the job is known by (`PGLEADER_JOB`).
    pub name: String,
    /// Its line in the file, from 1.
    pub line: usize,
    pub when: Schedule,
    /// Where the schedule's zone comes from (the zone itself is in `when`).
    pub zone_source: ZoneSource,
    /// The command, as written, run through `shell -c`.
    pub command: String,
    pub shell: String,
    /// The file's environment lines, in order, the last value of a name winning (`SHELL` and
    /// `CRON_TZ` included, as cron passes them on): the same for every job.
    pub env: Vec<(String, String)>,
    pub overlap: Overlap,
    /// How late a missed occurrence may still run; only the latest, never a backlog.
    pub catch_up: Duration,
    /// How long a run may take before it is stopped; `None`: as long as it needs.
    pub timeout: Option<Duration>,
    /// The most an occurrence's start is put off by (`jitter=`), shorter than the schedule's
    /// shortest gap; `None`: each starts at its occurrence. See [`crate::schedule::jitter`].
    pub jitter: Option<Duration>,
    /// The monitor its runs are pinged to (`ping=`, else the file's `PGLEADER_PING=`).
    pub ping: Option<Target>,
}

impl CronJob {
    /// 32 bits of a hash of the job's name and definition ([`CronJob::fingerprint`]): what a
    /// replica says of how it defines the job, so that replicas that define it otherwise see
    /// each other (on PostgreSQL, the second int4 of a shared advisory lock).
    pub fn definition_marker(&self) -> u32 {
        let key = LockKey::from_name(&format!(
            "pgleader defines {} {}",
            self.name,
            self.fingerprint()
        ));
        key.key() as u64 as u32
    }

    /// The number the fleet knows the job by: its item in the sharded lock of the crontab's
    /// name (on PostgreSQL the second int4 of its advisory lock), 30 bits of a hash of its
    /// name, so that every replica, whatever else its file holds, calls it the same.
    pub fn item(&self) -> u32 {
        item_of(&self.name)
    }

    /// Eight hex digits that identify the job's definition: its schedule and zone, command,
    /// shell, environment and options; not its name nor its line. Replicas whose files define
    /// a job alike agree on it, and one that differs (a rolling deploy half done) shows.
    pub fn fingerprint(&self) -> String {
        let mut text = format!(
            "{}\u{1f}{}\u{1f}{}\u{1f}{}\u{1f}{}\u{1f}{:?}",
            self.when,
            self.command,
            self.shell,
            self.overlap.as_str(),
            self.catch_up.as_secs(),
            self.timeout.map(|timeout| timeout.as_secs())
        );
        for (name, value) in &self.env {
            text.push_str(&format!("\u{1f}{name}={value}"));
        }
        // Only when set, so that the jobs defined before jitter= existed keep their definition
        // across a rolling deploy.
        if let Some(jitter) = self.jitter {
            text.push_str(&format!("\u{1f}jitter={}", jitter.as_millis()));
        }
        // So that a reread that changes only the monitor hands the job's runs the new one.
        if let Some(ping) = &self.ping {
            text.push_str(&format!("\u{1f}ping={}", ping.url_for_fingerprint()));
        }
        calendar::fingerprint_of(&text, "")
    }
}

/// A job's definition (`CronJob::definition_marker`) as `status` and `/status` show it: eight
/// hex digits.
pub fn definition_hex(definition: u32) -> String {
    format!("{definition:08x}")
}

/// The number of the job named `name` (see [`CronJob::item`]): in SQL,
/// `hashtextextended('pgleader job ' || name, 0) & 1073741823` (the low 30 bits).
pub fn item_of(name: &str) -> u32 {
    let key = LockKey::from_name(&format!("pgleader job {name}")).key();
    (key as u64 as u32) & ((1 << 30) - 1)
}

/// How a reread crontab differs from the one before, job by job (by name).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Jobs the new file has and the old one did not: they start.
    pub added: Vec<String>,
    /// Jobs the old file had and the new one does not: no longer scheduled (a run in progress
    /// finishes).
    pub removed: Vec<String>,
    /// Jobs in both whose definition changed: the next occurrence follows the new one.
    pub changed: Vec<String>,
    /// Jobs in both, defined alike (their line may have moved): their runs are not touched.
    pub unchanged: Vec<String>,
}

impl Changes {
    /// Compares two readings of a crontab.
    pub fn between(old: &Crontab, new: &Crontab) -> Changes {
        let mut changes = Changes::default();
        for job in &new.jobs {
            match old.jobs.iter().find(|before| before.name == job.name) {
                None => changes.added.push(job.name.clone()),
                Some(before) if before.fingerprint() != job.fingerprint() => {
                    changes.changed.push(job.name.clone());
                }
                Some(_) => changes.unchanged.push(job.name.clone()),
            }
        }
        for job in &old.jobs {
            if !new.jobs.iter().any(|after| after.name == job.name) {
                changes.removed.push(job.name.clone());
            }
        }
        changes
    }
}

/// What happens when a job's next occurrence comes while its previous run still runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Overlap {
    /// The occurrence is skipped (recorded as such): no backlog.
    #[default]
    Skip,
    /// Another run starts beside the one still running.
    Allow,
    /// The run still going is stopped, then the new one starts.
    Replace,
}

impl Overlap {
    pub fn as_str(self) -> &'static str {
        match self {
            Overlap::Skip => "skip",
            Overlap::Allow => "allow",
            Overlap::Replace => "replace",
        }
    }
}

/// A crontab that cannot be used: where, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CrontabError {
    pub path: PathBuf,
    /// The line, from 1; `None` for the file as a whole (it cannot be read).
    pub line: Option<usize>,
    pub message: String,
}

impl fmt::Display for CrontabError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{line}: {}", self.path.display(), self.message),
            None => write!(f, "{}: {}", self.path.display(), self.message),
        }
    }
}

impl std::error::Error for CrontabError {}

impl Crontab {
    /// Reads and checks the crontab at `path`, its local zone the host's.
    pub fn read(path: &Path) -> Result<Crontab, CrontabError> {
        Crontab::read_on(path, &Host::real(&ProcessEnvironment))
    }

    /// Reads and checks the crontab at `path`, its local zone `host`'s.
    pub fn read_on(path: &Path, host: &Host) -> Result<Crontab, CrontabError> {
        let text = std::fs::read(path).map_err(|err| CrontabError {
            path: path.to_owned(),
            line: None,
            message: format!("cannot read the crontab: {err}"),
        })?;
        let text = String::from_utf8(text).map_err(|_| CrontabError {
            path: path.to_owned(),
            line: None,
            message: "the crontab is not UTF-8 text".into(),
        })?;
        Crontab::parse(path, &text, host)
    }

    /// Checks the crontab `text`, read from `path`, its local zone `host`'s.
    pub fn parse(path: &Path, text: &str, host: &Host) -> Result<Crontab, CrontabError> {
        let fail = |line: Option<usize>, message: String| CrontabError {
            path: path.to_owned(),
            line,
            message,
        };
        let read = Lines::read(text).map_err(|(line, message)| fail(Some(line), message))?;
        let needs_local_zone = read.cron_tz.is_none()
            && read
                .jobs
                .iter()
                .any(|job| job.when.period().is_none() && job.options.zone.is_none());
        let (zone, source) = match read.cron_tz {
            Some((zone, line)) => (zone, ZoneSource::CronTz { line }),
            None if needs_local_zone => host
                .local_zone()
                .map_err(|message| fail(None, format!("{message}; the zone of the jobs")))?,
            None => (TimeZone::UTC, ZoneSource::Default),
        };
        let shell = read
            .env
            .iter()
            .find(|(name, _)| name == "SHELL")
            .map_or(DEFAULT_SHELL.to_owned(), |(_, shell)| shell.clone());
        // Every job's monitor unless its directive says otherwise (`{job}` in it: the job's name).
        let default_ping = read
            .env
            .iter()
            .rfind(|(name, _)| name == PING_VARIABLE)
            .map(|(_, url)| url.clone());
        let mut jobs = Vec::with_capacity(read.jobs.len());
        let mut pings = Vec::with_capacity(read.jobs.len());
        // The shortest gap of each schedule, computed once however many jobs share it.
        let mut gaps: HashMap<String, Option<Duration>> = HashMap::new();
        for job in read.jobs {
            let (line, options) = (job.line, job.options);
            let (when, zone_source) = match options.zone {
                _ if job.when.period().is_some() => (job.when, ZoneSource::Every),
                Some((line, own)) => (job.when.in_zone(own), ZoneSource::Directive { line }),
                None => (job.when.in_zone(zone.clone()), source.clone()),
            };
            let jitter = options.jitter.filter(|jitter| !jitter.is_zero());
            pings.push(
                options
                    .ping
                    .clone()
                    .or(default_ping.clone())
                    .filter(|text| text != "none"),
            );
            if let Some(jitter) = jitter {
                let gap = *gaps
                    .entry(when.to_string())
                    .or_insert_with(|| when.shortest_gap(Timestamp::now()));
                check_jitter(gap, jitter).map_err(|message| fail(Some(line), message))?;
            }
            jobs.push(CronJob {
                name: options.name.unwrap_or_default(),
                line,
                when,
                zone_source,
                command: job.command,
                shell: shell.clone(),
                env: read.env.clone(),
                overlap: options.overlap.unwrap_or_default(),
                catch_up: options.catch_up.unwrap_or(DEFAULT_CATCH_UP),
                timeout: options.timeout.filter(|timeout| !timeout.is_zero()),
                jitter,
                ping: None,
            });
        }
        name_jobs(&mut jobs).map_err(|(line, message)| fail(Some(line), message))?;
        for (job, ping) in jobs.iter_mut().zip(pings) {
            if let Some(text) = ping {
                // The error names the host at most: the URL's path is the check's secret.
                let target = Target::parse(&text, &job.name).map_err(|err| {
                    fail(Some(job.line), format!("ping= of job {}: {err}", job.name))
                })?;
                job.ping = Some(target);
            }
        }
        Ok(Crontab {
            path: path.to_owned(),
            jobs,
            notes: read.notes,
        })
    }

    /// What to warn of at `at`, a line each (`FILE:LINE: what`): the file's notes, and each job
    /// whose schedule has no occurrence after `at` (it never runs).
    pub fn warnings(&self, at: Timestamp) -> Vec<String> {
        let mut warnings = self.notes.clone();
        for job in &self.jobs {
            if !job.when.occurs_after(at) {
                warnings.push((
                    job.line,
                    format!(
                        "job {} never runs: its schedule {} has no occurrence after {} (a past \
                         year, or a day no month has)",
                        job.name,
                        job.when,
                        calendar::rfc3339(at)
                    ),
                ));
            }
        }
        warnings.sort_by_key(|(line, _)| *line);
        warnings
            .into_iter()
            .map(|(line, text)| format!("{}:{line}: {text}", self.path.display()))
            .collect()
    }
}

/// A crontab's lines, read in order: the environment, the zone, the jobs (their schedules in
/// UTC until the file's zone is known) and the notes.
#[derive(Default)]
struct Lines {
    env: Vec<(String, String)>,
    cron_tz: Option<(TimeZone, usize)>,
    jobs: Vec<Pending>,
    notes: Vec<(usize, String)>,
}

/// A job line, read.
struct Pending {
    line: usize,
    when: Schedule,
    command: String,
    options: Options,
}

impl Lines {
    fn read(text: &str) -> Result<Lines, (usize, String)> {
        let mut read = Lines::default();
        // Where each name was first set.
        let mut set: HashMap<String, usize> = HashMap::new();
        let mut options: Option<(usize, Options)> = None;
        for (index, raw) in text.lines().enumerate() {
            let number = index + 1;
            let line = raw.trim();
            if line.is_empty() {
                continue;
            }
            if let Some(comment) = line.strip_prefix('#') {
                if let Some(words) = comment.trim_start().strip_prefix(DIRECTIVE) {
                    if let Some((above, _)) = options {
                        return Err((
                            number,
                            format!(
                                "a second pgleader directive for one job (the first is on line {above})"
                            ),
                        ));
                    }
                    options = Some((number, Options::parse(number, words)?));
                }
                continue;
            }
            if let Some((name, value)) = environment_line(line) {
                if let Some((above, _)) = options {
                    return Err((
                        above,
                        "a pgleader directive must stand directly above a job line".into(),
                    ));
                }
                if name == "CRON_TZ" {
                    read.cron_tz = Some((calendar::zone(&value).map_err(|m| (number, m))?, number));
                }
                if let Some(note) = read.note_on_setting(&name, set.get(&name).copied()) {
                    read.notes.push((number, note));
                }
                set.entry(name.clone()).or_insert(number);
                read.env.retain(|(set, _)| *set != name);
                read.env.push((name, value));
                continue;
            }
            let job = job_line(line).map_err(|m| (number, m))?;
            if let Some(why) = job.refused_by_supercronic {
                read.notes.push((number, why));
            }
            read.jobs.push(Pending {
                line: number,
                when: job.when,
                command: job.command.to_owned(),
                options: options
                    .take()
                    .map(|(_, options)| options)
                    .unwrap_or_default(),
            });
        }
        if let Some((above, _)) = options {
            return Err((
                above,
                "a pgleader directive must stand directly above a job line".into(),
            ));
        }
        Ok(read)
    }

    /// What to say of a line that sets `name` where cron would read it otherwise than
    /// supercronic (and pgleader) do: set before on line `first`, or below a job.
    fn note_on_setting(&self, name: &str, first: Option<usize>) -> Option<String> {
        let below = self.jobs.first().map(|job| job.line);
        let (what, cron) = match (first, below) {
            (Some(first), _) => (
                format!("{name} is set again (first on line {first})"),
                "cron gives each value to the jobs below it",
            ),
            (None, Some(job)) => (
                format!("{name} is set below a job (line {job})"),
                "cron gives it only to the jobs below it",
            ),
            (None, None) => return None,
        };
        let every = if name == "CRON_TZ" {
            "every job's schedule is read in the last zone given, as supercronic reads it"
        } else {
            "every job gets the last value, as under supercronic"
        };
        let instead = if name == "CRON_TZ" {
            "; for a zone of a job's own, use zone= in its pgleader directive"
        } else {
            ""
        };
        Some(format!("{what}: {every}; {cron}{instead}"))
    }
}

/// A job's options, from its directive comment.
#[derive(Debug, Default)]
struct Options {
    name: Option<String>,
    overlap: Option<Overlap>,
    catch_up: Option<Duration>,
    timeout: Option<Duration>,
    jitter: Option<Duration>,
    ping: Option<String>,
    /// The job's own zone, and the directive's line.
    zone: Option<(usize, TimeZone)>,
}

impl Options {
    /// `name=report overlap=skip catch-up=1h timeout=30m jitter=30s zone=Europe/Paris`, in any order, on
    /// line `line`.
    fn parse(line: usize, words: &str) -> Result<Options, (usize, String)> {
        Options::parse_words(line, words).map_err(|message| (line, message))
    }

    fn parse_words(line: usize, words: &str) -> Result<Options, String> {
        let mut options = Options::default();
        for word in words.split_whitespace() {
            let Some((key, value)) = word.split_once('=') else {
                return Err(format!(
                    "{word:?} in a pgleader directive is not KEY=VALUE (keys: name, overlap, catch-up, timeout, jitter, ping, zone)"
                ));
            };
            let duplicate = match key {
                "name" => options.name.replace(job_name(value)?).is_some(),
                "overlap" => {
                    let overlap = match value {
                        "skip" => Overlap::Skip,
                        "allow" => Overlap::Allow,
                        "replace" => Overlap::Replace,
                        _ => {
                            return Err(format!(
                                "overlap={value}: expected skip, allow or replace"
                            ));
                        }
                    };
                    options.overlap.replace(overlap).is_some()
                }
                "catch-up" => options.catch_up.replace(duration(key, value)?).is_some(),
                "timeout" => options.timeout.replace(duration(key, value)?).is_some(),
                "jitter" => options.jitter.replace(duration(key, value)?).is_some(),
                "ping" => options.ping.replace(value.to_owned()).is_some(),
                "zone" => {
                    let zone =
                        calendar::zone(value).map_err(|err| format!("zone={value}: {err}"))?;
                    options.zone.replace((line, zone)).is_some()
                }
                _ => {
                    return Err(format!(
                        "unknown key {key:?} in a pgleader directive (keys: name, overlap, catch-up, timeout, jitter, ping, zone)"
                    ));
                }
            };
            if duplicate {
                return Err(format!("{key} is given twice in one pgleader directive"));
            }
        }
        Ok(options)
    }
}

/// A job's `jitter=` must be shorter than the shortest gap between two of its occurrences, so
/// that an occurrence's delayed start never comes after the next occurrence.
fn check_jitter(shortest_gap: Option<Duration>, jitter: Duration) -> Result<(), String> {
    match shortest_gap {
        Some(gap) if jitter >= gap => Err(format!(
            "jitter={} is not shorter than the {} between two of the job's occurrences: a \
             run put off by up to that much could start after the next occurrence",
            for_people(jitter),
            for_people(gap)
        )),
        _ => Ok(()),
    }
}

/// A job name as a directive (or `status --job`) gives it: what logs, metrics and the ledger show.
pub fn job_name(value: &str) -> Result<String, String> {
    let fits = value
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if value.is_empty() || value.len() > MAX_NAME || !fits {
        return Err(format!(
            "name={value:?}: a job name is 1 to {MAX_NAME} letters, digits, '-', '_' or '.'"
        ));
    }
    Ok(value.to_owned())
}

fn duration(key: &str, value: &str) -> Result<Duration, String> {
    humantime::parse_duration(value)
        .map_err(|err| format!("{key}={value}: {err} (expected a duration such as 90s, 30m or 1h)"))
}

/// `NAME=value` (spaces around `=` allowed), with the value's quotes stripped; `None` if the
/// line is not one.
fn environment_line(line: &str) -> Option<(String, String)> {
    let (name, value) = line.split_once('=')?;
    // As supercronic matches it: a name is anything without spaces or '='.
    let name = name.trim_end();
    if name.is_empty() || name.contains(char::is_whitespace) {
        return None;
    }
    let value = value.trim();
    let unquoted = ['"', '\'']
        .iter()
        .find_map(|quote| {
            value
                .strip_prefix(*quote)
                .and_then(|inner| inner.strip_suffix(*quote))
        })
        .unwrap_or(value);
    Some((name.to_owned(), unquoted.to_owned()))
}

/// A job line, read: its schedule (in UTC until the file's zone is known) and command.
struct JobLine<'a> {
    when: Schedule,
    command: &'a str,
    /// Why supercronic would refuse the line, when pgleader reads it anyway.
    refused_by_supercronic: Option<String>,
}

/// A job line's schedule and command, cut as supercronic cuts it: the first of seven, six and
/// five fields that parses in its grammar and leaves a command, else a nickname. Only when no
/// such reading exists are the readings pgleader alone accepts tried.
fn job_line(line: &str) -> Result<JobLine<'_>, String> {
    let tokens = tokens(line);
    if let Some((first, _)) = tokens.first()
        && first.starts_with('@')
    {
        return nickname(line, &tokens);
    }
    let words: Vec<&str> = tokens.iter().map(|(word, _)| *word).collect();
    let mut five_error = None;
    for lenient in [false, true] {
        for count in [7, 6, 5] {
            // A schedule is followed by a command, or it is not this reading.
            if words.len() <= count {
                continue;
            }
            match fields::read(&words[..count], lenient) {
                Ok(fields) => {
                    let seven = fields.seven.each_ref().map(String::as_str);
                    let when =
                        Schedule::from_crontab_fields(seven, TimeZone::UTC).map_err(|err| {
                            format!("not a schedule: {:?}: {err}", words[..count].join(" "))
                        })?;
                    let refused_by_supercronic = fields.refused_by_supercronic.map(|why| {
                        format!("supercronic refuses this line ({why}); pgleader reads it")
                    });
                    return Ok(JobLine {
                        when,
                        command: rest(line, &tokens, count),
                        refused_by_supercronic,
                    });
                }
                // The five-field reading's complaint is the one a crontab's author understands.
                Err(err) if count == 5 && !lenient => {
                    five_error = Some((words[..count].join(" "), err));
                }
                Err(_) => {}
            }
        }
    }
    if (5..=7).contains(&words.len()) && fields::read(&words, true).is_ok() {
        return Err("the job has a schedule but no command".into());
    }
    Err(match five_error {
        Some((fields, err)) => format!("not a schedule: {fields:?}: {err}"),
        None => "not a job line: expected a schedule (five cron fields, six or seven with a year, or a nickname such as @daily) and a command, or NAME=value".into(),
    })
}

/// `@hourly` and its kind, or `@every DURATION`, and the command after it.
fn nickname<'a>(line: &'a str, tokens: &[(&'a str, usize)]) -> Result<JobLine<'a>, String> {
    let nickname = tokens[0].0.to_ascii_lowercase();
    if nickname == "@every" {
        let Some((every, _)) = tokens.get(1) else {
            return Err("@every needs a duration, such as @every 30s".into());
        };
        let every = humantime::parse_duration(every).map_err(|err| {
            format!("@every {every}: {err} (expected a duration such as 30s or 5m)")
        })?;
        return job(
            Schedule::every(every)?,
            rest(line, tokens, 2),
            Some("supercronic refuses @every, pgleader's own".into()),
        );
    }
    let fields = match nickname.as_str() {
        "@yearly" | "@annually" => ["0", "0", "0", "1", "1", "*", "*"],
        "@monthly" => ["0", "0", "0", "1", "*", "*", "*"],
        "@weekly" => ["0", "0", "0", "*", "*", "SUN", "*"],
        "@daily" | "@midnight" => ["0", "0", "0", "*", "*", "*", "*"],
        "@hourly" => ["0", "0", "*", "*", "*", "*", "*"],
        _ => {
            return Err(format!(
                "unknown nickname {:?} (expected @hourly, @daily, @weekly, @monthly, @yearly or @every DURATION)",
                tokens[0].0
            ));
        }
    };
    let capitals = (nickname != tokens[0].0).then(|| {
        format!(
            "supercronic refuses {} (it reads nicknames in lower case only)",
            tokens[0].0
        )
    });
    let schedule = Schedule::from_crontab_fields(fields, TimeZone::UTC)?;
    job(schedule, rest(line, tokens, 1), capitals)
}

/// A nickname's job line, refused without a command.
fn job(when: Schedule, command: &str, why: Option<String>) -> Result<JobLine<'_>, String> {
    if command.is_empty() {
        return Err("the job has a schedule but no command".into());
    }
    Ok(JobLine {
        when,
        command,
        refused_by_supercronic: why.map(|why| format!("{why}; pgleader reads it")),
    })
}

/// The whitespace-separated words of a line, with where each starts.
fn tokens(line: &str) -> Vec<(&str, usize)> {
    let mut tokens = Vec::new();
    let mut start = None;
    for (at, c) in line.char_indices() {
        match (c.is_whitespace(), start) {
            (true, Some(from)) => {
                tokens.push((&line[from..at], from));
                start = None;
            }
            (false, None) => start = Some(at),
            _ => {}
        }
    }
    if let Some(from) = start {
        tokens.push((&line[from..], from));
    }
    tokens
}

/// The line after its first `count` words, as written.
fn rest<'a>(line: &'a str, tokens: &[(&str, usize)], count: usize) -> &'a str {
    tokens
        .get(count)
        .map_or("", |(_, from)| line[*from..].trim_end())
}

/// Gives every job without a directive's name one made from its command, and refuses two jobs
/// of one name.
fn name_jobs(jobs: &mut [CronJob]) -> Result<(), (usize, String)> {
    let named: HashMap<String, usize> = jobs
        .iter()
        .filter(|job| !job.name.is_empty())
        .map(|job| (job.name.clone(), job.line))
        .collect();
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut runs: HashMap<String, usize> = HashMap::new();
    for job in jobs.iter_mut() {
        if job.name.is_empty() {
            let base = name_from_command(&job.command);
            let count = runs.entry(job.command.clone()).or_insert(0);
            *count += 1;
            job.name = if *count == 1 {
                base
            } else {
                format!("{base}-{count}")
            };
            if let Some(line) = named.get(&job.name) {
                return Err((
                    *line,
                    format!(
                        "the job name {:?} is also the name made from the command on line {} (name that one too)",
                        job.name, job.line
                    ),
                ));
            }
        }
        if let Some(first) = seen.insert(job.name.clone(), job.line) {
            return Err((
                job.line,
                format!(
                    "two jobs are named {:?} (lines {first} and {})",
                    job.name, job.line
                ),
            ));
        }
    }
    // A job's lock is its item number: two names of one number would share it.
    let mut items: HashMap<u32, (&str, usize)> = HashMap::new();
    for job in jobs.iter() {
        if let Some((other, line)) = items.insert(job.item(), (&job.name, job.line)) {
            return Err((
                job.line,
                format!(
                    "the job names {other:?} (line {line}) and {:?} hash alike, so one lock would \
                     serve both; rename one of them",
                    job.name
                ),
            ));
        }
    }
    Ok(())
}

/// A name made from a command: its words in lower case, joined by '-' (what is neither a letter
/// nor a digit becomes '-'), at most 48 characters; a long or unusual command gets eight hex
/// digits of its hash after that, so that two commands alike at the start stay two names.
pub fn name_from_command(command: &str) -> String {
    let mut slug = String::new();
    for c in command.chars() {
        if c.is_ascii_alphanumeric() {
            slug.push(c.to_ascii_lowercase());
        } else if !slug.ends_with('-') && !slug.is_empty() {
            slug.push('-');
        }
    }
    let slug = slug.trim_end_matches('-');
    const KEEP: usize = 48;
    if slug.len() <= KEEP && slug_is_faithful(command, slug) {
        return slug.to_owned();
    }
    let hash = crate::election::lock::LockKey::from_name(command).key() as u64 as u32;
    let cut = slug[..slug.len().min(KEEP)].trim_end_matches('-');
    if cut.is_empty() {
        format!("job-{hash:08x}")
    } else {
        format!("{cut}-{hash:08x}")
    }
}

/// Whether a slug tells its command apart from others: only plain words, single spaces and the
/// usual path and option characters were folded.
fn slug_is_faithful(command: &str, slug: &str) -> bool {
    !slug.is_empty()
        && command
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, ' ' | '-' | '/' | '.' | '_'))
        && !command.contains("  ")
        && command.chars().all(|c| !c.is_ascii_uppercase())
}

#[cfg(test)]
mod supercronic_tests;
#[cfg(test)]
mod tests;
