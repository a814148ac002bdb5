//! The zone a crontab's schedules are read in when the file names none: the local zone, as
//! supercronic (like cron) takes it: `TZ`, else `/etc/localtime`, else UTC.
//!
//! The zone is named, then taken from the tz database compiled into pgleader, never from the
//! host's files, so that every replica that names the same zone computes the same instants and
//! the name goes into each job's definition: replicas whose zones differ show as defining the
//! job otherwise. Hence `/etc/localtime` is read as the link it usually is (its target's path
//! after `zoneinfo/`), or through `/etc/timezone`; a copied zone file that nothing names is
//! refused, as is an unknown name in `TZ`, rather than guessed.

use std::fmt;
use std::path::Path;

use jiff::tz::TimeZone;

use crate::environment::Environment;
use crate::schedule::calendar;

/// Where a job's zone comes from, as `--check` says it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ZoneSource {
    /// A `CRON_TZ=` line of the file.
    CronTz { line: usize },
    /// The job's own `zone=` in its pgleader directive.
    Directive { line: usize },
    /// The `TZ` environment variable.
    Tz,
    /// The host's `/etc/localtime` (or `/etc/timezone`).
    LocalTime,
    /// Nothing names a zone.
    Default,
    /// `@every`, which counts from the Unix epoch whatever the zone.
    Every,
}

impl fmt::Display for ZoneSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ZoneSource::CronTz { line } => write!(f, "CRON_TZ, line {line}"),
            ZoneSource::Directive { line } => write!(f, "zone= in the directive, line {line}"),
            ZoneSource::Tz => f.write_str("TZ"),
            ZoneSource::LocalTime => f.write_str("/etc/localtime"),
            ZoneSource::Default => f.write_str("UTC by default: no CRON_TZ, TZ or /etc/localtime"),
            ZoneSource::Every => f.write_str("@every counts from the Unix epoch"),
        }
    }
}

/// Where the host's local zone is looked for: `TZ` in `env`, then the file `localtime` (a link
/// into a `zoneinfo` directory), then `timezone` beside it (Debian's `/etc/timezone`).
pub struct Host<'a> {
    pub env: &'a dyn Environment,
    pub localtime: &'a Path,
    pub timezone: &'a Path,
}

impl fmt::Debug for Host<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Host")
            .field("localtime", &self.localtime)
            .field("timezone", &self.timezone)
            .finish_non_exhaustive()
    }
}

impl Host<'_> {
    /// The real host: the process environment and `/etc`.
    pub fn real(env: &dyn Environment) -> Host<'_> {
        Host {
            env,
            localtime: Path::new("/etc/localtime"),
            timezone: Path::new("/etc/timezone"),
        }
    }

    /// The local zone and where it was found; an unknown or unnameable zone is an error that
    /// says where it was found.
    pub fn local_zone(&self) -> Result<(TimeZone, ZoneSource), String> {
        if let Some(tz) = self.env.var_os("TZ") {
            let tz = tz.to_string_lossy();
            // As Go's time package (and so supercronic) reads it: a leading ':' is dropped,
            // an empty value is UTC.
            let name = tz.strip_prefix(':').unwrap_or(&tz).trim();
            if name.is_empty() {
                return Ok((TimeZone::UTC, ZoneSource::Tz));
            }
            let named = if name.starts_with('/') {
                after_zoneinfo(name).ok_or_else(|| {
                    format!(
                        "TZ={tz:?}: a file outside a zoneinfo directory, whose zone pgleader \
                         cannot name (set TZ to a name such as Europe/Paris, or CRON_TZ in the \
                         crontab)"
                    )
                })?
            } else {
                name.to_owned()
            };
            let zone = named_zone(&named).map_err(|err| format!("TZ={tz:?}: {err}"))?;
            return Ok((zone, ZoneSource::Tz));
        }
        match std::fs::read_link(self.localtime) {
            Ok(target) => {
                let target = target.to_string_lossy();
                let name = after_zoneinfo(&target).ok_or_else(|| {
                    format!(
                        "{} links to {target:?}, outside a zoneinfo directory, so pgleader cannot \
                         name its zone (set TZ, or CRON_TZ in the crontab)",
                        self.localtime.display()
                    )
                })?;
                let zone = named_zone(&name).map_err(|err| {
                    format!("{} (links to {target:?}): {err}", self.localtime.display())
                })?;
                Ok((zone, ZoneSource::LocalTime))
            }
            Err(_) if !self.localtime.exists() => Ok((TimeZone::UTC, ZoneSource::Default)),
            Err(_) => {
                let named = std::fs::read_to_string(self.timezone).ok();
                let name = named
                    .as_deref()
                    .map(str::trim)
                    .filter(|name| !name.is_empty());
                let Some(name) = name else {
                    return Err(format!(
                        "{} is a copy of a zone file, not a link, and {} names no zone, so \
                         pgleader cannot name the local zone (set TZ, or CRON_TZ in the crontab)",
                        self.localtime.display(),
                        self.timezone.display()
                    ));
                };
                let zone = named_zone(name)
                    .map_err(|err| format!("{}: {err}", self.timezone.display()))?;
                Ok((zone, ZoneSource::LocalTime))
            }
        }
    }
}

/// A zone file's path, by its name: what follows `zoneinfo/` (`posix/` dropped: the same rules).
fn after_zoneinfo(path: &str) -> Option<String> {
    let (_, name) = path.rsplit_once("zoneinfo/")?;
    let name = name.strip_prefix("posix/").unwrap_or(name);
    (!name.is_empty()).then(|| name.to_owned())
}

/// A zone by name, its many names for UTC as one: a host's UTC (`Etc/UTC`, `UCT`, `Zulu`...)
/// and another's must define a job alike.
fn named_zone(name: &str) -> Result<TimeZone, String> {
    const UTC: [&str; 10] = [
        "UTC",
        "Etc/UTC",
        "UCT",
        "Etc/UCT",
        "Universal",
        "Etc/Universal",
        "Zulu",
        "Etc/Zulu",
        "Etc/GMT",
        "GMT",
    ];
    if UTC.contains(&name) {
        return Ok(TimeZone::UTC);
    }
    calendar::zone(name)
}
