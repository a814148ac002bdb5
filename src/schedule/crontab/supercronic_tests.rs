//! supercronic's published test vectors, checked against pgleader's reading: the expressions,
//! the instants they give and the crontab files it accepts or refuses are facts about
//! supercronic, restated here (the tests are pgleader's own). From aptible/supercronic at
//! commit 5549d4d9d47e7f28605df816eada5cb5ba1f4f3b: `cronexpr/cronexpr_test.go` (its vendored
//! cronexpr, gorhill's) and `crontab/crontab_test.go`.
//!
//! Where pgleader keeps another reading on purpose, the test says so: a step larger than its
//! field and a day-of-week range ending in 7 are refused by supercronic and read by pgleader,
//! with a note (`fields.rs`); a Go zero time, which cronexpr answers with no occurrence, has no
//! counterpart.

use std::collections::BTreeMap;

use jiff::Timestamp;

use super::fields;
use super::tests::parse;

/// An instant as cronexpr's tests write them, UTC.
fn at(text: &str) -> Timestamp {
    format!("{}Z", text.replace(' ', "T")).parse().expect(text)
}

/// The occurrence after `from` of the schedule `expression`, read as a crontab line's, on UTC's
/// wall clock in `format`.
fn next(expression: &str, from: &str, format: &str) -> Option<String> {
    let tab = parse(&format!("{expression} command\n")).expect(expression);
    let when = &tab.jobs[0].when;
    let next = when.next_after(at(from))?;
    Some(when.local(next)?.strftime(format).to_string())
}

const SECONDS: &str = "%Y-%m-%d %H:%M:%S";
const DAY: &str = "%a %Y-%m-%d %H:%M";

/// An instant and the occurrence after it, as cronexpr_test.go writes them.
type FromNext = (&'static str, &'static str);

/// `crontests` of cronexpr_test.go: (expression, format, [(from, next)]).
const CRONTESTS: &[(&str, &str, &[FromNext])] = &[
    (
        "* * * * * * *",
        SECONDS,
        &[
            ("2013-01-01 00:00:00", "2013-01-01 00:00:01"),
            ("2013-01-01 00:00:59", "2013-01-01 00:01:00"),
            ("2013-01-01 00:59:59", "2013-01-01 01:00:00"),
            ("2013-01-01 23:59:59", "2013-01-02 00:00:00"),
            ("2013-02-28 23:59:59", "2013-03-01 00:00:00"),
            ("2016-02-28 23:59:59", "2016-02-29 00:00:00"),
            ("2012-12-31 23:59:59", "2013-01-01 00:00:00"),
        ],
    ),
    (
        "*/5 * * * * * *",
        SECONDS,
        &[
            ("2013-01-01 00:00:00", "2013-01-01 00:00:05"),
            ("2013-01-01 00:00:59", "2013-01-01 00:01:00"),
            ("2013-01-01 00:59:59", "2013-01-01 01:00:00"),
            ("2013-01-01 23:59:59", "2013-01-02 00:00:00"),
            ("2013-02-28 23:59:59", "2013-03-01 00:00:00"),
            ("2016-02-28 23:59:59", "2016-02-29 00:00:00"),
            ("2012-12-31 23:59:59", "2013-01-01 00:00:00"),
        ],
    ),
    (
        "* * * * *",
        SECONDS,
        &[
            ("2013-01-01 00:00:00", "2013-01-01 00:01:00"),
            ("2013-01-01 00:00:59", "2013-01-01 00:01:00"),
            ("2013-01-01 00:59:00", "2013-01-01 01:00:00"),
            ("2013-01-01 23:59:00", "2013-01-02 00:00:00"),
            ("2013-02-28 23:59:00", "2013-03-01 00:00:00"),
            ("2016-02-28 23:59:00", "2016-02-29 00:00:00"),
            ("2012-12-31 23:59:00", "2013-01-01 00:00:00"),
        ],
    ),
    (
        "17-43/5 * * * *",
        SECONDS,
        &[
            ("2013-01-01 00:00:00", "2013-01-01 00:17:00"),
            ("2013-01-01 00:16:59", "2013-01-01 00:17:00"),
            ("2013-01-01 00:30:00", "2013-01-01 00:32:00"),
            ("2013-01-01 00:50:00", "2013-01-01 01:17:00"),
            ("2013-01-01 23:50:00", "2013-01-02 00:17:00"),
            ("2013-02-28 23:50:00", "2013-03-01 00:17:00"),
            ("2016-02-28 23:50:00", "2016-02-29 00:17:00"),
            ("2012-12-31 23:50:00", "2013-01-01 00:17:00"),
        ],
    ),
    (
        "15-30/4,55 * * * *",
        SECONDS,
        &[
            ("2013-01-01 00:00:00", "2013-01-01 00:15:00"),
            ("2013-01-01 00:16:00", "2013-01-01 00:19:00"),
            ("2013-01-01 00:30:00", "2013-01-01 00:55:00"),
            ("2013-01-01 00:55:00", "2013-01-01 01:15:00"),
            ("2013-01-01 23:55:00", "2013-01-02 00:15:00"),
            ("2013-02-28 23:55:00", "2013-03-01 00:15:00"),
            ("2016-02-28 23:55:00", "2016-02-29 00:15:00"),
            ("2012-12-31 23:54:00", "2012-12-31 23:55:00"),
            ("2012-12-31 23:55:00", "2013-01-01 00:15:00"),
        ],
    ),
    (
        "0 0 * * MON",
        DAY,
        &[
            ("2013-01-01 00:00:00", "Mon 2013-01-07 00:00"),
            ("2013-01-28 00:00:00", "Mon 2013-02-04 00:00"),
            ("2013-12-30 00:30:00", "Mon 2014-01-06 00:00"),
        ],
    ),
    (
        "0 0 * * friday",
        DAY,
        &[
            ("2013-01-01 00:00:00", "Fri 2013-01-04 00:00"),
            ("2013-01-28 00:00:00", "Fri 2013-02-01 00:00"),
            ("2013-12-30 00:30:00", "Fri 2014-01-03 00:00"),
        ],
    ),
    (
        "0 0 * * 6,7",
        DAY,
        &[
            ("2013-01-01 00:00:00", "Sat 2013-01-05 00:00"),
            ("2013-01-28 00:00:00", "Sat 2013-02-02 00:00"),
            ("2013-12-30 00:30:00", "Sat 2014-01-04 00:00"),
        ],
    ),
    (
        "0 0 * * 6#5",
        DAY,
        &[("2013-09-02 00:00:00", "Sat 2013-11-30 00:00")],
    ),
    (
        "0 0 14W * *",
        DAY,
        &[
            ("2013-03-31 00:00:00", "Mon 2013-04-15 00:00"),
            ("2013-08-31 00:00:00", "Fri 2013-09-13 00:00"),
        ],
    ),
    (
        "0 0 30W * *",
        DAY,
        &[
            ("2013-03-02 00:00:00", "Fri 2013-03-29 00:00"),
            ("2013-06-02 00:00:00", "Fri 2013-06-28 00:00"),
            ("2013-09-02 00:00:00", "Mon 2013-09-30 00:00"),
            ("2013-11-02 00:00:00", "Fri 2013-11-29 00:00"),
        ],
    ),
    (
        "0 0 L * *",
        DAY,
        &[
            ("2013-09-02 00:00:00", "Mon 2013-09-30 00:00"),
            ("2014-01-01 00:00:00", "Fri 2014-01-31 00:00"),
            ("2014-02-01 00:00:00", "Fri 2014-02-28 00:00"),
            ("2016-02-15 00:00:00", "Mon 2016-02-29 00:00"),
        ],
    ),
    (
        "0 0 LW * *",
        DAY,
        &[
            ("2013-09-02 00:00:00", "Mon 2013-09-30 00:00"),
            ("2013-11-02 00:00:00", "Fri 2013-11-29 00:00"),
            ("2014-08-15 00:00:00", "Fri 2014-08-29 00:00"),
        ],
    ),
    (
        "0 0 28 02 * *",
        DAY,
        &[
            ("2013-09-02 00:00:00", "Fri 2014-02-28 00:00"),
            ("2014-08-15 00:00:00", "Sat 2015-02-28 00:00"),
        ],
    ),
];

#[test]
fn cronexpr_expressions_give_the_instants_supercronic_gives() {
    let mut checked = 0;
    for (expression, format, times) in CRONTESTS {
        for (from, wanted) in *times {
            let got = next(expression, from, format);
            assert_eq!(got.as_deref(), Some(*wanted), "{expression} after {from}");
            checked += 1;
        }
    }
    assert_eq!(checked, 63);
}

#[test]
fn cronexpr_next_n_lists_the_same_instants() {
    let cases: [(&str, &str, [&str; 5]); 2] = [
        (
            "0 0 * * 6#5",
            "2013-09-02 08:44:30",
            [
                "2013-11-30 00:00:00",
                "2014-03-29 00:00:00",
                "2014-05-31 00:00:00",
                "2014-08-30 00:00:00",
                "2014-11-29 00:00:00",
            ],
        ),
        (
            "*/5 * * * *",
            "2013-09-02 08:44:32",
            [
                "2013-09-02 08:45:00",
                "2013-09-02 08:50:00",
                "2013-09-02 08:55:00",
                "2013-09-02 09:00:00",
                "2013-09-02 09:05:00",
            ],
        ),
    ];
    for (expression, from, wanted) in cases {
        let tab = parse(&format!("{expression} command\n")).expect(expression);
        let when = &tab.jobs[0].when;
        let mut now = at(from);
        for wanted in wanted {
            now = when.next_after(now).expect("next");
            assert_eq!(now, at(wanted), "{expression}");
        }
    }
}

#[test]
fn a_schedule_that_never_occurs_again_is_still_a_schedule() {
    // cronexpr's TestZero: parsed, with no next instant. pgleader accepts the line, warns of
    // it, and never runs it.
    let from = "2013-08-31 00:00:00";
    assert_eq!(next("* * * * * 1980", from, SECONDS), None);
    assert!(next("* * * * * 2050", from, SECONDS).is_some());
    assert_eq!(next("11 1 31 2 * *", from, SECONDS), None);
    let tab = parse("11 1 31 2 * * command\n").expect("31 February");
    let warnings = tab.warnings(at(from));
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].starts_with("crontab:1: job command never runs"),
        "{warnings:?}"
    );
}

#[test]
fn what_supercronic_refuses_pgleader_reads_and_says_so() {
    // TestInterval_Interval60Issue and TestRange_OutOfOrder: supercronic refuses these.
    for expression in [
        "*/60 * * * * *",
        "*/61 * * * * *",
        "2/60 * * * * *",
        "2-20/61 * * * * *",
        "45 4 *  *  6-7",
    ] {
        let words: Vec<&str> = expression.split_whitespace().collect();
        assert!(fields::read(&words, false).is_err(), "{expression}");
        // pgleader reads them (a step larger than its field: only the first value; a range
        // ending in 7: to Sunday), noting that supercronic refuses the line.
        let tab = parse(&format!("{expression} command\n")).expect(expression);
        assert_eq!(tab.jobs[0].command, "command", "{expression}");
        assert!(
            tab.notes[0].1.starts_with("supercronic refuses this line"),
            "{expression}: {:?}",
            tab.notes
        );
    }
    assert_eq!(
        next("*/61 * * * *", "2013-01-01 00:00:00", SECONDS).as_deref(),
        Some("2013-01-01 01:00:00")
    );
    assert_eq!(
        next("45 4 * * 6-7", "2013-01-05 12:00:00", DAY).as_deref(),
        Some("Sun 2013-01-06 04:45")
    );
    // A range that ends before it starts means nothing to either.
    assert!(parse("45 4 * * 6-5 command\n").is_err());
}

#[test]
fn benchmark_expressions_are_read() {
    // cronexpr_test.go's benchmarkExpressions: valid, supercronic reads them all.
    for expression in [
        "* * * * *",
        "@hourly",
        "@weekly",
        "@yearly",
        "30 3 15W 3/3 *",
        "30 0 0 1-31/5 Oct-Dec * 2000,2006,2008,2013-2015",
        "0 0 0 * Feb-Nov/2 thu#3 2000-2050",
    ] {
        let tab = parse(&format!("{expression} command\n")).expect(expression);
        assert_eq!(tab.jobs[0].command, "command", "{expression}");
        assert!(tab.notes.is_empty(), "{expression}: {:?}", tab.notes);
    }
}

/// What supercronic's `ParseCrontab` gives for a file: its shell, its environment, whether
/// its zone is the local one, and each job's schedule (as pgleader's canonical form) and
/// command.
struct Parsed {
    shell: &'static str,
    env: &'static [(&'static str, &'static str)],
    local_zone: bool,
    jobs: &'static [(&'static str, &'static str)],
}

const fn plain(env: &'static [(&'static str, &'static str)]) -> Parsed {
    Parsed {
        shell: "/bin/sh",
        env,
        local_zone: true,
        jobs: &[],
    }
}

const fn jobs(jobs: &'static [(&'static str, &'static str)]) -> Parsed {
    Parsed {
        shell: "/bin/sh",
        env: &[],
        local_zone: true,
        jobs,
    }
}

/// `parseCrontabTestCases` of crontab_test.go; `None`: refused.
const CRONTABS: &[(&str, Option<Parsed>)] = &[
    ("", Some(plain(&[]))),
    ("\n", Some(plain(&[]))),
    ("FOO=bar\n", Some(plain(&[("FOO", "bar")]))),
    ("FOO=bar", Some(plain(&[("FOO", "bar")]))),
    ("FOO=\"bar\"", Some(plain(&[("FOO", "bar")]))),
    ("FOO='bar'", Some(plain(&[("FOO", "bar")]))),
    ("FOO='", Some(plain(&[("FOO", "'")]))),
    ("FOO=''", Some(plain(&[("FOO", "")]))),
    (
        "CRON_TZ=UTC",
        Some(Parsed {
            shell: "/bin/sh",
            env: &[("CRON_TZ", "UTC")],
            local_zone: false,
            jobs: &[],
        }),
    ),
    (
        "* * * * * foo some # qux",
        Some(jobs(&[("0 * * * * *", "foo some # qux")])),
    ),
    (
        "* * * * * foo\nSHELL=some\n1 1 1 1 1 bar\nKEY=VAL",
        Some(Parsed {
            shell: "some",
            env: &[("SHELL", "some"), ("KEY", "VAL")],
            local_zone: true,
            jobs: &[("0 * * * * *", "foo"), ("0 1 1 1 1 1", "bar")],
        }),
    ),
    (
        "* * * * * * with year\n* * * * * * * with seconds\n@daily with shorthand",
        Some(jobs(&[
            ("0 * * * * *", "with year"),
            ("* * * * * *", "with seconds"),
            ("0 0 0 * * *", "with shorthand"),
        ])),
    ),
    (
        "# * * * * * * commented\n\n\n  # some\n\t\n\t# more\n  \t  */2 * * * * will run",
        Some(jobs(&[("0 */2 * * * *", "will run")])),
    ),
    (
        "* * * * *        \twith plenty of whitespace",
        Some(jobs(&[("0 * * * * *", "with plenty of whitespace")])),
    ),
    (
        "*\t*\t*\t*\t*\ttabs everywhere\n",
        Some(jobs(&[("0 * * * * *", "tabs everywhere")])),
    ),
    (
        "@hourly foo1 foo2 foo3 foo4 foo5 foo6",
        Some(jobs(&[("0 0 * * * *", "foo1 foo2 foo3 foo4 foo5 foo6")])),
    ),
    ("* foo \n", None),
    ("* some * * *  more\n", None),
    ("* some * * *  \n", None),
    ("FOO\n", None),
];

#[test]
fn crontabs_are_accepted_and_refused_as_supercronic_accepts_and_refuses_them() {
    for (text, wanted) in CRONTABS {
        let got = parse(text);
        let Some(wanted) = wanted else {
            assert!(got.is_err(), "{text:?} is refused by supercronic");
            continue;
        };
        let tab = got.unwrap_or_else(|err| panic!("{text:?}: {err}"));
        let got_jobs: Vec<(&str, &str)> = tab
            .jobs
            .iter()
            .map(|job| (job.when.expression(), job.command.as_str()))
            .collect();
        assert_eq!(got_jobs, wanted.jobs, "{text:?}");
        // supercronic's context is the file's, the same for every job.
        let env: BTreeMap<&str, &str> = wanted.env.iter().copied().collect();
        for job in &tab.jobs {
            let got: BTreeMap<&str, &str> = job
                .env
                .iter()
                .map(|(name, value)| (name.as_str(), value.as_str()))
                .collect();
            assert_eq!(got, env, "{text:?}");
            assert_eq!(job.shell, wanted.shell, "{text:?}");
            let local = job.zone_source == super::ZoneSource::Default;
            assert_eq!(local, wanted.local_zone, "{text:?}");
        }
    }
    assert_eq!(CRONTABS.len(), 20);
}
