//! When a scheduled command runs: a cron expression read in an IANA time zone, and the
//! occurrences it gives on the absolute time line (UTC instants).
//!
//! The definition is put in one canonical form (six fields, seconds first, nicknames spelled
//! out, names in capitals) so that replicas that wrote the same schedule differently
//! (`@daily`, `0 0 * * *`, `0  0 0 * * *`) agree, and so that the ledger and the fingerprint in
//! each session's `application_name` compare like with like. Time-zone rules come from the tz
//! database compiled into pgleader (jiff's bundled copy, stored compressed and read on demand),
//! never from the host: every replica with the same pgleader version computes the same
//! instants, containers without `/usr/share/zoneinfo` included.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, LazyLock, Mutex, OnceLock, PoisonError, Weak};
use std::time::Duration;

use croner::Cron;
use croner::parser::{CronParser, Seconds};
use jiff::tz::{TimeZone, TimeZoneDatabase};
use jiff::{Timestamp, Zoned};

use crate::election::lock::LockKey;
pub use crate::time::rfc3339;

/// A schedule: when, and in which zone's wall clock.
#[derive(Clone, Debug)]
pub struct Schedule {
    rule: Rule,
    expression: String,
    timezone: TimeZone,
    /// The zone's IANA name, as the tz database spells it.
    zone_name: String,
}

/// What gives the occurrences.
#[derive(Clone, Debug)]
enum Rule {
    /// A cron expression, on the zone's wall clock. Shared: a parsed expression is about 5 KB
    /// (a year field is a table of every year), and a crontab's jobs keep several copies of
    /// their schedules (the definition, the owned runs, what status shows).
    Cron(Arc<Cron>),
    /// Every this many seconds, counted from the Unix epoch (a crontab's `@every`): the same
    /// instants on every replica, whatever the zone.
    Every(u64),
}

/// The parsed form of a canonical cron expression, shared by every schedule alive with the
/// same expression: a crontab of 1,000 jobs on a few schedules keeps a few parsed forms, not
/// 1,000 (about 5 KB each).
fn parsed(expression: &str) -> Result<Arc<Cron>, String> {
    static PARSED: LazyLock<Mutex<HashMap<String, Weak<Cron>>>> = LazyLock::new(Default::default);
    let mut parsed = PARSED.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(cron) = parsed.get(expression).and_then(Weak::upgrade) {
        return Ok(cron);
    }
    let cron = CronParser::builder()
        .seconds(Seconds::Required)
        .build()
        .parse(expression)
        .map_err(|err| {
            format!("{err} (expected a cron expression such as \"0 3 * * *\" or @daily)")
        })?;
    let cron = Arc::new(cron);
    // Those no schedule uses any more go as a new one comes.
    parsed.retain(|_, cron| cron.strong_count() > 0);
    parsed.insert(expression.to_owned(), Arc::downgrade(&cron));
    Ok(cron)
}

impl PartialEq for Schedule {
    fn eq(&self, other: &Self) -> bool {
        self.expression == other.expression && self.zone_name == other.zone_name
    }
}

/// The tz database compiled into pgleader.
fn zones() -> &'static TimeZoneDatabase {
    static ZONES: OnceLock<TimeZoneDatabase> = OnceLock::new();
    ZONES.get_or_init(TimeZoneDatabase::bundled)
}

/// A time zone by its IANA name (`Europe/Paris`, or `UTC`), from the tz database compiled into
/// pgleader.
pub fn zone(name: &str) -> Result<TimeZone, String> {
    zones().get(name.trim()).map_err(|_| {
        format!(
            "unknown time zone {:?} (expected an IANA name such as UTC, Europe/Paris or America/New_York)",
            name.trim()
        )
    })
}

impl Schedule {
    /// Parses a cron expression (five fields, six with seconds first, or `@hourly`, `@daily`,
    /// `@weekly`, `@monthly`, `@yearly`) read in `timezone` (an IANA name such as
    /// `Europe/Paris`, or `UTC`).
    pub fn parse(expression: &str, timezone: &str) -> Result<Schedule, String> {
        let timezone = zone(timezone)?;
        let schedule = Schedule::from_canonical(canonical(expression)?, timezone)?;
        // A `--schedule` that never runs is a mistake to say at once; a crontab line is another
        // matter (supercronic accepts it, and `--check` warns of it).
        if !schedule.occurs_after(Timestamp::now()) {
            return Err("this schedule never matches a future time".into());
        }
        Ok(schedule)
    }

    /// A crontab line's schedule, as `crontab.rs` read it: seven fields, seconds first and
    /// year last (a year of `*` leaves the canonical form at six fields, as `--schedule`'s).
    /// One that never occurs again is a schedule all the same, as it is for supercronic.
    pub fn from_crontab_fields(fields: [&str; 7], timezone: TimeZone) -> Result<Schedule, String> {
        let fields = match fields {
            [seconds, minute, hour, day, month, weekday, "*"] => {
                vec![seconds, minute, hour, day, month, weekday]
            }
            all => all.to_vec(),
        };
        Schedule::from_canonical(fields.join(" ").to_ascii_uppercase(), timezone)
    }

    /// A crontab's `@every DURATION`: every multiple of `every` (whole seconds, at least one)
    /// since the Unix epoch, in UTC.
    pub fn every(every: Duration) -> Result<Schedule, String> {
        if every < Duration::from_secs(1) || every.subsec_nanos() != 0 {
            return Err("@every counts whole seconds, at least 1s".into());
        }
        let seconds = every.as_secs();
        Ok(Schedule {
            rule: Rule::Every(seconds),
            expression: format!("@every {seconds}s"),
            timezone: TimeZone::UTC,
            zone_name: "UTC".to_owned(),
        })
    }

    /// A schedule as the ledger records it (`Definition`: its canonical expression and zone):
    /// what `--schedule` wrote (six fields), or a crontab job's (seven fields, year last, or
    /// `@every Ns`). `status` reads a crontab fleet's jobs this way, knowing no file.
    pub fn recorded(expression: &str, timezone: &str) -> Result<Schedule, String> {
        if let Some(seconds) = expression
            .strip_prefix("@every ")
            .and_then(|every| every.strip_suffix('s'))
        {
            let seconds: u64 = seconds
                .parse()
                .map_err(|_| format!("not a recorded schedule: {expression:?}"))?;
            return Schedule::every(Duration::from_secs(seconds));
        }
        let fields: Vec<&str> = expression.split_whitespace().collect();
        match <[&str; 7]>::try_from(fields) {
            Ok(seven) => Schedule::from_crontab_fields(seven, zone(timezone)?),
            Err(_) => Schedule::parse(expression, timezone),
        }
    }

    /// How long one period of the schedule is, seen from `at`: the time between its next
    /// occurrence and the one after (`@every`: its period). What an alert compares a job's
    /// last success with.
    pub fn period_at(&self, at: Timestamp) -> Option<Duration> {
        self.period()
            .or_else(|| self.gap_after(self.next_after(at)?))
    }

    /// For `@every`: the period.
    pub fn period(&self) -> Option<Duration> {
        match self.rule {
            Rule::Every(seconds) => Some(Duration::from_secs(seconds)),
            Rule::Cron(_) => None,
        }
    }

    fn from_canonical(expression: String, timezone: TimeZone) -> Result<Schedule, String> {
        let zone_name = timezone.iana_name().unwrap_or("UTC").to_owned();
        Ok(Schedule {
            rule: Rule::Cron(parsed(&expression)?),
            expression,
            timezone,
            zone_name,
        })
    }

    /// The same schedule on another zone's wall clock (`@every` keeps counting in UTC).
    pub fn in_zone(&self, timezone: TimeZone) -> Schedule {
        match self.rule {
            Rule::Every(_) => self.clone(),
            Rule::Cron(_) => Schedule {
                zone_name: timezone.iana_name().unwrap_or("UTC").to_owned(),
                timezone,
                ..self.clone()
            },
        }
    }

    /// Whether the schedule has an occurrence after `at`: a crontab line of a past year, or of
    /// 31 February, has none, and its job never runs.
    pub fn occurs_after(&self, at: Timestamp) -> bool {
        self.next_after(at).is_some()
    }

    /// The canonical expression: six fields, seconds first (seven, year last, for a crontab
    /// line that names years).
    pub fn expression(&self) -> &str {
        &self.expression
    }

    /// The IANA name of the time zone.
    pub fn timezone(&self) -> &str {
        &self.zone_name
    }

    /// Eight hex digits that identify the definition (expression and zone), shown in each
    /// session's `application_name` so that a leader can see whether the replicas waiting
    /// behind it agree with it. The hash is PostgreSQL's `hashtextextended`, so it can be
    /// computed in SQL too.
    pub fn fingerprint(&self) -> String {
        fingerprint_of(&self.expression, self.timezone())
    }

    /// The latest occurrence at or before `at`.
    pub fn latest_at_or_before(&self, at: Timestamp) -> Option<Timestamp> {
        match &self.rule {
            Rule::Cron(cron) => cron
                .find_previous_occurrence(&self.local(at)?, true)
                .ok()
                .map(|found| found.timestamp())
                .filter(|found| *found <= at),
            Rule::Every(seconds) => {
                let step = i64::try_from(*seconds).ok()?;
                Timestamp::from_second(at.as_second().div_euclid(step).checked_mul(step)?).ok()
            }
        }
    }

    /// The first occurrence strictly after `at`.
    pub fn next_after(&self, at: Timestamp) -> Option<Timestamp> {
        match &self.rule {
            Rule::Cron(cron) => cron
                .find_next_occurrence(&self.local(at)?, false)
                .ok()
                .map(|found| found.timestamp())
                .filter(|found| *found > at),
            Rule::Every(seconds) => {
                let step = i64::try_from(*seconds).ok()?;
                let next = (at.as_second().div_euclid(step) + 1).checked_mul(step)?;
                Timestamp::from_second(next).ok()
            }
        }
    }

    /// An instant on this schedule's wall clock.
    pub fn local(&self, at: Timestamp) -> Option<Zoned> {
        Some(at.to_zoned(self.timezone.clone()))
    }

    /// The shortest time between two occurrences among the next [`GAPS_LOOKED_AT`] after
    /// `from` (`@every`: its period); `None` if it occurs less than twice more. A year of a
    /// daily schedule, so that a daylight-saving night's short day counts.
    pub fn shortest_gap(&self, from: Timestamp) -> Option<Duration> {
        if let Some(period) = self.period() {
            return Some(period);
        }
        let mut at = self.next_after(from)?;
        let mut shortest: Option<Duration> = None;
        for _ in 0..GAPS_LOOKED_AT {
            let Some(next) = self.next_after(at) else {
                break;
            };
            let gap = Duration::try_from(next.duration_since(at)).unwrap_or_default();
            shortest = Some(shortest.map_or(gap, |shortest| shortest.min(gap)));
            at = next;
        }
        shortest
    }

    /// The time from `occurrence` to the one after it, if there is one.
    pub fn gap_after(&self, occurrence: Timestamp) -> Option<Duration> {
        let next = self.next_after(occurrence)?;
        Duration::try_from(next.duration_since(occurrence)).ok()
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{}\" ({})", self.expression, self.zone_name)
    }
}

/// How many gaps between occurrences [`Schedule::shortest_gap`] looks at.
const GAPS_LOOKED_AT: usize = 400;

/// The fingerprint of a definition as the ledger stores it; see [`Schedule::fingerprint`].
pub fn fingerprint_of(expression: &str, timezone: &str) -> String {
    let key = LockKey::from_name(&format!("{expression} {timezone}")).key();
    format!("{:08x}", (key as u64) as u32)
}

/// Six fields, seconds first, nicknames spelled out, single spaces, names in capitals.
fn canonical(expression: &str) -> Result<String, String> {
    let trimmed = expression.trim();
    if trimmed.is_empty() {
        return Err(
            "the schedule is empty (expected a cron expression such as \"0 3 * * *\")".into(),
        );
    }
    let spelled = match trimmed.to_ascii_lowercase().as_str() {
        "@yearly" | "@annually" => "0 0 1 1 *".to_owned(),
        "@monthly" => "0 0 1 * *".to_owned(),
        "@weekly" => "0 0 * * SUN".to_owned(),
        "@daily" | "@midnight" => "0 0 * * *".to_owned(),
        "@hourly" => "0 * * * *".to_owned(),
        other if other.starts_with('@') => {
            return Err(format!(
                "unknown nickname {trimmed:?} (expected @hourly, @daily, @weekly, @monthly or @yearly)"
            ));
        }
        _ => trimmed.to_owned(),
    };
    let fields: Vec<&str> = spelled.split_whitespace().collect();
    let fields = match fields.len() {
        5 => std::iter::once("0").chain(fields).collect::<Vec<_>>(),
        6 => fields,
        n => {
            return Err(format!(
                "a cron expression has five fields (minute hour day month weekday), or six with \
                 seconds first; {trimmed:?} has {n}"
            ));
        }
    };
    Ok(fields.join(" ").to_ascii_uppercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_alike_share_one_parsed_expression() {
        let fields = ["0", "0", "0", "1", "1", "*", "*"];
        let a = Schedule::from_crontab_fields(fields, TimeZone::UTC).expect("a schedule");
        let b = Schedule::from_crontab_fields(fields, TimeZone::UTC).expect("a schedule");
        let c = Schedule::from_crontab_fields(["0", "0", "1", "1", "1", "*", "*"], TimeZone::UTC)
            .expect("a schedule");
        let cron = |s: &Schedule| match &s.rule {
            Rule::Cron(cron) => Arc::clone(cron),
            Rule::Every(_) => panic!("a cron expression"),
        };
        assert!(Arc::ptr_eq(&cron(&a), &cron(&b)));
        assert!(!Arc::ptr_eq(&cron(&a), &cron(&c)));
        assert_ne!(a, c);
    }

    fn utc(text: &str) -> Timestamp {
        text.parse().expect("date")
    }

    #[test]
    fn what_the_ledger_records_is_read_back() {
        let daily = Schedule::parse("30 3 * * *", "Europe/Paris").expect("daily");
        let every = Schedule::every(Duration::from_secs(90)).expect("every");
        let seven = Schedule::from_crontab_fields(
            ["0", "0", "3", "*", "*", "*", "2099"],
            zone("UTC").expect("utc"),
        )
        .expect("seven");
        for schedule in [daily, every, seven] {
            let read =
                Schedule::recorded(schedule.expression(), schedule.timezone()).expect("recorded");
            assert_eq!(read, schedule);
            let at = utc("2027-01-10T12:00:00Z");
            assert_eq!(read.next_after(at), schedule.next_after(at));
        }
        let daily = Schedule::recorded("0 30 3 * * *", "UTC").expect("daily");
        assert_eq!(
            daily.period_at(utc("2027-01-10T12:00:00Z")),
            Some(Duration::from_secs(86_400))
        );
        assert!(Schedule::recorded("@every soon", "UTC").is_err());
    }

    #[test]
    fn every_counts_whole_periods_from_the_unix_epoch() {
        let every = Schedule::every(Duration::from_secs(90)).expect("every");
        assert_eq!(every.expression(), "@every 90s");
        assert_eq!(every.timezone(), "UTC");
        assert_eq!(every.period(), Some(Duration::from_secs(90)));
        let at = utc("2026-11-26T12:00:00Z");
        assert_eq!(every.next_after(at), Some(utc("2026-11-26T12:01:30Z")));
        assert_eq!(
            every.latest_at_or_before(utc("2026-11-26T12:01:29Z")),
            Some(at)
        );
        assert_eq!(
            every.latest_at_or_before(utc("2026-11-26T12:01:30Z")),
            Some(utc("2026-11-26T12:01:30Z"))
        );
        assert_eq!(every.gap_after(at), Some(Duration::from_secs(90)));
        assert!(Schedule::every(Duration::from_millis(1500)).is_err());
        assert!(Schedule::every(Duration::ZERO).is_err());
    }

    #[test]
    fn equivalent_spellings_share_one_definition() {
        let daily = Schedule::parse("@daily", "UTC").expect("parse");
        let five = Schedule::parse("0 0 * * *", "UTC").expect("parse");
        let six = Schedule::parse(" 0  0 0 * * * ", "UTC").expect("parse");
        assert_eq!(daily.expression(), "0 0 0 * * *");
        assert_eq!(daily, five);
        assert_eq!(five, six);
        assert_eq!(daily.fingerprint(), six.fingerprint());
        let paris = Schedule::parse("@daily", "Europe/Paris").expect("parse");
        assert_ne!(daily, paris);
        assert_ne!(daily.fingerprint(), paris.fingerprint());
        assert_eq!(
            Schedule::parse("0 3 * * mon", "UTC")
                .expect("parse")
                .expression(),
            "0 0 3 * * MON"
        );
    }

    #[test]
    fn bad_input_names_the_problem() {
        assert!(
            Schedule::parse("every day", "UTC")
                .expect_err("refused")
                .contains("five fields")
        );
        assert!(
            Schedule::parse("@often", "UTC")
                .expect_err("refused")
                .contains("nickname")
        );
        assert!(
            Schedule::parse("0 3 * * *", "Mars/Olympus")
                .expect_err("refused")
                .contains("time zone")
        );
        assert!(
            Schedule::parse("0 0 30 2 *", "UTC")
                .expect_err("refused")
                .contains("never matches")
        );
        assert!(Schedule::parse("61 * * * *", "UTC").is_err());
        assert!(
            Schedule::parse("", "UTC")
                .expect_err("refused")
                .contains("empty")
        );
    }

    #[test]
    fn occurrences_are_instants_in_the_zone_given() {
        let nightly = Schedule::parse("0 3 * * *", "Europe/Paris").expect("parse");
        // 03:00 in Paris is 02:00 UTC in winter.
        let at = utc("2026-11-22T12:00:00Z");
        assert_eq!(
            nightly.latest_at_or_before(at),
            Some(utc("2026-11-22T02:00:00Z"))
        );
        assert_eq!(nightly.next_after(at), Some(utc("2026-11-23T02:00:00Z")));
        // Inclusive at the occurrence itself, and below a second too.
        let on = utc("2026-11-23T02:00:00Z");
        assert_eq!(nightly.latest_at_or_before(on), Some(on));
        assert_eq!(
            nightly.latest_at_or_before(on + jiff::SignedDuration::from_millis(400)),
            Some(on)
        );
        assert_eq!(
            nightly.latest_at_or_before(on - jiff::SignedDuration::from_millis(1)),
            Some(utc("2026-11-22T02:00:00Z"))
        );
        assert_eq!(nightly.next_after(on), Some(utc("2026-11-24T02:00:00Z")));
        assert_eq!(
            nightly.next_after(on - jiff::SignedDuration::from_millis(1)),
            Some(on)
        );
        assert_eq!(nightly.gap_after(on), Some(Duration::from_secs(86_400)));
    }

    #[test]
    fn seconds_schedules_and_daylight_saving_time() {
        let every_two = Schedule::parse("*/2 * * * * *", "UTC").expect("parse");
        let at = utc("2026-11-22T12:00:01.500Z");
        assert_eq!(
            every_two.latest_at_or_before(at),
            Some(utc("2026-11-22T12:00:00Z"))
        );
        assert_eq!(every_two.next_after(at), Some(utc("2026-11-22T12:00:02Z")));
        // 02:30 does not exist in Paris on 2026-03-29; the day after, it is 00:30 UTC.
        let half_past_two = Schedule::parse("30 2 * * *", "Europe/Paris").expect("parse");
        let after = half_past_two
            .next_after(utc("2026-03-29T00:00:00Z"))
            .expect("next");
        assert!(after > utc("2026-03-29T00:00:00Z"), "{after}");
        assert_eq!(
            half_past_two.next_after(utc("2026-03-30T00:00:00Z")),
            // 02:30 in Paris, summer time (UTC+2).
            Some(utc("2026-03-30T00:30:00Z"))
        );
    }

    #[test]
    fn instants_print_as_rfc3339_utc() {
        assert_eq!(rfc3339(utc("2026-11-23T03:00:00Z")), "2026-11-23T03:00:00Z");
    }

    #[test]
    fn a_wall_time_that_happens_twice_is_one_occurrence_for_a_daily_job() {
        // 01:30 happens twice in New York on 2026-11-01 (05:30Z in EDT, 06:30Z in EST).
        let daily = Schedule::parse("30 1 * * *", "America/New_York").expect("parse");
        let (mut at, end) = (utc("2026-11-01T04:00:00Z"), utc("2026-11-01T12:00:00Z"));
        let mut seen = Vec::new();
        while let Some(next) = daily.next_after(at).filter(|next| *next < end) {
            seen.push(next);
            at = next;
        }
        assert_eq!(seen.len(), 1, "{seen:?}");
    }

    #[test]
    fn an_hourly_job_runs_in_both_copies_of_the_repeated_hour() {
        let hourly = Schedule::parse("30 * * * *", "America/New_York").expect("parse");
        let mut at = utc("2026-11-01T04:00:00Z");
        let mut seen = Vec::new();
        for _ in 0..4 {
            at = hourly.next_after(at).expect("next");
            seen.push(at);
        }
        let expected =
            ["04:30", "05:30", "06:30", "07:30"].map(|time| utc(&format!("2026-11-01T{time}:00Z")));
        assert_eq!(seen, expected);
    }

    #[test]
    fn a_wall_time_that_does_not_exist_runs_when_the_clock_has_moved_on_as_in_cron() {
        // 02:30 does not exist in New York on 2026-03-08: it runs at 03:00 EDT (07:00Z).
        let s = Schedule::parse("30 2 * * *", "America/New_York").expect("parse");
        assert_eq!(
            s.next_after(utc("2026-03-08T05:00:00Z")),
            Some(utc("2026-03-08T07:00:00Z"))
        );
    }
}
