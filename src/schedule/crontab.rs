//! A crontab file, read the way supercronic reads it, for `pgleader cron`: an image's existing
//! crontab runs unchanged, with the same meaning.
//!
//! A line is blank, a comment (`#`), an environment line (`NAME=value`, quotes stripped as
//! Vixie cron does; `SHELL=` picks the shell, `CRON_TZ=` the zone the schedules below it are
//! read in), or a job: a schedule and a command run through `$SHELL -c` (`/bin/sh` by default).
//! A schedule is tried as supercronic tries it: seven fields (seconds first, year last), then
//! six (year last), then five (`minute hour day month weekday`), then a nickname (`@hourly`,
//! `@daily`, `@weekly`, `@monthly`, `@yearly`, and pgleader's own `@every DURATION`). Note that
//! `--schedule`'s six fields put seconds first: in a crontab file the file's meaning wins.
//!
//! Where cron and supercronic differ (a file that sets a name twice: cron applies each value to
//! the lines below it, supercronic gives every job the last one), pgleader follows cron: an
//! environment or `CRON_TZ` line applies to the jobs below it, so that one file can read
//! different jobs in different zones.
//!
//! Per-job options ride in a comment directly above the job, which cron and supercronic ignore:
//! `# pgleader: name=report overlap=skip catch-up=1h timeout=30m`. A job is known by its name;
//! without one, by its command (a stable name made from it, with `-2`, `-3` after a command
//! that more than one line runs), so that changing a line's schedule keeps the job.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use jiff::tz::TimeZone;

use crate::election::lock::LockKey;
use crate::schedule::calendar::{self, Schedule};

/// The shell a job's command runs through when no `SHELL=` line says otherwise.
pub const DEFAULT_SHELL: &str = "/bin/sh";

/// The catch-up window of a job whose directive names none: as `--catch-up`'s default.
pub const DEFAULT_CATCH_UP: Duration = Duration::from_secs(3600);

/// The longest job name.
const MAX_NAME: usize = 64;

/// The directive comment's opening.
const DIRECTIVE: &str = "pgleader:";

/// A crontab, read and checked.
#[derive(Clone, Debug)]
pub struct Crontab {
    pub path: PathBuf,
    pub jobs: Vec<CronJob>,
}

/// One job of a crontab.
#[derive(Clone, Debug, PartialEq)]
pub struct CronJob {
    /// What the job is known by (`PGLEADER_JOB`).
    pub name: String,
    /// Its line in the file, from 1.
    pub line: usize,
    pub when: Schedule,
    /// The command, as written, run through `shell -c`.
    pub command: String,
    pub shell: String,
    /// The environment lines above it, in order (`SHELL` and `CRON_TZ` included, as cron
    /// passes them on).
    pub env: Vec<(String, String)>,
    pub overlap: Overlap,
    /// How late a missed occurrence may still run; only the latest, never a backlog.
    pub catch_up: Duration,
    /// How long a run may take before it is stopped; `None`: as long as it needs.
    pub timeout: Option<Duration>,
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
    /// Reads and checks the crontab at `path`.
    pub fn read(path: &Path) -> Result<Crontab, CrontabError> {
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
        Crontab::parse(path, &text)
    }

    /// Checks the crontab `text`, read from `path`.
    pub fn parse(path: &Path, text: &str) -> Result<Crontab, CrontabError> {
        let fail = |line: usize, message: String| CrontabError {
            path: path.to_owned(),
            line: Some(line),
            message,
        };
        let mut env: Vec<(String, String)> = Vec::new();
        let mut zone = TimeZone::UTC;
        let mut options: Option<(usize, Options)> = None;
        let mut jobs = Vec::new();
        for (index, raw) in text.lines().enumerate() {
            let number = index + 1;
            let line = raw.trim();
            if line.is_empty() {
                continue;
            }
            if let Some(comment) = line.strip_prefix('#') {
                if let Some(words) = comment.trim_start().strip_prefix(DIRECTIVE) {
                    if let Some((above, _)) = options {
                        return Err(fail(
                            number,
                            format!(
                                "a second pgleader directive for one job (the first is on line {above})"
                            ),
                        ));
                    }
                    options = Some((number, Options::parse(words).map_err(|m| fail(number, m))?));
                }
                continue;
            }
            if let Some((name, value)) = environment_line(line) {
                if let Some((above, _)) = options {
                    return Err(fail(
                        above,
                        "a pgleader directive must stand directly above a job line".into(),
                    ));
                }
                if name == "CRON_TZ" {
                    zone = calendar::zone(&value).map_err(|m| fail(number, m))?;
                }
                env.retain(|(set, _)| *set != name);
                env.push((name, value));
                continue;
            }
            let (when, command) = job_line(line, &zone).map_err(|m| fail(number, m))?;
            if command.is_empty() {
                return Err(fail(number, "the job has a schedule but no command".into()));
            }
            let options = options
                .take()
                .map(|(_, options)| options)
                .unwrap_or_default();
            let shell = env
                .iter()
                .find(|(name, _)| name == "SHELL")
                .map_or(DEFAULT_SHELL.to_owned(), |(_, shell)| shell.clone());
            jobs.push(CronJob {
                name: options.name.unwrap_or_default(),
                line: number,
                when,
                command: command.to_owned(),
                shell,
                env: env.clone(),
                overlap: options.overlap.unwrap_or_default(),
                catch_up: options.catch_up.unwrap_or(DEFAULT_CATCH_UP),
                timeout: options.timeout.filter(|timeout| !timeout.is_zero()),
            });
        }
        if let Some((above, _)) = options {
            return Err(fail(
                above,
                "a pgleader directive must stand directly above a job line".into(),
            ));
        }
        name_jobs(&mut jobs).map_err(|(line, message)| fail(line, message))?;
        Ok(Crontab {
            path: path.to_owned(),
            jobs,
        })
    }
}

/// A job's options, from its directive comment.
#[derive(Debug, Default)]
struct Options {
    name: Option<String>,
    overlap: Option<Overlap>,
    catch_up: Option<Duration>,
    timeout: Option<Duration>,
}

impl Options {
    /// `name=report overlap=skip catch-up=1h timeout=30m`, in any order.
    fn parse(words: &str) -> Result<Options, String> {
        let mut options = Options::default();
        for word in words.split_whitespace() {
            let Some((key, value)) = word.split_once('=') else {
                return Err(format!(
                    "{word:?} in a pgleader directive is not KEY=VALUE (keys: name, overlap, catch-up, timeout)"
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
                _ => {
                    return Err(format!(
                        "unknown key {key:?} in a pgleader directive (keys: name, overlap, catch-up, timeout)"
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

/// A job name as a directive gives it: what logs, metrics and the ledger show.
fn job_name(value: &str) -> Result<String, String> {
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
    let name = name.trim_end();
    let mut chars = name.chars();
    let first = chars.next()?;
    if !(first.is_ascii_alphabetic() || first == '_')
        || !chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
    {
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

/// A job line's schedule and command: seven fields, then six, then five, then a nickname.
fn job_line<'a>(line: &'a str, zone: &TimeZone) -> Result<(Schedule, &'a str), String> {
    let tokens = tokens(line);
    if let Some((first, _)) = tokens.first()
        && first.starts_with('@')
    {
        return nickname(line, &tokens, zone);
    }
    let mut five_error = None;
    for count in [7, 6, 5] {
        if tokens.len() < count {
            continue;
        }
        let fields: Vec<&str> = tokens[..count].iter().map(|(field, _)| *field).collect();
        let seven: [&str; 7] = match fields.as_slice() {
            [s, m, h, dom, mon, dow, y] => [s, m, h, dom, mon, dow, y],
            [m, h, dom, mon, dow, y] => ["0", m, h, dom, mon, dow, y],
            [m, h, dom, mon, dow] => ["0", m, h, dom, mon, dow, "*"],
            _ => continue,
        };
        match Schedule::from_crontab_fields(seven, zone.clone()) {
            Ok(schedule) => return Ok((schedule, rest(line, &tokens, count))),
            // The five-field reading's complaint is the one a crontab's author understands.
            Err(err) if count == 5 => five_error = Some((fields.join(" "), err)),
            Err(_) => {}
        }
    }
    Err(match five_error {
        Some((fields, err)) => format!("not a schedule: {fields:?}: {err}"),
        None => "not a job line: expected a schedule (five cron fields, six or seven with a year, or a nickname such as @daily) and a command, or NAME=value".into(),
    })
}

/// `@hourly` and its kind, or `@every DURATION`, and the command after it.
fn nickname<'a>(
    line: &'a str,
    tokens: &[(&'a str, usize)],
    zone: &TimeZone,
) -> Result<(Schedule, &'a str), String> {
    let nickname = tokens[0].0.to_ascii_lowercase();
    if nickname == "@every" {
        let Some((every, _)) = tokens.get(1) else {
            return Err("@every needs a duration, such as @every 30s".into());
        };
        let every = humantime::parse_duration(every).map_err(|err| {
            format!("@every {every}: {err} (expected a duration such as 30s or 5m)")
        })?;
        return Ok((Schedule::every(every)?, rest(line, tokens, 2)));
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
    let schedule = Schedule::from_crontab_fields(fields, zone.clone())?;
    Ok((schedule, rest(line, tokens, 1)))
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
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Crontab, CrontabError> {
        Crontab::parse(Path::new("crontab"), text)
    }

    fn schedule(job: &CronJob) -> String {
        format!("{} {}", job.when.expression(), job.when.timezone())
    }

    #[test]
    fn every_form_supercronic_reads_is_read_with_its_meaning() {
        let tab = parse(
            "# a comment\n\
             \n\
             */5 * * * * echo five\n\
             0 3 * * * 2030 echo six\n\
             */10 0 3 * * * 2030 echo seven\n\
             @hourly echo hourly\n\
             @every 30s echo every\n",
        )
        .expect("parse");
        let got: Vec<(String, &str)> = tab
            .jobs
            .iter()
            .map(|job| (schedule(job), job.command.as_str()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("0 */5 * * * * UTC".to_owned(), "echo five"),
                ("0 0 3 * * * 2030 UTC".to_owned(), "echo six"),
                ("*/10 0 3 * * * 2030 UTC".to_owned(), "echo seven"),
                ("0 0 * * * * UTC".to_owned(), "echo hourly"),
                ("@every 30s UTC".to_owned(), "echo every"),
            ]
        );
    }

    #[test]
    fn a_crontab_as_people_write_it_is_read_as_written() {
        // Padded columns, tabs, a trailing comment (part of the command, as for cron), a `%`,
        // and a last line without a newline.
        let tab = parse(
            "# m h  dom mon dow   command\n\
             MAILTO=\"\"\n\
             PATH=/usr/local/bin:/usr/bin:/bin\n\
             \n  */5  *   *   *   *    /app/bin/sync --quiet   # every five\n\
             0    3   *   *   1-5  date +%Y-%m-%d >> /var/log/nightly.log 2>&1\n\
             \t@daily\tfind /tmp -mtime +7 -delete\n\
             30 2 * * * echo last",
        )
        .expect("parse");
        let got: Vec<(String, usize, &str)> = tab
            .jobs
            .iter()
            .map(|job| (schedule(job), job.line, job.command.as_str()))
            .collect();
        assert_eq!(
            got,
            vec![
                (
                    "0 */5 * * * * UTC".to_owned(),
                    5,
                    "/app/bin/sync --quiet   # every five"
                ),
                (
                    "0 0 3 * * 1-5 UTC".to_owned(),
                    6,
                    "date +%Y-%m-%d >> /var/log/nightly.log 2>&1"
                ),
                (
                    "0 0 0 * * * UTC".to_owned(),
                    7,
                    "find /tmp -mtime +7 -delete"
                ),
                ("0 30 2 * * * UTC".to_owned(), 8, "echo last"),
            ]
        );
        assert_eq!(
            tab.jobs[0].env,
            vec![
                ("MAILTO".into(), String::new()),
                ("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into())
            ]
        );
    }

    #[test]
    fn environment_lines_apply_to_the_jobs_below_them() {
        let tab = parse(
            "CRON_TZ=Europe/Paris\n\
             GREETING = \"hello there\"\n\
             0 3 * * * echo $GREETING\n\
             SHELL=/bin/bash\n\
             CRON_TZ='America/New_York'\n\
             GREETING=bye\n\
             0 4 * * * echo $GREETING\n",
        )
        .expect("parse");
        let [first, second] = tab.jobs.as_slice() else {
            panic!("two jobs")
        };
        assert_eq!(schedule(first), "0 0 3 * * * Europe/Paris");
        assert_eq!(first.shell, "/bin/sh");
        assert_eq!(
            first.env,
            vec![
                ("CRON_TZ".into(), "Europe/Paris".into()),
                ("GREETING".into(), "hello there".into())
            ]
        );
        assert_eq!(schedule(second), "0 0 4 * * * America/New_York");
        assert_eq!(second.shell, "/bin/bash");
        assert!(second.env.contains(&("GREETING".into(), "bye".into())));
        assert_eq!(second.env.len(), 3);
    }

    #[test]
    fn a_directive_names_a_job_and_sets_its_options() {
        let tab = parse(
            "# pgleader: name=report overlap=replace catch-up=10m timeout=30m\n\
             0 3 * * * ./report.sh  --all\n\
             0 4 * * * ./report.sh  --all\n",
        )
        .expect("parse");
        let [named, plain] = tab.jobs.as_slice() else {
            panic!("two jobs")
        };
        assert_eq!(named.name, "report");
        assert_eq!(named.overlap, Overlap::Replace);
        assert_eq!(named.catch_up, Duration::from_secs(600));
        assert_eq!(named.timeout, Some(Duration::from_secs(1800)));
        assert_eq!(named.command, "./report.sh  --all");
        assert_eq!(plain.overlap, Overlap::Skip);
        assert_eq!(plain.catch_up, DEFAULT_CATCH_UP);
        assert_eq!(plain.timeout, None);
        assert!(plain.name.starts_with("report-sh-all-"), "{}", plain.name);
    }

    #[test]
    fn a_job_without_a_name_is_named_by_its_command_and_keeps_it_across_schedules() {
        let one = parse("0 3 * * * /usr/bin/backup --full\n").expect("parse");
        let other = parse("*/5 * * * * /usr/bin/backup --full\n").expect("parse");
        assert_eq!(one.jobs[0].name, "usr-bin-backup-full");
        assert_eq!(one.jobs[0].name, other.jobs[0].name);
        let twice = parse("0 3 * * * backup\n0 4 * * * backup\n0 5 * * * backup\n").expect("parse");
        let names: Vec<&str> = twice.jobs.iter().map(|job| job.name.as_str()).collect();
        assert_eq!(names, ["backup", "backup-2", "backup-3"]);
        let long = "x".repeat(100);
        let named = name_from_command(&long);
        assert!(named.len() <= 57 && named.starts_with("xxx"), "{named}");
        assert_ne!(name_from_command("echo A"), name_from_command("echo a"));
    }

    #[test]
    fn a_reread_file_tells_added_removed_changed_and_unchanged_jobs_apart() {
        let old = parse(
            "# pgleader: name=stays\n0 3 * * * a\n\
             # pgleader: name=moves\n0 4 * * * b\n\
             # pgleader: name=goes\n0 5 * * * c\n\
             # pgleader: name=retimed\n0 6 * * * d\n",
        )
        .expect("parse");
        let new = parse(
            "\n# pgleader: name=moves\n0 4 * * * b\n\
             # pgleader: name=stays\n0 3 * * * a\n\
             # pgleader: name=retimed\n0 7 * * * d\n\
             # pgleader: name=new\n0 8 * * * e\n",
        )
        .expect("parse");
        assert_eq!(
            Changes::between(&old, &new),
            Changes {
                added: vec!["new".into()],
                removed: vec!["goes".into()],
                changed: vec!["retimed".into()],
                unchanged: vec!["moves".into(), "stays".into()],
            }
        );
        // What a job's command sees is part of its definition; where it stands is not.
        let env = parse("A=1\n# pgleader: name=stays\n0 3 * * * a\n").expect("parse");
        assert_ne!(env.jobs[0].fingerprint(), old.jobs[0].fingerprint());
        assert_eq!(new.jobs[1].fingerprint(), old.jobs[0].fingerprint());
    }

    #[test]
    fn bad_lines_are_refused_with_their_line_and_what_is_wrong() {
        let cases = [
            ("0 3 * *\n", 1, "not a job line"),
            ("0 3 * * * \n", 1, "no command"),
            ("0 25 * * * echo\n", 1, "not a schedule"),
            (
                "CRON_TZ=Mars/Olympus\n0 3 * * * echo\n",
                1,
                "unknown time zone",
            ),
            ("@fortnightly echo\n", 1, "unknown nickname"),
            ("@every soon echo\n", 1, "@every soon"),
            (
                "\n# pgleader: nom=x\n0 3 * * * echo\n",
                2,
                "unknown key \"nom\"",
            ),
            (
                "# pgleader: overlap=queue\n0 3 * * * echo\n",
                1,
                "expected skip, allow or replace",
            ),
            ("# pgleader: name=a b\n0 3 * * * echo\n", 1, "not KEY=VALUE"),
            (
                "# pgleader: name=x\nA=b\n0 3 * * * echo\n",
                1,
                "directly above a job line",
            ),
            ("# pgleader: name=x\n", 1, "directly above a job line"),
            (
                "# pgleader: name=x\n0 3 * * * a\n# pgleader: name=x\n0 4 * * * b\n",
                4,
                "two jobs are named \"x\" (lines 2 and 4)",
            ),
            (
                "# pgleader: name=no/slash\n0 3 * * * a\n",
                1,
                "a job name is",
            ),
        ];
        for (text, line, wanted) in cases {
            let err = parse(text).expect_err(text);
            assert_eq!(err.line, Some(line), "{text:?}: {err}");
            assert!(err.to_string().contains(wanted), "{text:?}: {err}");
            assert!(
                err.to_string().starts_with(&format!("crontab:{line}: ")),
                "{err}"
            );
        }
    }
}
