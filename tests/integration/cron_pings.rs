//! `ping=URL` against real HTTP and HTTPS servers that record what they receive: a run's start
//! and its success or exit status, a skipped occurrence as a failure with a body, the same run
//! id on a run's start and end, `PGLEADER_PING=` as every job's default with `{job}` in it, and
//! `ping=none`. A monitor that answers 500 gets its retries and the ping is counted as
//! undelivered; one that never answers holds up nothing: the schedule keeps its time. The
//! URL's path, the check's credential, is in no log line.

use std::time::Duration;

use crate::crontab::File;
use crate::harness::http::{address_of, get};
use crate::harness::monitor::{Answer, Monitor, Received};
use crate::harness::{Cluster, Proc, Stream, WAIT, field, pgleader, unique_lock};
use crate::observability::sample;

/// The run id of a ping.
fn rid(received: &Received) -> String {
    received
        .target
        .split_once("rid=")
        .map(|(_, rid)| rid.to_owned())
        .unwrap_or_default()
}

fn path(received: &Received) -> &str {
    received.target.split('?').next().unwrap_or_default()
}

#[test]
fn pings_tell_a_monitor_of_each_run_and_a_slow_or_failing_monitor_holds_up_nothing() {
    let ok = Monitor::start(Answer::Status(200));
    let failing = Monitor::start(Answer::Status(500));
    let hanging = Monitor::start(Answer::Hang);
    // Slower than drained's run: its end waits behind its start's ping.
    let slow = Monitor::start(Answer::Slowly(Duration::from_secs(2)));
    let (tls, ca_pem) = Monitor::start_tls(Answer::Status(200));
    let ca = File::new("ping-ca.pem", &ca_pem);
    let ran = "echo ran job=$PGLEADER_JOB at=$PGLEADER_SCHEDULED_TIME started=$EPOCHREALTIME";
    let file = File::new(
        "pings",
        &format!(
            "SHELL=/bin/bash\n\
             PGLEADER_PING=http://{ok}/SECRET-KEY/{{job}}\n\
             # pgleader: name=good\n* * * * * * * true\n\
             # pgleader: name=bad\n* * * * * * * exit 3\n\
             # pgleader: name=long\n* * * * * * * sleep 1.5\n\
             # pgleader: name=drained ping=http://{slow}/SECRET-SLOW/drained\n*/4 * * * * * * sleep 1.5\n\
             # pgleader: name=quiet ping=none\n* * * * * * * true\n\
             # pgleader: name=to-500 ping=http://{failing}/SECRET-500\n* * * * * * * true\n\
             # pgleader: name=to-hang ping=http://{hanging}/SECRET-HANG\n* * * * * * * {ran}\n\
             # pgleader: name=tls ping=https://localhost:{tls_port}/SECRET-TLS\n* * * * * * * true\n",
            ok = ok.address,
            failing = failing.address,
            hanging = hanging.address,
            slow = slow.address,
            tls_port = tls.address.port(),
        ),
    );
    let mut command = pgleader();
    command
        .env("PGLEADER_DATABASE_URL", Cluster::shared().url())
        .env("SSL_CERT_FILE", &ca.0)
        .args(["cron", &format!("--lock-id={}", unique_lock())])
        .args(["--passthrough-logs", "--http=127.0.0.1:0"])
        .arg(&file.0);
    let replica = Proc::spawn("pings", command);

    // A run's start and its success carry one run id.
    let start = ok.wait_for("start of good", |r| path(r) == "/SECRET-KEY/good/start");
    assert_eq!(start.method, "POST");
    let id = rid(&start);
    assert_eq!(id.len(), 36, "{start:?}");
    ok.wait_for("success of good's same run", |r| {
        path(r) == "/SECRET-KEY/good" && rid(r) == id
    });
    // A failure with its exit status, and a skipped occurrence as a failure with a body.
    let bad = ok.wait_for("bad's exit status", |r| path(r) == "/SECRET-KEY/bad/3");
    assert!(bad.body.contains("exit status 3"), "{bad:?}");
    let skipped = ok.wait_for("long's skipped occurrence", |r| {
        path(r) == "/SECRET-KEY/long/fail"
    });
    assert!(skipped.body.contains("skipped"), "{skipped:?}");
    // Over HTTPS, the server's certificate checked against SSL_CERT_FILE's CA.
    tls.wait_for("a ping over HTTPS", |r| path(r) == "/SECRET-TLS/start");

    // A monitor answering 500: each ping tried again, then counted as undelivered.
    let first = failing.wait_for("a ping to the failing monitor", |_| true);
    failing.wait_for("the third attempt of one ping", |r| {
        r.target == first.target
            && failing
                .received()
                .iter()
                .filter(|other| other.target == first.target)
                .count()
                >= 3
    });
    let http = address_of(&replica);
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let metrics = get(http, "/metrics").body;
        let undelivered = sample(
            &metrics,
            "pgleader_job_pings_undelivered_total",
            &["job=\"to-500\""],
        );
        if undelivered >= 1.0 {
            assert_eq!(
                sample(
                    &metrics,
                    "pgleader_job_pings_undelivered_total",
                    &["job=\"good\""]
                ),
                0.0
            );
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no undelivered ping counted\n{metrics}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // A monitor that never answers: its job keeps its time all along.
    hanging.wait_for("a ping to the hanging monitor", |_| true);
    let runs_from = replica
        .lines(Stream::Stdout)
        .iter()
        .filter(|l| l.starts_with("ran "))
        .count();
    replica.wait_line(Stream::Stdout, "ran job=to-hang", runs_from + 5, None, WAIT);
    for line in replica
        .lines(Stream::Stdout)
        .into_iter()
        .filter(|l| l.starts_with("ran job=to-hang"))
    {
        let at: jiff::Timestamp = field(&line, "at").parse().expect("an occurrence");
        let started: f64 = field(&line, "started").parse().expect("$EPOCHREALTIME");
        let late = started - at.as_millisecond() as f64 / 1000.0;
        assert!(
            (0.0..0.5).contains(&late),
            "to-hang's run of {at} started {late:.3} s late beside its hanging monitor\n{}",
            replica.dump()
        );
    }
    // TERM while drained's run goes on: the drain lets it end, and its end, queued behind the
    // slow monitor's answer to its start, reaches it before the replica is gone. On every
    // monitor, every run's start came before its end.
    let runs_of_drained = replica
        .lines(Stream::Stderr)
        .iter()
        .filter(|line| line.contains("started the command of job drained"))
        .count();
    replica.wait_line(
        Stream::Stderr,
        "started the command of job drained",
        runs_of_drained + 1,
        None,
        WAIT,
    );
    replica.terminate_cleanly();
    for (monitor, prefix) in [(&ok, "/SECRET-KEY/"), (&slow, "/SECRET-SLOW/")] {
        let received = monitor.received();
        for (index, start) in received.iter().enumerate() {
            let Some(job) = path(start)
                .strip_prefix(prefix)
                .and_then(|rest| rest.strip_suffix("/start"))
            else {
                continue;
            };
            let end = received.iter().position(|r| {
                rid(r) == rid(start)
                    && path(r).starts_with(&format!("{prefix}{job}"))
                    && !path(r).ends_with("/start")
            });
            assert!(
                end.is_some_and(|end| end > index),
                "{job}'s run {} started at ping {index}, its end at {end:?}: {received:#?}",
                rid(start)
            );
        }
    }

    assert!(
        !ok.received().iter().any(|r| r.target.contains("/quiet")),
        "ping=none was pinged: {:#?}",
        ok.received()
    );
    // The monitors are named by scheme and host; their paths are the checks' secrets.
    let logs = replica.lines(Stream::Stderr).join("\n");
    assert!(
        logs.contains(&format!("http://{}", failing.address)),
        "the undelivered ping is not logged with its host\n{logs}"
    );
    assert!(
        !logs.contains("SECRET"),
        "a ping URL's path was logged\n{logs}"
    );
}

#[test]
fn a_bad_ping_url_is_refused_with_exit_2_without_printing_it() {
    let file = File::new(
        "bad-ping",
        "# pgleader: name=x ping=ftp://host/SECRET\n* * * * * true\n",
    );
    for args in [&["--check"][..], &[][..]] {
        let mut command = pgleader();
        command
            .env("PGLEADER_DATABASE_URL", Cluster::shared().url())
            .args(["cron", "--lock-id=1"])
            .args(args)
            .arg(&file.0);
        let (status, stdout, stderr) = Proc::spawn("bad ping", command).finish();
        let stderr = stderr.join("\n");
        assert_eq!(status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains(":2: ping= of job x: not an http:// or https:// URL"),
            "{stderr}"
        );
        assert!(!stderr.contains("SECRET"), "{stderr}");
        assert!(stdout.is_empty());
    }
}

#[test]
fn check_shows_a_job_s_monitor_by_its_host_only() {
    let file = File::new(
        "check-ping",
        "PGLEADER_PING=https://hc-ping.com/SECRET-KEY/{job}\n\
         # pgleader: name=backup\n0 3 * * * true\n\
         # pgleader: name=quiet ping=none\n0 4 * * * true\n",
    );
    let mut command = pgleader();
    command.args(["cron", "--check"]).arg(&file.0);
    let (status, stdout, stderr) = Proc::spawn("check ping", command).finish();
    assert_eq!(status.code(), Some(0), "{stderr:?}");
    let stdout = stdout.join("\n");
    assert!(stdout.contains("ping=https://hc-ping.com\n"), "{stdout}");
    assert!(stdout.contains("ping=none\n"), "{stdout}");
    assert!(!stdout.contains("SECRET"), "{stdout}");
}
