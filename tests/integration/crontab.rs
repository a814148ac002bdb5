//! `pgleader cron --check`: a crontab read as supercronic reads it, each job printed with its
//! next occurrences in its own zone (daylight-saving nights included), and a bad file refused
//! with its name, line and what is wrong, before anything connects.

use std::path::PathBuf;

use crate::harness::{Proc, pgleader};

/// A crontab file of this test's own, removed when dropped.
pub struct File(pub PathBuf);

impl File {
    /// A file named after `name` and numbered: two tests that run one scenario at once (on
    /// PostgreSQL and on Redis) each have their own.
    pub fn new(name: &str, text: &str) -> File {
        static FILES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let number = FILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!(
            "pgleader-crontab-{}-{number}-{name}",
            std::process::id()
        ));
        std::fs::write(&path, text).expect("write the crontab");
        File(path)
    }
}

impl Drop for File {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `pgleader cron ARGS FILE` to its end: the exit code, stdout and stderr.
fn cron(file: &File, args: &[&str]) -> (i32, String, String) {
    let mut command = pgleader();
    command.arg("cron").args(args).arg(&file.0);
    let (status, stdout, stderr) = Proc::spawn("pgleader cron", command).finish();
    (
        status.code().expect("an exit code"),
        stdout.join("\n"),
        stderr.join("\n"),
    )
}

/// The occurrences `--check` lists for the only job of `text`, from `from`.
fn occurrences(text: &str, from: &str, count: &str) -> Vec<String> {
    let file = File::new("dst", text);
    let (code, stdout, stderr) = cron(&file, &["--check", "--from", from, "--next", count]);
    assert_eq!(code, 0, "{stderr}");
    stdout
        .lines()
        .skip_while(|line| !line.starts_with("  next"))
        .map(|line| line.trim_start_matches("  next").trim().to_owned())
        .collect()
}

#[test]
fn check_prints_each_job_with_its_schedule_zone_command_and_next_occurrences() {
    let file = File::new(
        "jobs",
        "# nightly work\n\
         MAILTO=\"\"\n\
         CRON_TZ=UTC\n\
         SHELL=/bin/bash\n\
         # pgleader: name=report overlap=replace catch-up=10m timeout=30m jitter=5m zone=Europe/Paris\n\
         30 3 * * * ./report.sh --all\n\
         \n\
         */15 * * * * 2099 echo quarter\n\
         @every 90s echo often\n\
         0 0 1 1 * 2026 true\n",
    );
    let (code, stdout, stderr) = cron(
        &file,
        &["--check", "--from", "2026-11-26T12:00:00Z", "--next", "2"],
    );
    assert_eq!(code, 0, "{stderr}");
    let expected = format!(
        "{path}: 4 jobs
warning: {path}:9: supercronic refuses @every, pgleader's own; pgleader reads it
warning: {path}:10: job true never runs: its schedule \"0 0 0 1 1 * 2026\" (UTC) has no occurrence after 2026-11-26T12:00:00Z (a past year, or a day no month has)

report (line 6)
  schedule  0 30 3 * * * in Europe/Paris (seconds first)
  zone      Europe/Paris (zone= in the directive, line 5)
  command   /bin/bash -c \"./report.sh --all\"
  options   overlap=replace catch-up=10m timeout=30m jitter=5m ping=none
  definition {}
  next      2026-11-27 03:30:00 +01:00, starts 03:32:59.128 (jitter)
            2026-11-28 03:30:00 +01:00, starts 03:34:29.558 (jitter)

echo-quarter (line 8)
  schedule  0 */15 * * * * 2099 in UTC (seconds first)
  zone      UTC (CRON_TZ, line 3)
  command   /bin/bash -c \"echo quarter\"
  options   overlap=skip catch-up=1h timeout=none jitter=none ping=none
  definition {}
  next      2099-01-01 00:00:00 +00:00
            2099-01-01 00:15:00 +00:00

echo-often (line 9)
  schedule  @every 1m 30s (from the Unix epoch, UTC)
  zone      UTC (@every counts from the Unix epoch)
  command   /bin/bash -c \"echo often\"
  options   overlap=skip catch-up=1h timeout=none jitter=none ping=none
  definition {}
  next      2026-11-26 12:01:30 +00:00
            2026-11-26 12:03:00 +00:00

true (line 10)
  schedule  0 0 0 1 1 * 2026 in UTC (seconds first)
  zone      UTC (CRON_TZ, line 3)
  command   /bin/bash -c \"true\"
  options   overlap=skip catch-up=1h timeout=none jitter=none ping=none
  definition {}
  next      none: it never occurs again, and never runs",
        definition(&file, "report"),
        definition(&file, "echo-quarter"),
        definition(&file, "echo-often"),
        definition(&file, "true"),
        path = file.0.display(),
    );
    assert_eq!(stdout, expected);
}

#[test]
fn with_no_cron_tz_the_local_zone_is_used_and_check_says_where_it_came_from() {
    let file = File::new("local", "SHELL=/bin/sh\n0 3 * * * echo local\nA=1\n");
    let check = |tz: &str| {
        let mut command = pgleader();
        command
            .env("TZ", tz)
            .args([
                "cron",
                "--check",
                "--from",
                "2026-11-26T12:00:00Z",
                "--next",
                "1",
            ])
            .arg(&file.0);
        let (status, stdout, stderr) = Proc::spawn("pgleader cron --check", command).finish();
        (
            status.code().expect("an exit code"),
            stdout.join("\n"),
            stderr.join("\n"),
        )
    };
    let (code, stdout, stderr) = check("America/New_York");
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.contains("  zone      America/New_York (TZ)\n"),
        "{stdout}"
    );
    assert!(
        stdout.contains("  next      2026-11-27 03:00:00 -05:00"),
        "{stdout}"
    );
    // A name set below a job: cron would not give it to the job above.
    assert!(
        stdout.contains(":3: A is set below a job (line 2): every job gets the last value"),
        "{stdout}"
    );
    let (code, stdout, stderr) = check("Mars/Olympus");
    assert_eq!(code, 2, "{stdout}");
    assert!(
        stderr.contains("TZ=\"Mars/Olympus\": unknown time zone"),
        "{stderr}"
    );
}

/// A job's definition as `pgleader status` shows it while replicas define it otherwise.
fn definition(file: &File, name: &str) -> String {
    use pgleader::schedule::crontab::{Crontab, definition_hex};
    let crontab = Crontab::read(&file.0).expect("the crontab");
    let job = crontab.jobs.iter().find(|job| job.name == name);
    definition_hex(job.expect("the job").definition_marker())
}

#[test]
fn a_time_that_a_spring_night_skips_runs_when_the_clock_has_jumped() {
    // Europe/Paris, 2027-03-28: 02:00 becomes 03:00; there is no 02:30 that night.
    let got = occurrences(
        "CRON_TZ=Europe/Paris\n30 2 * * * echo early\n",
        "2027-03-26T12:00:00Z",
        "3",
    );
    assert_eq!(
        got,
        [
            "2027-03-27 02:30:00 +01:00",
            "2027-03-28 03:00:00 +02:00",
            "2027-03-29 02:30:00 +02:00"
        ]
    );
}

#[test]
fn a_time_that_an_autumn_night_repeats_runs_once_and_an_hourly_job_runs_in_both_hours() {
    // Europe/Paris, 2027-10-31: 03:00 becomes 02:00 again; 02:30 happens twice that night.
    let daily = occurrences(
        "CRON_TZ=Europe/Paris\n30 2 * * * echo daily\n",
        "2027-10-29T12:00:00Z",
        "3",
    );
    assert_eq!(
        daily,
        [
            "2027-10-30 02:30:00 +02:00",
            "2027-10-31 02:30:00 +02:00",
            "2027-11-01 02:30:00 +01:00"
        ]
    );
    let hourly = occurrences(
        "CRON_TZ=Europe/Paris\n30 * * * * echo hourly\n",
        "2027-10-30T23:00:00Z",
        "4",
    );
    assert_eq!(
        hourly,
        [
            "2027-10-31 01:30:00 +02:00",
            "2027-10-31 02:30:00 +02:00",
            "2027-10-31 02:30:00 +01:00",
            "2027-10-31 03:30:00 +01:00"
        ]
    );
}

#[test]
fn a_bad_crontab_is_refused_with_its_file_line_and_what_is_wrong() {
    let cases = [
        ("0 3 * * * ok\n0 3 * *\n", ":2: not a job line"),
        (
            "CRON_TZ=Mars/Olympus\n0 3 * * * ok\n",
            ":1: unknown time zone \"Mars/Olympus\"",
        ),
        ("0 61 * * * nope\n", ":1: not a schedule: \"0 61 * * *\""),
        (
            "# pgleader: name=a\n0 3 * * * x\n# pgleader: name=a\n0 4 * * * y\n",
            ":4: two jobs are named \"a\" (lines 2 and 4)",
        ),
        (
            "# pgleader: jitter=2m\n* * * * * x\n",
            ":2: jitter=2m is not shorter than the 1m between two of the job's occurrences",
        ),
    ];
    for (text, wanted) in cases {
        let file = File::new("bad", text);
        for args in [&["--check"][..], &[][..]] {
            let (code, stdout, stderr) = cron(&file, args);
            assert_eq!(code, 2, "{text:?} {args:?}: {stderr}");
            assert!(
                stderr.contains(&format!("{}{wanted}", file.0.display())),
                "{text:?}: {stderr}"
            );
            assert!(stdout.is_empty(), "{stdout}");
        }
    }
    let missing = File("/nonexistent/crontab".into());
    let (code, _, stderr) = cron(&missing, &["--check"]);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("/nonexistent/crontab: cannot read the crontab"),
        "{stderr}"
    );
}

#[test]
fn a_redlock_quorum_is_refused_with_exit_2_before_anything_runs() {
    let plain = File::new("on-a-quorum", "0 3 * * * true\n");
    let (code, _, stderr) = cron(
        &plain,
        &[
            "--lock-id=1",
            "-d",
            "redis://127.0.0.1:1",
            "-d",
            "redis://127.0.0.1:2",
            "-d",
            "redis://127.0.0.1:3",
        ],
    );
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("a crontab across the fleet cannot run on a Redlock quorum"),
        "{stderr}"
    );
}
