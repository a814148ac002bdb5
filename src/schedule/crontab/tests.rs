//! The crontab reader's own cases: pgleader's forms, its directives and its errors.

use super::*;
use crate::environment::Environment;

/// A host whose only variable is `TZ`, if any.
pub struct Env(pub Option<&'static str>);

impl Environment for Env {
    fn var(&self, name: &str) -> Option<String> {
        self.0.filter(|_| name == "TZ").map(str::to_owned)
    }
    fn os_user(&self) -> Option<String> {
        None
    }
    fn socket_exists(&self, _: &Path) -> bool {
        false
    }
}

/// `text` read on a host with no `TZ` and no `/etc/localtime`: UTC by default.
pub fn parse(text: &str) -> Result<Crontab, CrontabError> {
    parse_on(text, &Env(None), Path::new("/nonexistent/localtime"))
}

pub fn parse_on(text: &str, env: &Env, localtime: &Path) -> Result<Crontab, CrontabError> {
    let host = Host {
        env,
        localtime,
        timezone: Path::new("/nonexistent/timezone"),
    };
    Crontab::parse(Path::new("crontab"), text, &host)
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
fn every_environment_line_applies_to_every_job_the_last_value_winning_as_in_supercronic() {
    let tab = parse(
        "CRON_TZ=Europe/Paris\n\
         GREETING = \"hello there\"\n\
         0 3 * * * echo $GREETING\n\
         SHELL=/bin/bash\n\
         CRON_TZ='America/New_York'\n\
         GREETING=bye\n\
         # pgleader: zone=Asia/Tokyo\n\
         0 4 * * * echo $GREETING\n",
    )
    .expect("parse");
    let [first, second] = tab.jobs.as_slice() else {
        panic!("two jobs")
    };
    assert_eq!(schedule(first), "0 0 3 * * * America/New_York");
    assert_eq!(first.zone_source, ZoneSource::CronTz { line: 5 });
    assert_eq!(first.shell, "/bin/bash");
    assert_eq!(
        first.env,
        vec![
            ("SHELL".into(), "/bin/bash".into()),
            ("CRON_TZ".into(), "America/New_York".into()),
            ("GREETING".into(), "bye".into()),
        ]
    );
    assert_eq!(second.env, first.env);
    // A zone of a job's own is said in its directive, which supercronic ignores.
    assert_eq!(schedule(second), "0 0 4 * * * Asia/Tokyo");
    assert_eq!(second.zone_source, ZoneSource::Directive { line: 7 });
    // Where cron would read the file otherwise, the reader says so.
    let notes: Vec<(usize, &str)> = tab
        .notes
        .iter()
        .map(|(line, note)| (*line, note.split(':').next().unwrap_or_default()))
        .collect();
    assert_eq!(
        notes,
        [
            (4, "SHELL is set below a job (line 3)"),
            (5, "CRON_TZ is set again (first on line 1)"),
            (6, "GREETING is set again (first on line 2)"),
        ]
    );
    assert!(
        tab.notes[1].1.contains("zone= in its pgleader directive"),
        "{:?}",
        tab.notes
    );
    // What the jobs see is one environment: a job's definition moves with it.
    let moved = parse("A=1\n0 3 * * * a\nB=2\n").expect("parse");
    let above = parse("A=1\nB=2\n0 3 * * * a\n").expect("parse");
    assert_eq!(moved.jobs[0].fingerprint(), above.jobs[0].fingerprint());
}

#[test]
fn with_no_cron_tz_the_schedules_are_read_in_the_local_zone() {
    let text = "0 3 * * * echo\n@every 1m echo every\n";
    let none = Path::new("/nonexistent/localtime");
    let tab = parse_on(text, &Env(Some("Europe/Paris")), none).expect("TZ");
    assert_eq!(schedule(&tab.jobs[0]), "0 0 3 * * * Europe/Paris");
    assert_eq!(tab.jobs[0].zone_source, ZoneSource::Tz);
    assert_eq!(schedule(&tab.jobs[1]), "@every 60s UTC");
    assert_eq!(tab.jobs[1].zone_source, ZoneSource::Every);
    // As Go reads TZ: a leading ':' is dropped; a path names the zone after zoneinfo/.
    for tz in [":Europe/Paris", "/usr/share/zoneinfo/Europe/Paris"] {
        let tab = parse_on(text, &Env(Some(tz)), none).expect(tz);
        assert_eq!(tab.jobs[0].when.timezone(), "Europe/Paris", "{tz}");
    }
    let dir = std::env::temp_dir().join(format!("pgleader-zone-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let link = dir.join("localtime");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink("/usr/share/zoneinfo/America/New_York", &link).expect("link");
    let tab = parse_on(text, &Env(None), &link).expect("localtime");
    assert_eq!(schedule(&tab.jobs[0]), "0 0 3 * * * America/New_York");
    assert_eq!(tab.jobs[0].zone_source, ZoneSource::LocalTime);
    // A host's UTC has many names; they define a job alike.
    std::fs::remove_file(&link).expect("unlink");
    std::os::unix::fs::symlink("../usr/share/zoneinfo/Etc/UTC", &link).expect("link");
    let utc = parse_on(text, &Env(None), &link).expect("localtime");
    let default = parse(text).expect("default");
    assert_eq!(utc.jobs[0].fingerprint(), default.jobs[0].fingerprint());
    assert_eq!(default.jobs[0].zone_source, ZoneSource::Default);
    // A copied zone file names no zone: refused, not guessed.
    std::fs::remove_file(&link).expect("unlink");
    std::fs::write(&link, b"TZif").expect("copy");
    let err = parse_on(text, &Env(None), &link).expect_err("copied");
    assert!(err.to_string().contains("not a link"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
    // An unknown TZ is an error naming it, unless CRON_TZ makes it irrelevant.
    let err = parse_on(text, &Env(Some("Mars/Olympus")), none).expect_err("unknown");
    assert_eq!(err.line, None);
    assert!(
        err.to_string()
            .contains("TZ=\"Mars/Olympus\": unknown time zone"),
        "{err}"
    );
    let fixed = format!("CRON_TZ=UTC\n{text}");
    assert!(parse_on(&fixed, &Env(Some("Mars/Olympus")), none).is_ok());
    // The zone is part of the definition: replicas whose zones differ show it.
    let paris = parse_on(text, &Env(Some("Europe/Paris")), none).expect("paris");
    assert_ne!(paris.jobs[0].fingerprint(), default.jobs[0].fingerprint());
    assert_ne!(
        paris.jobs[0].definition_marker(),
        default.jobs[0].definition_marker()
    );
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
fn jitter_is_an_option_of_the_definition_and_must_be_shorter_than_the_shortest_gap() {
    let tab = parse(
        "# pgleader: name=spread jitter=59s\n* * * * * a\n\
         # pgleader: name=plain\n* * * * * a\n\
         # pgleader: name=nightly jitter=2h\n0 3 * * * a\n",
    )
    .expect("parse");
    assert_eq!(tab.jobs[0].jitter, Some(Duration::from_secs(59)));
    assert_eq!(tab.jobs[1].jitter, None);
    // A definition that changes only its jitter changes; one without keeps its old marker.
    let without = parse("# pgleader: name=spread\n* * * * * a\n").expect("parse");
    assert_ne!(tab.jobs[0].fingerprint(), without.jobs[0].fingerprint());
    assert_eq!(
        tab.jobs[1].fingerprint(),
        parse("* * * * * a\n").expect("parse").jobs[0].fingerprint()
    );
    // The shortest gap, not the first: 00:00 and 00:01 every day leave a minute between.
    let err = parse("# pgleader: jitter=90s\n0,1 0 * * * a\n").expect_err("90 s > 1 min");
    assert!(err.to_string().contains("1m between"), "{err}");
    // A daylight-saving night's 23-hour day is the shortest gap of a daily job in Berlin.
    let err = parse("# pgleader: jitter=23h30m zone=Europe/Berlin\n30 12 * * * a\n")
        .expect_err("longer than the short day");
    assert!(err.to_string().contains("23h between"), "{err}");
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
        (
            "# pgleader: jitter=1m\n* * * * * a\n",
            2,
            "jitter=1m is not shorter than the 1m between two of the job's occurrences",
        ),
        ("# pgleader: jitter=soon\n* * * * * a\n", 1, "jitter=soon"),
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

#[test]
fn the_number_of_fields_is_decided_by_syntax_never_by_whether_the_schedule_occurs() {
    // Six fields, the year 2026, and the command `true`: read so even once 2026 is past, when
    // it never runs (not `0 0 1 1 *` running `2026 true` every 1 January).
    let tab = parse("0 0 1 1 * 2026 true\n11 1 31 2 * * echo never\n").expect("parse");
    assert_eq!(tab.jobs[0].when.expression(), "0 0 0 1 1 * 2026");
    assert_eq!(tab.jobs[0].command, "true");
    assert_eq!(tab.jobs[1].command, "echo never");
    let later: Timestamp = "2027-06-01T00:00:00Z".parse().expect("instant");
    let warnings = tab.warnings(later);
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(
        warnings[0].starts_with("crontab:1: job true never runs"),
        "{warnings:?}"
    );
    assert!(
        warnings[1].starts_with("crontab:2: job echo-never never runs"),
        "{warnings:?}"
    );
}

#[test]
fn full_names_and_a_start_with_a_step_are_read_as_supercronic_reads_them() {
    let tab = parse(
        "0 0 * * FRIDAY fri\n\
         0 0 1 january,March * jan\n\
         30 3 15W 3/3 * quarterly\n\
         0 0 * * mon/2 odd-days\n",
    )
    .expect("parse");
    let got: Vec<&str> = tab.jobs.iter().map(|job| job.when.expression()).collect();
    assert_eq!(
        got,
        [
            "0 0 0 * * FRI",
            "0 0 0 1 JAN,MAR *",
            "0 30 3 15W 3-12/3 *",
            "0 0 0 * * 1-6/2"
        ]
    );
    assert!(tab.notes.is_empty(), "{:?}", tab.notes);
    // From March, every third month, on the weekday nearest the 15th.
    let quarterly = &tab.jobs[2].when;
    let mut at: Timestamp = "2027-01-01T00:00:00Z".parse().expect("instant");
    let mut seen = Vec::new();
    for _ in 0..4 {
        at = quarterly.next_after(at).expect("next");
        seen.push(calendar::rfc3339(at));
    }
    assert_eq!(
        seen,
        [
            "2027-03-15T03:30:00Z",
            "2027-06-15T03:30:00Z",
            "2027-09-15T03:30:00Z",
            "2027-12-15T03:30:00Z"
        ]
    );
    // What pgleader read before keeps its canonical form, and so its definition.
    assert_eq!(
        parse("0 3 * * mon-fri x\n").expect("parse").jobs[0]
            .when
            .expression(),
        "0 0 3 * * MON-FRI"
    );
}
