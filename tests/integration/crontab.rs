//! `pgleader cron --check`: a crontab read as supercronic reads it, each job printed with its
//! next occurrences in its own zone (daylight-saving nights included), and a bad file refused
//! with its name, line and what is wrong, before anything connects.

use std::path::PathBuf;

use crate::harness::{Proc, pgleader};

/// A crontab file of this test's own, removed when dropped.
pub struct File(pub PathBuf);

impl File {
    pub fn new(name: &str, text: &str) -> File {
        let path =
            std::env::temp_dir().join(format!("pgleader-crontab-{}-{name}", std::process::id()));
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
         CRON_TZ=Europe/Paris\n\
         # pgleader: name=report overlap=replace catch-up=10m timeout=30m\n\
         30 3 * * * ./report.sh --all\n\
         \n\
         CRON_TZ=UTC\n\
         SHELL=/bin/bash\n\
         */15 * * * * 2099 echo quarter\n\
         @every 90s echo often\n",
    );
    let (code, stdout, stderr) = cron(
        &file,
        &["--check", "--from", "2026-11-26T12:00:00Z", "--next", "2"],
    );
    assert_eq!(code, 0, "{stderr}");
    let expected = format!(
        "{}: 3 jobs

report (line 5)
  schedule  0 30 3 * * * in Europe/Paris (seconds first)
  command   /bin/sh -c \"./report.sh --all\"
  options   overlap=replace catch-up=10m timeout=30m
  definition {}
  next      2026-11-27 03:30:00 +01:00
            2026-11-28 03:30:00 +01:00

echo-quarter (line 9)
  schedule  0 */15 * * * * 2099 in UTC (seconds first)
  command   /bin/bash -c \"echo quarter\"
  options   overlap=skip catch-up=1h timeout=none
  definition {}
  next      2099-01-01 00:00:00 +00:00
            2099-01-01 00:15:00 +00:00

echo-often (line 10)
  schedule  @every 1m 30s (from the Unix epoch, UTC)
  command   /bin/bash -c \"echo often\"
  options   overlap=skip catch-up=1h timeout=none
  definition {}
  next      2026-11-26 12:01:30 +00:00
            2026-11-26 12:03:00 +00:00",
        file.0.display(),
        definition(&file, "report"),
        definition(&file, "echo-quarter"),
        definition(&file, "echo-often"),
    );
    assert_eq!(stdout, expected);
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
