//! The examples work as written: the systemd unit passes `systemd-analyze verify` and its
//! `SuccessExitStatus` is what pgleader exits with after a stop; the Docker image's entrypoint
//! and command, run as Docker would run them (minus Docker, which the tests cannot assume),
//! lead, follow and stop cleanly.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use nix::sys::signal::Signal;

use crate::harness::{Cluster, Proc, pgleader, require_tool, unique_lock};

fn example(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(path)
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|err| panic!("read {}: {err}", path.display()))
}

/// The values of `key=` lines in a unit file.
fn unit_values<'a>(unit: &'a str, key: &str) -> Vec<&'a str> {
    unit.lines()
        .filter_map(|line| line.strip_prefix(key)?.strip_prefix('='))
        .collect()
}

/// Runs `systemd-analyze verify` on example units (ExecStart pointed at the binary under
/// test, which verify requires to exist); fails on any complaint, warnings included.
fn verify_units(names: &[&str]) {
    let dir = std::env::temp_dir().join(format!(
        "pgleader-unit-{}-{}",
        std::process::id(),
        unique_lock()
    ));
    fs::create_dir_all(&dir).expect("create the unit directory");
    let mut paths = Vec::new();
    for name in names {
        let unit = read(&example(&format!("systemd/{name}")));
        let path = dir.join(name);
        fs::write(
            &path,
            unit.replace("/usr/local/bin/pgleader", env!("CARGO_BIN_EXE_pgleader")),
        )
        .expect("write the unit");
        paths.push(path);
    }
    require_tool(
        "systemd-analyze",
        "the systemd units are checked with it (Debian/Ubuntu: apt-get install systemd)",
    );
    let mut verify = Command::new("systemd-analyze");
    // --man=no: the manual page is not installed on the machine that runs the tests.
    verify.args(["verify", "--man=no"]).args(&paths);
    let process = Proc::spawn("systemd-analyze", verify);
    let (status, stdout, stderr) = process.finish();
    let _ = fs::remove_dir_all(&dir);
    assert!(status.success(), "{}", process.dump());
    // Unknown keys and bad values are only warnings to systemd: none is allowed here.
    assert!(stdout.is_empty() && stderr.is_empty(), "{}", process.dump());
}

#[test]
fn the_systemd_unit_passes_systemd_analyze_verify() {
    verify_units(&["nightly-report.service"]);
    let unit = read(&example("systemd/nightly-report.service"));
    assert_eq!(unit_values(&unit, "Type"), ["notify"]);
    assert_eq!(unit_values(&unit, "NotifyAccess"), ["main"]);
    assert_eq!(unit_values(&unit, "KillMode"), ["mixed"]);
}

#[test]
fn the_scheduled_units_parse_and_name_the_same_occurrence() {
    verify_units(&["nightly-report-once.service", "nightly-report-once.timer"]);
    let service = read(&example("systemd/nightly-report.service"));
    let once = read(&example("systemd/nightly-report-once.service"));
    let timer = read(&example("systemd/nightly-report-once.timer"));
    for unit in [&service, &once] {
        let exec = unit_values(unit, "ExecStart").join(" ");
        assert!(
            exec.contains("--schedule \"0 3 * * *\" --schedule-timezone Europe/Paris"),
            "{exec}"
        );
    }
    assert!(unit_values(&once, "ExecStart")[0].contains(" --once "));
    assert_eq!(
        unit_values(&timer, "OnCalendar"),
        ["*-*-* 03:00:00 Europe/Paris"]
    );
    // The arguments are ones pgleader accepts: a usage error would exit 2 before connecting.
    let exec = unit_values(&once, "ExecStart")[0];
    let args: Vec<String> = shell_words(exec).into_iter().skip(1).collect();
    let mut command = pgleader();
    command
        .env(
            "PGLEADER_DATABASE_URL",
            "postgres://nobody@127.0.0.1:1/none",
        )
        .env("PGLEADER_CATCH_UP", "1ms")
        .args(args.iter().take_while(|arg| *arg != "--"))
        .args(["--", "true"]);
    let process = Proc::spawn("once", command);
    let (status, _, stderr) = process.finish();
    assert_eq!(status.code(), Some(1), "{}", process.dump());
    assert!(
        stderr
            .join("\n")
            .contains("stops retrying after --catch-up"),
        "{}",
        process.dump()
    );
}

/// Splits a systemd command line on spaces, honouring double quotes.
fn shell_words(line: &str) -> Vec<String> {
    let (mut words, mut word, mut quoted) = (Vec::new(), String::new(), false);
    for c in line.chars() {
        match c {
            '"' => quoted = !quoted,
            ' ' if !quoted => {
                if !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
            }
            c => word.push(c),
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    words
}

#[test]
fn the_units_success_exit_status_is_what_pgleader_exits_with_after_a_stop() {
    let unit = read(&example("systemd/nightly-report.service"));
    let success: Vec<i32> = unit_values(&unit, "SuccessExitStatus")
        .iter()
        .flat_map(|value| value.split_whitespace())
        .map(|code| code.parse().expect("a numeric exit status"))
        .collect();
    // A command that does not handle TERM dies of the TERM pgleader passes on.
    let cluster = Cluster::shared();
    let a = crate::harness::run(
        "A",
        cluster,
        unique_lock(),
        &[],
        "echo A started; while :; do sleep 1000 & wait $!; done",
    );
    a.wait_stdout("A started");
    a.signal(Signal::SIGTERM);
    let code = a.wait_code();
    assert!(
        code == 0 || success.contains(&code),
        "pgleader exited {code} after a stop, which the unit counts as a failure \
         (SuccessExitStatus={success:?})"
    );
    assert_eq!(code, 128 + Signal::SIGTERM as i32);
}

/// The JSON array after `instruction` in the Dockerfile (`ENTRYPOINT ["a", "b"]`).
fn exec_form(dockerfile: &str, instruction: &str) -> Vec<String> {
    let line = dockerfile
        .lines()
        .find_map(|line| line.strip_prefix(instruction)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {instruction} in the Dockerfile"));
    serde_json::from_str(line).unwrap_or_else(|err| panic!("{instruction} {line}: {err}"))
}

/// Where the image's files come from: `COPY [--from=build] <source> <destination>`.
fn copies(dockerfile: &str) -> Vec<(String, String)> {
    dockerfile
        .lines()
        .filter_map(|line| {
            let words: Vec<&str> = line
                .strip_prefix("COPY ")?
                .split_whitespace()
                .filter(|word| !word.starts_with("--"))
                .collect();
            match words.as_slice() {
                [source, destination] => Some((source.to_string(), destination.to_string())),
                _ => None,
            }
        })
        .collect()
}

#[test]
fn the_docker_images_entrypoint_leads_follows_and_stops_cleanly() {
    let dockerfile = read(&example("docker/Dockerfile"));
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // Each file the image takes from the build context exists; the binary is built by cargo.
    let mut in_image = Vec::new();
    for (source, destination) in copies(&dockerfile) {
        let local = if source == "/src/target/release/pgleader" {
            PathBuf::from(env!("CARGO_BIN_EXE_pgleader"))
        } else if source == "." {
            continue;
        } else {
            root.join(&source)
        };
        assert!(
            local.is_file(),
            "COPY {source}: no such file in the repository"
        );
        in_image.push((destination, local));
    }
    let local_path = |word: &String| -> String {
        in_image
            .iter()
            .find(|(destination, _)| destination == word)
            .map_or_else(|| word.clone(), |(_, local)| local.display().to_string())
    };
    let argv: Vec<String> = exec_form(&dockerfile, "ENTRYPOINT")
        .into_iter()
        .chain(exec_form(&dockerfile, "CMD"))
        .map(|word| local_path(&word))
        .collect();
    assert_eq!(argv[0], env!("CARGO_BIN_EXE_pgleader"), "{argv:?}");

    // Two replicas of the container, as `docker run` would start them, on a fresh lock name.
    let lock = format!("nightly-report-{}", unique_lock());
    let argv: Vec<String> = argv
        .into_iter()
        .map(|word| {
            if word == "nightly-report" {
                lock.clone()
            } else {
                word
            }
        })
        .collect();
    let cluster = Cluster::shared();
    let replica = |name: &str| {
        let mut command = pgleader();
        command
            .env("PGLEADER_DATABASE_URL", cluster.url())
            .args(&argv[1..]);
        Proc::spawn(name, command)
    };
    let a = replica("A");
    a.wait_stdout(&format!("nightly-report: leading (lock {lock}"));
    let b = replica("B");
    b.wait_log("waiting for the lock");
    // `docker stop` sends TERM: the job stops, the lock is released, the exit is clean.
    a.signal(Signal::SIGTERM);
    a.wait_stdout("nightly-report: stopping");
    assert_eq!(a.wait_code(), 0, "{}", a.dump());
    b.wait_stdout(&format!("nightly-report: leading (lock {lock}"));
    b.signal(Signal::SIGTERM);
    assert_eq!(b.wait_code(), 0, "{}", b.dump());
}
