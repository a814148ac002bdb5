//! Bad input and connection problems: a clear message, a documented exit code, no secret
//! printed, no lock ever taken.

use std::os::unix::fs::PermissionsExt;

use crate::harness::cluster::SECRET_PASSWORD;
use crate::harness::pg::assert_password_hidden;
use crate::harness::{Cluster, Proc, pgleader, unique_lock};

fn pgleader_with(name: &str, url: Option<&str>, args: &[&str]) -> Proc {
    let mut command = pgleader();
    if let Some(url) = url {
        command.env("PGLEADER_DATABASE_URL", url);
    }
    command.args(args);
    Proc::spawn(name, command)
}

/// The outcome of the plainest run through `url`, `pgleader run --lock-id 1 -- true`: for
/// what connecting does.
fn run_true(url: &str) -> (i32, String) {
    outcome(Some(url), &["run", "--lock-id", "1", "--", "true"])
}

/// Runs pgleader to its end; returns the exit code and everything it printed on stderr.
pub fn outcome(url: Option<&str>, args: &[&str]) -> (i32, String) {
    let process = pgleader_with("pgleader", url, args);
    let (status, _, stderr) = process.finish();
    (status.code().expect("an exit code"), stderr.join("\n"))
}

#[test]
fn bad_arguments_are_usage_errors_that_say_what_is_wrong() {
    let url = Some("postgres://postgres@127.0.0.1:1/postgres");
    let cases: &[(&[&str], &str)] = &[
        (
            &["run", "--lock-id", "abc", "--", "true"],
            "invalid value 'abc' for '--lock-id <ID>'",
        ),
        (
            &["run", "--lock-id", "99999999999999999999", "--", "true"],
            "--lock-id",
        ),
        (
            &["run", "--lock-id", "1", "--lock", "x", "--", "true"],
            "cannot be used with",
        ),
        (
            &["run", "--", "true"],
            "give --lock-id <ID> or --lock <NAME>",
        ),
        (
            &["run", "--lock", "", "--", "true"],
            "the lock name must not be empty",
        ),
        (&["run", "--lock-id", "1"], "<COMMAND>"),
        (
            &[
                "run",
                "--lock-id",
                "1",
                "--check-interval",
                "soon",
                "--",
                "true",
            ],
            "expected a duration",
        ),
        (
            &[
                "run",
                "--lock-id",
                "1",
                "--check-timeout",
                "0s",
                "--",
                "true",
            ],
            "must be greater than 0",
        ),
        (
            &[
                "run",
                "--lock-id",
                "1",
                "--kill-signal",
                "NOPE",
                "--",
                "true",
            ],
            "unknown signal",
        ),
        (
            &["run", "--lock-id", "1", "--lease", "2s", "--", "true"],
            "--lease 2s is too short",
        ),
        (
            &[
                "run",
                "--lock-id",
                "1",
                "--wait-refresh",
                "50ms",
                "--",
                "true",
            ],
            "'--wait-refresh <DURATION>': must be 0 or at least 100ms",
        ),
        (
            &[
                "run",
                "--lock-id",
                "1",
                "--busy-exit-code",
                "300",
                "--",
                "true",
            ],
            "--busy-exit-code",
        ),
        (
            &[
                "run",
                "--lock-id",
                "1",
                "--once",
                "--relinquish-after",
                "1s",
                "--",
                "true",
            ],
            "cannot be used with",
        ),
        (
            &[
                "run",
                "--lock-id",
                "1",
                "--relinquish-schedule",
                "every day",
                "--",
                "true",
            ],
            "expected a cron expression",
        ),
        (
            &[
                "run",
                "--lock-id",
                "1",
                "--relinquish-schedule",
                "0 0 30 2 *",
                "--",
                "true",
            ],
            "never matches",
        ),
        (&["frobnicate"], "unrecognized subcommand"),
    ];
    for (args, expected) in cases {
        let (code, stderr) = outcome(url, args);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(
            stderr.contains(expected),
            "{args:?}: expected {expected:?} in:\n{stderr}"
        );
    }
}

#[test]
fn an_unknown_option_before_the_command_is_a_usage_error_that_suggests_the_real_one() {
    let url = Some("postgres://postgres@127.0.0.1:1/postgres");
    // Each case's arguments, split at spaces.
    let cases: &[(&str, &str, Option<&str>)] = &[
        (
            "run --lock-id 1 --kill-timout 5s -- ./nightly-job.sh",
            "--kill-timout",
            Some("--kill-timeout"),
        ),
        (
            "run --lock-id 1 --kill-timout 5s ./nightly-job.sh",
            "--kill-timout",
            Some("--kill-timeout"),
        ),
        (
            "run --lock-id 1 --kill-timeout=5s --onse true",
            "--onse",
            Some("--once"),
        ),
        ("run --lock-id 1 -x -- true", "-x", None),
        ("run --frobnicate --lock-id 1 true", "--frobnicate", None),
        ("status --lock-id 1 --jsn", "--jsn", Some("--json")),
        ("status --lock-id 1 -x", "-x", None),
    ];
    for (args, unknown, suggestion) in cases {
        let args: Vec<&str> = args.split(' ').collect();
        let (code, stderr) = outcome(url, &args);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(
            stderr.contains(&format!("unexpected argument '{unknown}'")),
            "{args:?}: the unknown option is not named:\n{stderr}"
        );
        if let Some(suggestion) = suggestion {
            assert!(
                stderr.contains(&format!("a similar argument exists: '{suggestion}'")),
                "{args:?}: {suggestion} is not suggested:\n{stderr}"
            );
        }
        assert!(
            !stderr.contains("command not found"),
            "{args:?}: taken for the command:\n{stderr}"
        );
    }
}

#[test]
fn everything_from_the_commands_first_word_on_goes_to_the_command_untouched() {
    let cluster = Cluster::shared();
    let lock = unique_lock().to_string();
    // pgleader's own options, unknown options, a second `--` and --help: all the command's.
    let script = r#"printf '[%s]' "$@"; echo"#;
    let passed = ["-v", "x", "--kill-timout", "5s", "--", "--help", "-q"];
    let expected = "[-v][x][--kill-timout][5s][--][--help][-q]";
    for escape in [true, false] {
        let mut args = vec!["run", "--once", "--lock-id", &lock];
        if escape {
            args.push("--");
        }
        args.extend(["sh", "-c", script, "sh"]);
        args.extend(passed);
        let process = pgleader_with("pass-through", Some(&cluster.url()), &args);
        let (status, stdout, stderr) = process.finish();
        // Had pgleader also taken -v and -q, they would conflict: a usage error.
        assert_eq!(status.code(), Some(0), "{args:?}: {stderr:?}");
        assert_eq!(stdout, [expected], "{args:?}: {stderr:?}");
    }
}

#[test]
fn negative_lock_ids_are_accepted_with_or_without_an_equals_sign() {
    let cluster = Cluster::shared();
    let key = -(unique_lock());
    for args in [
        vec![
            "run".to_owned(),
            "--once".into(),
            "--lock-id".into(),
            key.to_string(),
            "--".into(),
            "true".into(),
        ],
        vec![
            "run".to_owned(),
            "--once".into(),
            format!("--lock-id={key}"),
            "--".into(),
            "true".into(),
        ],
    ] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, stderr) = outcome(Some(&cluster.url()), &args);
        assert_eq!(code, 0, "{stderr}");
        assert!(stderr.contains(&format!("lock={key}")), "{stderr}");
    }
}

#[test]
fn a_bad_connection_string_is_a_usage_error_that_never_prints_the_password() {
    for url in [
        "postgres://user:hunter2@host:99999/db",
        "postgres://user:hunter2/x@host/db",
        "host=h password=hunter2 horse=battery",
        "postgres://user:hunter2%zz@host/db",
        "host=h password='hunter2",
        "host=h password=hunter2 sslcrl=/x",
    ] {
        let (code, stderr) = run_true(url);
        assert_eq!(code, 2, "{url}: {stderr}");
        assert_password_hidden(&stderr, "hunter2");
    }
}

#[test]
fn a_missing_command_fails_with_127_before_connecting() {
    let cluster = Cluster::shared();
    // After `--`, a first word that starts with `-` is the command, looked up like any other.
    for command in [
        "no-such-command-for-pgleader",
        "-no-such-command-for-pgleader",
    ] {
        let (code, stderr) = outcome(
            Some(&cluster.url()),
            &["run", "--lock-id", "1", "--", command],
        );
        assert_eq!(code, 127, "{stderr}");
        assert!(
            stderr.contains(&format!("command not found: {command}")),
            "{stderr}"
        );
        assert!(
            !stderr.contains("connected"),
            "it connected before checking the command:\n{stderr}"
        );
    }
}

#[test]
fn a_command_that_cannot_be_executed_fails_with_126() {
    let path = std::env::temp_dir().join(format!("pgleader-not-executable-{}", std::process::id()));
    std::fs::write(&path, "#!/bin/sh\necho hi\n").expect("write");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let cluster = Cluster::shared();
    let (code, stderr) = outcome(
        Some(&cluster.url()),
        &["run", "--lock-id", "1", "--", path.to_str().expect("utf-8")],
    );
    assert_eq!(code, 126, "{stderr}");
    assert!(stderr.contains("permission denied"), "{stderr}");
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_wrong_password_stops_at_once_and_is_never_printed() {
    let cluster = Cluster::shared();
    let url = cluster.url_as_secret_user(&format!("not-{SECRET_PASSWORD}"));
    let (code, stderr) = run_true(&url);
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("password authentication failed"),
        "{stderr}"
    );
    assert_password_hidden(&stderr, SECRET_PASSWORD);
    assert!(
        !stderr.contains("retrying"),
        "a permanent error was retried:\n{stderr}"
    );

    let right = cluster.url_as_secret_user(SECRET_PASSWORD);
    let (code, stderr) = outcome(
        Some(&right),
        &["run", "--once", "--lock-id", "1", "--", "true"],
    );
    assert_eq!(code, 0, "{stderr}");
    assert_password_hidden(&stderr, SECRET_PASSWORD);
}

#[test]
fn channel_binding_require_is_honoured_and_gssencmode_require_refused() {
    let cluster = Cluster::shared();
    // Trust authentication has no SCRAM exchange to bind: insisting on binding must fail.
    let url = format!("{}?channel_binding=require", cluster.url());
    let (code, stderr) = run_true(&url);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("channel binding"), "{stderr}");
    let url = format!("{}?gssencmode=require", cluster.url());
    let (code, stderr) = run_true(&url);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("gssencmode=require"), "{stderr}");
}

#[test]
fn a_missing_database_stops_at_once() {
    let cluster = Cluster::shared();
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/no_such_database",
        cluster.port
    );
    let (code, stderr) = run_true(&url);
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("database \"no_such_database\" does not exist"),
        "{stderr}"
    );
}

#[test]
fn an_unreachable_database_is_retried_with_backoff_until_shutdown() {
    // Nothing listens on port 1.
    let url = "postgres://postgres@127.0.0.1:1/postgres";
    let (code, stderr) = outcome(
        Some(url),
        &["run", "--no-wait", "--lock-id", "1", "--", "true"],
    );
    assert_eq!(code, 1, "--no-wait tries once:\n{stderr}");
    assert!(stderr.contains("cannot connect"), "{stderr}");

    let waiting = pgleader_with(
        "retrying",
        Some(url),
        &["run", "--lock-id", "1", "--", "true"],
    );
    waiting.wait_for_nth(
        crate::harness::Stream::Stderr,
        "cannot connect; retrying",
        4,
    );
    waiting.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(waiting.wait_code(), 0);
}

#[test]
fn the_first_line_where_nothing_listens_says_where_it_looked_and_how_to_look_elsewhere() {
    // Nothing listens on port 1, nor in a socket directory that does not exist.
    let missing = std::env::temp_dir().join(format!("pgleader-no-server-{}", unique_lock()));
    let socket = missing.display().to_string();
    let cases: [(&[(&str, &str)], String); 4] = [
        (
            &[("PGHOST", "127.0.0.1"), ("PGPORT", "1"), ("PGUSER", "app")],
            "app@127.0.0.1:1/app".to_owned(),
        ),
        (
            &[("PGHOST", &socket), ("PGUSER", "app")],
            format!("app@{socket}/.s.PGSQL.5432/app"),
        ),
        (
            &[(
                "PGLEADER_DATABASE_URL",
                "postgres://app:s3cret-pw@127.0.0.1:1/appdb",
            )],
            "app@127.0.0.1:1/appdb".to_owned(),
        ),
        (
            &[("PGLEADER_DATABASE_URL", "redis://app:s3cret-pw@127.0.0.1:1")],
            "redis://app@127.0.0.1:1".to_owned(),
        ),
    ];
    // A single leader's line, and a sharded replica's.
    let runs: [(&[&str], &str); 2] = [
        (&[], "cannot connect; retrying"),
        (&["--shards", "2"], "cannot join; retrying"),
    ];
    for ((env, looked), (extra, retrying)) in cases
        .iter()
        .flat_map(|case| runs.iter().map(move |run| (case, run)))
    {
        let mut command = pgleader();
        command
            .envs(env.iter().copied())
            .args(["run", "--lock", "nothing-listens"])
            .args(*extra)
            .args(["--", "true"]);
        let process = Proc::spawn("nothing listens", command);
        process.wait_for_nth(crate::harness::Stream::Stderr, retrying, 3);
        process.signal(nix::sys::signal::Signal::SIGTERM);
        let (_, _, stderr) = process.finish();
        let failures: Vec<&String> = stderr
            .iter()
            .filter(|line| line.contains(retrying))
            .collect();
        assert!(
            failures[0].contains(&format!(
                "; nothing listens at {looked}: to connect elsewhere, give -d URL or set \
                 PGLEADER_DATABASE_URL (PostgreSQL also reads PGHOST, PGPORT, PGUSER and \
                 PGDATABASE, as psql does) server="
            )),
            "{}",
            process.dump()
        );
        // Said once: the retries stay one short line each.
        assert!(
            failures[1..]
                .iter()
                .all(|line| !line.contains("nothing listens")),
            "{}",
            process.dump()
        );
        assert!(!stderr.join("\n").contains("s3cret"), "{}", process.dump());
    }
}

#[test]
fn psql_style_environment_variables_are_honoured() {
    let cluster = Cluster::shared();
    let mut command = pgleader();
    command
        .env("PGHOST", &cluster.socket_dir)
        .env("PGPORT", cluster.port.to_string())
        .env("PGUSER", "postgres")
        .env("PGDATABASE", "postgres")
        .env("PGLEADER_LOCK_ID", unique_lock().to_string())
        .args(["run", "--once", "--", "sh", "-c", "echo ran"]);
    let process = Proc::spawn("env", command);
    process.wait_stdout("ran");
    assert_eq!(process.wait_code(), 0);
    let connected = process.wait_log("connected");
    assert!(
        connected.contains(".s.PGSQL."),
        "it did not use the Unix socket: {connected}"
    );
}

/// `pgleader <args> --help` at a terminal `columns` wide: its lines, under each heading.
fn help_sections(args: &[&str], columns: usize) -> Vec<(String, Vec<String>)> {
    let mut command = pgleader();
    command.env("COLUMNS", columns.to_string()).args(args);
    let process = Proc::spawn("help", command);
    let (status, stdout, stderr) = process.finish();
    assert_eq!(status.code(), Some(0), "{stderr:?}");
    let mut sections: Vec<(String, Vec<String>)> = Vec::new();
    for line in stdout {
        if !line.is_empty() && !line.starts_with(' ') {
            sections.push((line, Vec::new()));
        } else if let Some((_, lines)) = sections.last_mut() {
            lines.push(line);
        }
    }
    sections
}

fn section<'a>(sections: &'a [(String, Vec<String>)], heading: &str) -> &'a [String] {
    sections
        .iter()
        .find(|(h, _)| h == heading)
        .map(|(_, lines)| lines.as_slice())
        .unwrap_or_else(|| panic!("no {heading:?} in --help: {sections:#?}"))
}

#[test]
fn help_lists_the_global_options_under_their_own_heading() {
    for subcommand in ["run", "status"] {
        let sections = help_sections(&[subcommand, "--help"], 100);
        let own = section(&sections, "Options:").join("\n");
        let global = section(&sections, "Global options:").join("\n");
        for option in ["--log-format", "--verbose", "--quiet"] {
            assert!(global.contains(option), "{subcommand}: {option}:\n{global}");
            assert!(!own.contains(option), "{subcommand}: {option}:\n{own}");
        }
        assert!(own.contains("--lock-id"), "{subcommand}:\n{own}");
    }
}

#[test]
fn the_exit_status_table_in_help_wraps_cleanly_at_any_width() {
    let terms = ["the command's status", "0", "1", "2", "75", "126, 127"];
    for columns in [60, 80, 100] {
        let sections = help_sections(&["run", "--help"], columns);
        let table = section(&sections, "Exit status (run):");
        let mut seen = Vec::new();
        for line in table.iter().take_while(|line| !line.is_empty()) {
            assert!(
                line.chars().count() <= columns,
                "wider than {columns} columns: {line:?}"
            );
            // A term at 2 columns, its description (and every wrapped line of it) at 6: a line
            // wrapped back to the left edge or to the term's column breaks the table.
            if let Some(term) = line.strip_prefix("  ").filter(|t| !t.starts_with(' ')) {
                assert!(terms.contains(&term), "{columns} columns: {line:?}");
                seen.push(term);
            } else {
                assert!(
                    line.starts_with("      ") && !line[6..].starts_with(' '),
                    "{columns} columns: {line:?}"
                );
            }
        }
        assert_eq!(seen, terms, "{columns} columns: {table:#?}");
    }
}
