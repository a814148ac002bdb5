//! PostgreSQL versions. `scripts/pg-matrix` runs the election, failover, fault and version
//! tests against every supported major (13 to 18) and against 12, the newest unsupported one,
//! by pointing PGLEADER_TEST_PG_BINDIR at each server and PGLEADER_TEST_PG_MAJOR at what it
//! should be. These tests check that the run uses the server it was given, and what pgleader
//! does with a server that lacks idle_session_timeout (13) or is too old (12 and before).

use crate::harness::{Cluster, Proc, pgleader, unique_lock};

const WARNING: &str = "has no idle_session_timeout";
const TOO_OLD: &str = "pgleader needs PostgreSQL 13 or later";

#[test]
fn the_server_under_test_is_the_one_the_run_asked_for() {
    let major = Cluster::shared().server_major();
    // Without PGLEADER_TEST_PG_MAJOR (a plain `cargo test`) any server the harness found will
    // do; under scripts/pg-matrix a mix-up of binaries would make every other result a lie.
    if let Ok(expected) = std::env::var("PGLEADER_TEST_PG_MAJOR") {
        let expected: u32 = expected
            .parse()
            .expect("PGLEADER_TEST_PG_MAJOR is a major version number");
        assert_eq!(
            major, expected,
            "PGLEADER_TEST_PG_BINDIR started PostgreSQL {major}, not {expected}"
        );
    }
    assert!(
        major >= 12,
        "PostgreSQL {major}: the harness needs 12 or later"
    );
}

fn run_once(cluster: &Cluster) -> Proc {
    let mut command = pgleader();
    command
        .env("PGLEADER_DATABASE_URL", cluster.url())
        .args(["run", "--once", "--lock-id", &unique_lock().to_string()])
        .args(["--", "sh", "-c", "echo the command ran"]);
    Proc::spawn("pgleader", command)
}

#[test]
fn pgleader_refuses_servers_before_13_and_warns_once_about_13() {
    let cluster = Cluster::shared();
    let major = cluster.server_major();
    let run = run_once(cluster);
    let (status, stdout, stderr) = run.finish();
    let code = status.code().expect("pgleader exited");
    let log = stderr.join("\n");
    let ran = stdout.iter().any(|line| line == "the command ran");
    if major < 13 {
        assert_eq!(code, 1, "{}", run.dump());
        assert!(!ran, "the command ran on PostgreSQL {major}");
        assert!(
            log.contains(&format!("the server runs PostgreSQL {major}; {TOO_OLD}")),
            "{}",
            run.dump()
        );
        let mut status = pgleader();
        status
            .env("PGLEADER_DATABASE_URL", cluster.url())
            .args(["status", "--lock-id", "1"]);
        let status = Proc::spawn("pgleader status", status);
        let (exit, _, stderr) = status.finish();
        assert_eq!(exit.code(), Some(1), "{}", status.dump());
        assert!(stderr.join("\n").contains(TOO_OLD), "{}", status.dump());
        return;
    }
    assert_eq!(code, 0, "{}", run.dump());
    assert!(ran, "{}", run.dump());
    let warnings = log.matches(WARNING).count();
    if major == 13 {
        assert_eq!(warnings, 1, "{}", run.dump());
        assert!(
            log.contains("WARN") && log.contains("connect directly"),
            "{}",
            run.dump()
        );
    } else {
        assert_eq!(warnings, 0, "{}", run.dump());
    }
}
