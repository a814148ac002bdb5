//! The image, run for real with podman: the FROM scratch image holds the static binary and a
//! CA bundle and nothing else, and runs on its own; the example application image
//! (examples/docker/Dockerfile, which copies pgleader from it) runs two replicas against a real
//! PostgreSQL: one leads, `podman stop` hands over gracefully, `podman kill` hands over at once
//! and leaves nothing running, and pgleader is PID 1 and reaps.
//!
//! podman runs as root here with the vfs storage driver, cgroupfs, runc and explicit ulimits:
//! crun refuses the machine's hybrid cgroup layout, and raising rlimits is not permitted.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::artifacts::{VERSION, debian_root, dist, require_root, run_ok, run_ok_within, temp_dir};
use crate::harness::namespace::namespace_processes;
use crate::harness::{Cluster, Proc, Stream, WAIT, log_time, require_tool, unique_lock, wait_gone};

const PODMAN_FLAGS: [&str; 7] = [
    "--storage-driver",
    "vfs",
    "--cgroup-manager=cgroupfs",
    "--runtime",
    "runc",
    "--events-backend",
    "file",
];
const RUN_FLAGS: [&str; 6] = [
    "--ulimit",
    "nofile=1024:1024",
    "--ulimit",
    "nproc=1024:1024",
    "--network",
    "host",
];

fn podman() -> Command {
    require_tool(
        "podman",
        "the image is run with it (apt-get install podman buildah runc)",
    );
    let mut command = Command::new("podman");
    command.args(PODMAN_FLAGS);
    command
}

/// `podman run` with the flags this machine needs and the image's own arguments.
fn podman_run(name: &str, image: &str, options: &[&str], args: &[&str]) -> Command {
    let mut command = podman();
    command
        .args(["run", "--name", name])
        .args(RUN_FLAGS)
        .args(options)
        .arg(image)
        .args(args);
    command
}

fn pgleader_image() -> String {
    format!("localhost/pgleader:{VERSION}")
}

/// The release's image, loaded from its archive in dist/ (not whatever the storage holds).
fn load_image() -> &'static str {
    static LOADED: OnceLock<String> = OnceLock::new();
    LOADED.get_or_init(|| {
        require_root("running containers with podman");
        let mut load = podman();
        load.args(["load", "--quiet", "--input"])
            .arg(dist(&format!("pgleader-{VERSION}-image.tar")));
        run_ok("podman load", load);
        pgleader_image()
    })
}

/// The example application image, built with buildah from examples/docker/Dockerfile as a user
/// would build it, on a Debian base made from the same debootstrap root as the package test
/// (no image can be pulled here).
fn example_image() -> &'static str {
    static BUILT: OnceLock<String> = OnceLock::new();
    BUILT.get_or_init(|| {
        let pgleader = load_image();
        require_tool(
            "buildah",
            "the example image is built with it (apt-get install buildah)",
        );
        let codename = debian_root()
            .file_name()
            .expect("the root's name")
            .to_string_lossy()
            .into_owned();
        let base = format!("localhost/pgleader-test-debian:{codename}");
        let mut exists = podman();
        exists.args(["image", "exists", &base]);
        if !exists.status().expect("podman image exists").success() {
            let tarball = temp_dir("base").join("root.tar");
            let mut tar = Command::new("tar");
            tar.arg("-C")
                .arg(debian_root())
                .args(["--exclude=./usr/share/doc", "--exclude=./usr/share/man"])
                .args(["--exclude=./usr/share/locale", "--exclude=./var/cache/apt"])
                .args(["--exclude=./var/lib/apt/lists", "--exclude=./.complete"])
                .arg("-cf")
                .arg(&tarball)
                .arg(".");
            run_ok_within("tar the Debian root", tar, Duration::from_secs(300));
            let mut import = podman();
            import.args(["import", "--quiet"]).arg(&tarball).arg(&base);
            run_ok_within("podman import", import, Duration::from_secs(300));
            let _ = fs::remove_dir_all(tarball.parent().expect("temporary directory"));
        }
        let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/docker");
        let image = format!("localhost/pgleader-example:{VERSION}");
        // A rebuild would leave the previous image behind, untagged: remove it first.
        let mut remove = podman();
        remove.args(["rmi", "--force", "--ignore", &image]);
        run_ok("podman rmi", remove);
        let mut build = Command::new("buildah");
        build
            .args(["--storage-driver", "vfs", "build", "--quiet"])
            .args(["--build-arg", &format!("PGLEADER_IMAGE={pgleader}")])
            .args(["--build-arg", &format!("BASE={base}")])
            .args(["-t", &image])
            .arg(&example);
        run_ok_within(
            "buildah build examples/docker",
            build,
            Duration::from_secs(300),
        );
        image
    })
}

/// Containers this test made, removed when it ends however it ends.
struct Containers(Vec<String>);

impl Containers {
    fn name(&mut self, tag: &str) -> String {
        let name = format!("pgleader-test-{}-{tag}", std::process::id());
        self.0.push(name.clone());
        name
    }
}

impl Drop for Containers {
    fn drop(&mut self) {
        let mut remove = podman();
        remove
            .args(["rm", "--force", "--ignore", "--time", "0"])
            .args(&self.0);
        let _ = remove.output();
    }
}

#[test]
fn the_image_holds_the_static_binary_and_a_ca_bundle_and_runs_on_its_own() {
    let image = load_image();
    let mut inspect = podman();
    inspect.args([
        "image",
        "inspect",
        "--format",
        "{{json .Config.Entrypoint}} {{.Config.User}}",
        image,
    ]);
    assert_eq!(
        run_ok("podman image inspect", inspect),
        [r#"["/pgleader"] 65532:65532"#]
    );

    // Its files: export a container's file system and list what is not a directory.
    let mut containers = Containers(Vec::new());
    let name = containers.name("files");
    let mut create = podman();
    create.args(["create", "--name", &name, image]);
    run_ok("podman create", create);
    let export = temp_dir("export").join("image.tar");
    let mut save = podman();
    save.args(["export", "--output"]).arg(&export).arg(&name);
    run_ok("podman export", save);
    let mut list = Command::new("tar");
    list.arg("-tvf").arg(&export);
    let mut files: Vec<String> = run_ok("tar -t", list)
        .into_iter()
        .filter(|line| !line.starts_with('d'))
        .filter_map(|line| line.split_whitespace().last().map(str::to_owned))
        .collect();
    files.sort();
    let _ = fs::remove_dir_all(export.parent().expect("temporary directory"));
    assert_eq!(files, ["etc/ssl/certs/ca-certificates.crt", "pgleader"]);

    // On its own: `status` against the test server (the lock is free: exit 3).
    let cluster = Cluster::shared();
    let lock = unique_lock().to_string();
    let name = containers.name("status");
    let status = Proc::spawn(
        "podman run pgleader status",
        podman_run(
            &name,
            image,
            &["--rm"],
            &["status", "--lock-id", &lock, "-d", &cluster.url()],
        ),
    );
    let (exit, stdout, _) = status.finish();
    assert_eq!(exit.code(), Some(3), "{}", status.dump());
    assert!(stdout[0].ends_with(": free"), "{}", status.dump());

    // sslrootcert=system finds the image's CA bundle: the connection then fails only because
    // the test server speaks no TLS, not for want of trusted certificates.
    let name = containers.name("tls");
    let url = format!("{}?sslrootcert=system", cluster.url());
    let tls = Proc::spawn(
        "podman run pgleader run (sslrootcert=system)",
        podman_run(
            &name,
            image,
            &["--rm"],
            &[
                "run",
                "--once",
                "--lock-id",
                &lock,
                "-d",
                &url,
                "--",
                "/pgleader",
            ],
        ),
    );
    let (exit, _, stderr) = tls.finish();
    assert_eq!(exit.code(), Some(1), "{}", tls.dump());
    let log = stderr.join("\n");
    assert!(!log.contains("no certificate found"), "{}", tls.dump());
    assert!(log.contains("TLS"), "{}", tls.dump());
}

fn inspect(container: &str, format: &str) -> String {
    let mut inspect = podman();
    inspect.args(["inspect", "--format", format, container]);
    run_ok("podman inspect", inspect).join("\n")
}

#[test]
fn two_containers_of_the_example_lead_and_hand_over_on_stop_and_on_kill() {
    let image = example_image();
    let cluster = Cluster::shared();
    let lock = format!("nightly-report-{}", unique_lock());
    let env = [
        "--env",
        &format!("PGLEADER_DATABASE_URL={}", cluster.url()),
        "--env",
        &format!("PGLEADER_LOCK={lock}"),
        // The test server is seconds old: no restart fence to wait out (see the harness).
        "--env",
        "PGLEADER_RESTART_FENCE=0",
    ]
    .map(str::to_owned);
    let env: Vec<&str> = env.iter().map(String::as_str).collect();
    let mut containers = Containers(Vec::new());
    // The image's CMD with -v in front, for the debug line that says an orphan was reaped.
    let replica = |name: &str| {
        let command = podman_run(
            name,
            image,
            &env,
            &["-v", "--", "/usr/local/bin/nightly-report"],
        );
        Proc::spawn(name, command)
    };
    let leading = format!("nightly-report: leading (lock {lock}");

    let a_name = containers.name("a");
    let a = replica(&a_name);
    a.wait_stdout(&leading);
    let b_name = containers.name("b");
    let b = replica(&b_name);
    b.wait_log("waiting for the lock");

    // pgleader is PID 1, and reaps what a `podman exec` session leaves behind.
    let mut comm = podman();
    comm.args(["exec", &a_name, "cat", "/proc/1/comm"]);
    assert_eq!(run_ok("podman exec cat", comm), ["pgleader"]);
    let mut orphan = podman();
    orphan.args([
        "exec",
        &a_name,
        "sh",
        "-c",
        "sleep 1 </dev/null >/dev/null 2>&1 & echo $!",
    ]);
    let orphan = run_ok("podman exec sh", orphan);
    a.wait_log(&format!("reaped an orphaned process pid={}", orphan[0]));

    // podman stop: TERM to PID 1; the job stops, the lock is released, pgleader exits 0 within
    // its kill timeout (podman's SIGKILL would make it 137), and B takes over only then.
    let stopped_at = Instant::now();
    let mut stop = podman();
    stop.args(["stop", "--time", "10", &a_name]);
    run_ok("podman stop", stop);
    a.wait_stdout("nightly-report: stopping");
    assert_eq!(a.wait_code(), 0, "{}", a.dump());
    let released = a.wait_log("released the lock");
    let (_, b_leads) = b
        .wait_line(Stream::Stdout, &leading, 1, None, WAIT)
        .unwrap_or_else(|| panic!("B did not take over\n{}", b.dump()));
    // By the log's clock (the host's, in both containers): the two streams reach the test
    // through different pipes, in no guaranteed order.
    let won = b.wait_log("became leader");
    assert!(
        log_time(&released) <= log_time(&won),
        "B won before A had released the lock:\n{released}\n{won}"
    );
    eprintln!(
        "podman stop: B leads {:?} after the stop began",
        b_leads - stopped_at
    );

    // podman kill: SIGKILL to PID 1 takes the whole container down at once; the server sees the
    // connection close and C takes over right away, long before the 10 s lease could matter.
    let c_name = containers.name("c");
    let c = replica(&c_name);
    c.wait_log("waiting for the lock");
    let b_init: i32 = inspect(&b_name, "{{.State.Pid}}").parse().expect("B's pid");
    let members: Vec<i32> = namespace_processes(b_init)
        .iter()
        .map(|process| process.host_pid)
        .collect();
    assert!(members.len() >= 3, "pgleader, keeper and job: {members:?}");
    let killed_at = Instant::now();
    let mut kill = podman();
    kill.args(["kill", "--signal", "KILL", &b_name]);
    run_ok("podman kill", kill);
    let (_, c_leads) = c
        .wait_line(Stream::Stdout, &leading, 1, None, WAIT)
        .unwrap_or_else(|| panic!("C did not take over\n{}", c.dump()));
    let handover = c_leads - killed_at;
    eprintln!("podman kill: C leads {handover:?} after the kill");
    assert!(
        handover < Duration::from_secs(5),
        "C took over {handover:?} after the kill: that is the lease, not the connection's end"
    );
    assert_eq!(b.wait_code(), 137, "{}", b.dump());
    for pid in members {
        assert!(wait_gone(pid, WAIT), "process {pid} of B outlived the kill");
    }
    assert_eq!(inspect(&b_name, "{{.State.Status}}"), "exited");

    let mut stop = podman();
    stop.args(["stop", "--time", "10", &c_name]);
    run_ok("podman stop", stop);
    assert_eq!(c.wait_code(), 0, "{}", c.dump());
}
