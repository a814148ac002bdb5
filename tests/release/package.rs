//! The Debian package: installed with `dpkg -i` into a clean Debian root, where `pgleader
//! --version` and `man -w pgleader` work, the completions sit where bash, zsh and fish look,
//! and `systemd-analyze verify` accepts the template unit; and the unit's command line, run the
//! way systemd would run it for an instance, leads under the instance's lock.

use std::fs;
use std::path::Path;
use std::process::Command;

use nix::sys::signal::Signal;

use crate::artifacts::{
    VERSION, debian_root, dist, require_root, run_ok, static_pgleader, temp_dir,
};
use crate::harness::{Cluster, Proc, Stream, require_tool, unique_lock, unit_values};

fn repo(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn in_root(root: &Path, args: &[&str]) -> Vec<String> {
    let mut command = Command::new("chroot");
    command
        .arg(root)
        .args(args)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("LC_ALL", "C");
    run_ok(&format!("chroot {}", args.join(" ")), command)
}

#[test]
fn the_deb_installs_into_a_clean_debian_root_with_its_manual_completions_and_unit() {
    require_root("installing the package into a Debian root");
    require_tool(
        "systemd-analyze",
        "the package's unit is checked with it (apt-get install systemd)",
    );
    let deb = dist(&format!("pgleader_{VERSION}-1_amd64.deb"));
    let root = temp_dir("deb-root");
    let mut copy = Command::new("cp");
    copy.arg("-a")
        .arg(format!("{}/.", debian_root().display()))
        .arg(&root);
    run_ok("cp -a", copy);
    fs::copy(&deb, root.join("tmp/pgleader.deb")).expect("copy the package");

    in_root(&root, &["dpkg", "-i", "/tmp/pgleader.deb"]);
    assert_eq!(
        in_root(&root, &["pgleader", "--version"]),
        [format!("pgleader {VERSION}")]
    );
    assert_eq!(
        in_root(&root, &["man", "-w", "pgleader"]),
        ["/usr/share/man/man1/pgleader.1.gz"]
    );
    // Where bash-completion, Debian's zsh (its vendor-completions fpath entry) and fish look.
    for (installed, source) in [
        (
            "usr/share/bash-completion/completions/pgleader",
            "completions/pgleader.bash",
        ),
        (
            "usr/share/zsh/vendor-completions/_pgleader",
            "completions/_pgleader",
        ),
        (
            "usr/share/fish/vendor_completions.d/pgleader.fish",
            "completions/pgleader.fish",
        ),
        (
            "lib/systemd/system/pgleader@.service",
            "packaging/pgleader@.service",
        ),
        // The reference the README links to.
        (
            "usr/share/doc/pgleader/docs/reference.md",
            "docs/reference.md",
        ),
    ] {
        assert_eq!(
            fs::read(root.join(installed)).unwrap_or_else(|err| panic!("{installed}: {err}")),
            fs::read(repo(source)).expect("read the source"),
            "{installed}"
        );
    }
    // The postinst made the unit's user and the directory of instance files.
    let user = in_root(&root, &["getent", "passwd", "pgleader"]);
    assert!(
        user[0].ends_with(":/nonexistent:/usr/sbin/nologin"),
        "{user:?}"
    );
    assert!(root.join("etc/pgleader").is_dir());

    // systemd's own check, of an instance of the template, against the installed system.
    let mut verify = Command::new("systemd-analyze");
    verify
        .arg("verify")
        .arg(format!("--root={}", root.display()))
        .args(["--man=no", "pgleader@nightly-report.service"]);
    let process = Proc::spawn("systemd-analyze verify", verify);
    let (status, stdout, stderr) = process.finish();
    assert!(status.success(), "{}", process.dump());
    // Unknown keys and bad values are only warnings to systemd: none is allowed here.
    assert!(stdout.is_empty() && stderr.is_empty(), "{}", process.dump());

    in_root(&root, &["dpkg", "--remove", "pgleader"]);
    assert!(!root.join("usr/bin/pgleader").exists());
    crate::artifacts::remove_root(&root);
}

#[test]
fn the_template_units_command_runs_the_instance_files_command_under_the_instance_lock() {
    let unit = fs::read_to_string(repo("packaging/pgleader@.service")).expect("read the unit");
    let instance = format!("nightly-report-{}", unique_lock());
    let cluster = Cluster::shared();

    // What systemd passes: Environment= (with %i), then the instance's file, which wins.
    let mut env: Vec<(String, String)> = unit_values(&unit, "Environment")
        .iter()
        .map(|assignment| {
            let (key, value) = assignment.split_once('=').expect("KEY=value");
            (key.to_owned(), value.replace("%i", &instance))
        })
        .collect();
    assert_eq!(
        unit_values(&unit, "EnvironmentFile"),
        ["/etc/pgleader/%i.env"]
    );
    let file = fs::read_to_string(repo("packaging/instance.env")).expect("read instance.env");
    let mut file_env: Vec<(String, String)> = file
        .lines()
        .filter(|line| !line.starts_with('#') && line.contains('='))
        .map(|line| {
            let (key, value) = line.split_once('=').expect("KEY=value");
            (key.to_owned(), value.to_owned())
        })
        .collect();
    assert_eq!(
        file_env
            .iter()
            .map(|(key, _)| key.as_str())
            .collect::<Vec<_>>(),
        ["PGLEADER_COMMAND", "PGLEADER_DATABASE_URL"],
        "the example instance file sets the command and the connection"
    );
    // This test's own command and database, in the example's place.
    file_env[0].1 = "sleep 1000".to_owned();
    file_env[1].1 = cluster.url();
    env.extend(file_env.clone());

    // ExecStart, with $PGLEADER_COMMAND split at white space as systemd splits it.
    let exec = unit_values(&unit, "ExecStart");
    assert_eq!(exec.len(), 1, "{exec:?}");
    let argv: Vec<String> = exec[0]
        .split_whitespace()
        .flat_map(|word| match word {
            "$PGLEADER_COMMAND" => file_env[0]
                .1
                .split_whitespace()
                .map(str::to_owned)
                .collect(),
            word => vec![word.to_owned()],
        })
        .collect();
    assert_eq!(argv[0], "/usr/bin/pgleader");
    let mut command = static_pgleader();
    command.args(&argv[1..]).envs(env);
    let service = Proc::spawn("pgleader@instance", command);
    service.wait_log("started the command");

    let mut status = static_pgleader();
    status
        .env("PGLEADER_DATABASE_URL", cluster.url())
        .args(["status", "--lock", &instance]);
    let status = Proc::spawn("pgleader status", status);
    let (exit, stdout, _) = status.finish();
    assert_eq!(exit.code(), Some(0), "{}", status.dump());
    assert!(
        stdout[0].contains(&format!("lock \"{instance}\"")),
        "{stdout:?}"
    );

    // systemctl stop: TERM to pgleader alone (KillMode=mixed); sleep dies of the TERM passed
    // on, and pgleader's status is one the unit counts as a success.
    service.signal(Signal::SIGTERM);
    let code = service.wait_code();
    assert!(
        unit_values(&unit, "SuccessExitStatus")
            .iter()
            .flat_map(|value| value.split_whitespace())
            .any(|success| success == code.to_string()),
        "pgleader exited {code} after a stop\n{}",
        service.dump()
    );
    assert!(
        service
            .lines(Stream::Stderr)
            .iter()
            .any(|line| line.contains("released the lock"))
    );
}
