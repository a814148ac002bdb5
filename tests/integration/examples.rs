//! The examples work as written: README's first block is the scripts (`try_script.rs` runs
//! the first) and .ci/run tests the way it says; the systemd unit passes
//! `systemd-analyze verify` and its `SuccessExitStatus` is what pgleader exits with after a
//! stop; the Docker image's entrypoint and command, run as Docker would run them, lead, follow
//! and stop cleanly (the release tests, `tests/release`, build and run the image itself with
//! podman; this suite cannot assume a container engine); the Kubernetes manifests parse, their
//! probes ask routes that answer as the comments say, and HAProxy with the leader-only
//! configuration routes to the leader and follows a failover (minus Kubernetes: replicas and
//! HAProxy run on loopback).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use nix::sys::signal::Signal;
use yaml_rust2::{Yaml, YamlLoader};

use crate::harness::cluster::free_port;
use crate::harness::pg::leader;
use crate::harness::{Cluster, Proc, WAIT, http, pgleader, require_tool, unique_lock, unit_values};

fn example(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(path)
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|err| panic!("read {}: {err}", path.display()))
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
    let a = leader(
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

/// What the image takes from the build context: `COPY [--chmod=...] <source> <destination>`,
/// leaving out copies from another stage or image (`--from=`).
fn local_copies(dockerfile: &str) -> Vec<(String, String)> {
    dockerfile
        .lines()
        .filter_map(|line| {
            let words: Vec<&str> = line.strip_prefix("COPY ")?.split_whitespace().collect();
            if words.iter().any(|word| word.starts_with("--from=")) {
                return None;
            }
            match words.as_slice() {
                [.., source, destination] if !source.starts_with("--") => {
                    Some((source.to_string(), destination.to_string()))
                }
                _ => None,
            }
        })
        .collect()
}

/// `ENV KEY=value` lines.
fn env_lines(dockerfile: &str) -> Vec<(String, String)> {
    dockerfile
        .lines()
        .filter_map(|line| {
            let (key, value) = line.strip_prefix("ENV ")?.split_once('=')?;
            Some((key.to_owned(), value.to_owned()))
        })
        .collect()
}

#[test]
fn the_docker_files_copy_only_what_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // Dockerfile builds from its own directory; from-source.Dockerfile from the repository's.
    for (file, context) in [
        ("docker/Dockerfile", example("docker")),
        ("docker/from-source.Dockerfile", root.to_path_buf()),
    ] {
        let copies = local_copies(&read(&example(file)));
        assert!(!copies.is_empty(), "{file} copies nothing from its context");
        for (source, _) in copies {
            if source == "." {
                continue;
            }
            assert!(
                context.join(&source).is_file(),
                "{file}: COPY {source}: no such file in {}",
                context.display()
            );
        }
    }
}

#[test]
fn the_docker_images_entrypoint_leads_follows_and_stops_cleanly() {
    let dockerfile = read(&example("docker/Dockerfile"));
    // The image's pgleader is the release's static binary (tested as such by the release
    // tests); here the one cargo built stands in for it, and the job is the example's script.
    let in_image = |word: String| match word.as_str() {
        "/usr/local/bin/pgleader" => env!("CARGO_BIN_EXE_pgleader").to_owned(),
        "/usr/local/bin/nightly-report" => {
            example("docker/nightly-report.sh").display().to_string()
        }
        _ => word,
    };
    let argv: Vec<String> = exec_form(&dockerfile, "ENTRYPOINT")
        .into_iter()
        .chain(exec_form(&dockerfile, "CMD"))
        .map(in_image)
        .collect();
    assert_eq!(argv[0], env!("CARGO_BIN_EXE_pgleader"), "{argv:?}");
    let env = env_lines(&dockerfile);
    assert_eq!(
        env,
        [("PGLEADER_LOCK".to_owned(), "nightly-report".to_owned())]
    );

    // Two replicas of the container, as `docker run -e PGLEADER_LOCK=...` would start them, on
    // a fresh lock name.
    let lock = format!("nightly-report-{}", unique_lock());
    let cluster = Cluster::shared();
    let replica = |name: &str| {
        let mut command = pgleader();
        command
            .envs(env.iter().map(|(key, value)| (key, value)))
            .env("PGLEADER_LOCK", &lock)
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
    b.terminate_cleanly();
}

/// README's first block: its commands, without their comments.
pub fn readme_first_block() -> Vec<String> {
    let readme = read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"));
    readme
        .split("```sh\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("a sh block in README.md")
        .lines()
        .map(|line| {
            line.split(" #")
                .next()
                .unwrap_or_default()
                .trim()
                .to_owned()
        })
        .collect()
}

#[test]
fn the_readmes_first_block_is_the_scripts_and_ci_runs_its_test_command() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // See it work, then pass the tests (try_script.rs runs the first).
    let block = readme_first_block();
    assert_eq!(block, ["scripts/try", "scripts/try --cron", "scripts/test"]);
    for script in ["scripts/try", "scripts/test"] {
        let mode = fs::metadata(root.join(script))
            .unwrap_or_else(|err| panic!("{script}: {err}"))
            .permissions()
            .mode();
        assert!(mode & 0o111 != 0, "{script} is not executable");
    }
    // .ci/run tests the way README says, and otherwise runs only the release's own tests.
    let ci = read(&root.join(".ci/run"));
    let tests: Vec<&str> = ci
        .lines()
        .map(str::trim)
        .filter(|line| !line.starts_with('#'))
        .filter(|line| line.contains("cargo test") || line.contains("scripts/test"))
        .collect();
    assert_eq!(
        tests,
        [
            "timed scripts/test",
            "timed cargo test --locked --test release"
        ]
    );
    // scripts/test runs `cargo test --locked` once what it needs is there: every tool a test
    // requires is on its list.
    let test = read(&root.join("scripts/test"));
    assert_eq!(
        test.lines().rev().find(|line| !line.is_empty()),
        Some(r#"cargo test --locked "$@""#)
    );
    for file in fs::read_dir(root.join("tests/integration")).expect("read tests/integration") {
        let path = file.expect("an entry").path();
        if path.extension().is_none_or(|ext| ext != "rs") {
            continue;
        }
        for call in read(&path).split("require_tool(").skip(1) {
            let Some(tool) = call.trim_start().strip_prefix('"') else {
                continue;
            };
            let tool = tool.split('"').next().unwrap_or_default();
            // (This file's own search for the calls is no call.)
            if !tool.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
                continue;
            }
            assert!(
                test.contains(&format!(" {tool}")),
                "{} requires {tool}, which scripts/test does not install",
                path.display()
            );
        }
    }
}

/// The documents of a Kubernetes manifest.
fn manifest(path: &str) -> Vec<Yaml> {
    YamlLoader::load_from_str(&read(&example(path)))
        .unwrap_or_else(|err| panic!("{path} is not YAML: {err}"))
}

/// The document of `kind` named `name`.
fn object<'a>(documents: &'a [Yaml], kind: &str, name: &str) -> &'a Yaml {
    documents
        .iter()
        .find(|doc| {
            doc["kind"].as_str() == Some(kind) && doc["metadata"]["name"].as_str() == Some(name)
        })
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn text<'a>(value: &'a Yaml, what: &str) -> &'a str {
    value
        .as_str()
        .unwrap_or_else(|| panic!("{what}: expected a string, found {value:?}"))
}

/// Two replicas of the Deployment's container, as Kubernetes would start them from the image
/// of examples/docker (ENTRYPOINT pgleader run), on a fresh lock and a free port.
fn kubernetes_replicas(container: &Yaml) -> (Proc, Proc, String) {
    let cluster = Cluster::shared();
    let lock = format!("nightly-report-{}", unique_lock());
    let args: Vec<String> = container["args"]
        .as_vec()
        .expect("args")
        .iter()
        .map(|arg| match text(arg, "an argument") {
            "nightly-report" => lock.clone(),
            "/usr/local/bin/nightly-report" => {
                example("docker/nightly-report.sh").display().to_string()
            }
            other => other.to_owned(),
        })
        .collect();
    let env: Vec<(String, String)> = container["env"]
        .as_vec()
        .expect("env")
        .iter()
        .filter_map(|var| {
            Some((
                var["name"].as_str()?.to_owned(),
                var["value"].as_str()?.to_owned(),
            ))
        })
        .filter(|(name, _)| name.starts_with("PGLEADER_") && name != "PGLEADER_DATABASE_URL")
        .collect();
    let replica = |name: &str| {
        let mut command = pgleader();
        command.env("PGLEADER_DATABASE_URL", cluster.url());
        for (key, value) in &env {
            // The example's port, 9187, may be taken here: any free one of the loopback.
            let value = if key == "PGLEADER_HTTP" {
                assert_eq!(value, "0.0.0.0:9187");
                "127.0.0.1:0"
            } else {
                value
            };
            command.env(key, value);
        }
        command.arg("run").args(&args);
        Proc::spawn(name, command)
    };
    let a = replica("A");
    a.wait_stdout(&format!("nightly-report: leading (lock {lock}"));
    let b = replica("B");
    b.wait_log("waiting for the lock");
    (a, b, lock)
}

#[test]
fn the_kubernetes_probes_ask_routes_that_answer_as_the_example_says() {
    let documents = manifest("kubernetes/deployment.yaml");
    let deployment = object(&documents, "Deployment", "nightly-report");
    let pod = &deployment["spec"]["template"];
    let container = &pod["spec"]["containers"][0];
    let port = &container["ports"][0];
    assert_eq!(port["containerPort"].as_i64(), Some(9187));
    let port_name = text(&port["name"], "the port's name");
    let probe = |which: &str| {
        let get = &container[which]["httpGet"];
        assert_eq!(text(&get["port"], "the probe's port"), port_name, "{which}");
        text(&get["path"], "the probe's path").to_owned()
    };
    let (readiness, liveness) = (probe("readinessProbe"), probe("livenessProbe"));
    assert_eq!(
        (readiness.as_str(), liveness.as_str()),
        ("/healthz", "/status")
    );
    // The metrics Service selects these pods, on that port.
    let service = object(&documents, "Service", "nightly-report-metrics");
    for (key, value) in service["spec"]["selector"].as_hash().expect("selector") {
        assert_eq!(&pod["metadata"]["labels"][text(key, "a label")], value);
    }
    assert_eq!(
        text(&service["spec"]["ports"][0]["targetPort"], "targetPort"),
        port_name
    );

    // Both probes pass on the leader and on the follower alike (a rollout can proceed); the
    // follower's /leader is 503, which is why readiness does not follow it.
    let (a, b, _) = kubernetes_replicas(container);
    for replica in [&a, &b] {
        let address = http::address_of(replica);
        for path in [&readiness, &liveness] {
            let (reply, _) = http::wait_for_status(address, path, 200);
            assert!(!reply.body.is_empty(), "{path}");
        }
        assert_eq!(http::get(address, "/metrics").status, 200);
    }
    assert_eq!(http::get(http::address_of(&b), "/leader").status, 503);
}

#[test]
fn haproxy_with_the_examples_leader_check_routes_to_the_leader_only_and_follows_a_failover() {
    let documents = manifest("kubernetes/leader-service.yaml");
    let config = object(&documents, "ConfigMap", "nightly-report-leader-haproxy");
    let haproxy_cfg = text(&config["data"]["haproxy.cfg"], "haproxy.cfg");
    assert!(
        haproxy_cfg.contains("option httpchk GET /leader"),
        "{haproxy_cfg}"
    );
    assert!(haproxy_cfg.contains("check port 9187"), "{haproxy_cfg}");
    let headless = object(&documents, "Service", "nightly-report-replicas");
    assert_eq!(headless["spec"]["clusterIP"].as_str(), Some("None"));
    assert_eq!(
        headless["spec"]["selector"]["app"].as_str(),
        Some("nightly-report")
    );
    let leader = object(&documents, "Service", "nightly-report-leader");
    let router = object(&documents, "Deployment", "nightly-report-leader");
    assert_eq!(
        leader["spec"]["selector"],
        router["spec"]["template"]["metadata"]["labels"]
    );
    require_tool(
        "haproxy",
        "the example's HAProxy configuration is run against real replicas (Debian/Ubuntu: apt-get install haproxy)",
    );

    // The Deployment's replicas, and HAProxy with the example's configuration, its two
    // servers on loopback instead of DNS names, and a statistics page to read its view from.
    let deployment = manifest("kubernetes/deployment.yaml");
    let container = &object(&deployment, "Deployment", "nightly-report")["spec"]["template"]["spec"]
        ["containers"][0];
    let (a, b, _) = kubernetes_replicas(container);
    let (a_http, b_http) = (http::address_of(&a), http::address_of(&b));
    let stats = free_port();
    let cfg = haproxy_cfg
        .lines()
        .filter(|line| !line.trim_start().starts_with("server-template"))
        .map(|line| line.replace("bind :8080", &format!("bind 127.0.0.1:{}", free_port())))
        .chain([
            format!("  server a 127.0.0.1:1 port {}", a_http.port()),
            format!("  server b 127.0.0.1:1 port {}", b_http.port()),
            "frontend stats".to_owned(),
            "  mode http".to_owned(),
            format!("  bind 127.0.0.1:{stats}"),
            "  stats enable".to_owned(),
            "  stats uri /stats".to_owned(),
            "  timeout client 5s".to_owned(),
        ])
        .collect::<Vec<_>>()
        .join("\n");
    let dir = std::env::temp_dir().join(format!("pgleader-haproxy-{}", unique_lock()));
    fs::create_dir_all(&dir).expect("create the HAProxy directory");
    let path = dir.join("haproxy.cfg");
    fs::write(&path, format!("{cfg}\n")).expect("write haproxy.cfg");
    let mut check = Command::new("haproxy");
    check.arg("-c").arg("-f").arg(&path);
    let checked = Proc::spawn("haproxy -c", check);
    assert_eq!(checked.wait_code(), 0, "{}", checked.dump());
    let mut command = Command::new("haproxy");
    command.arg("-db").arg("-f").arg(&path);
    let haproxy = Proc::spawn("haproxy", command);

    // Which servers HAProxy's checks find UP, from its statistics as CSV.
    let stats = std::net::SocketAddr::from(([127, 0, 0, 1], stats));
    let up = || -> Vec<String> {
        let Ok(reply) = http::request(stats, "GET", "/stats;csv") else {
            return Vec::new();
        };
        reply
            .body
            .lines()
            .map(|line| line.split(',').collect::<Vec<_>>())
            .filter(|fields| fields.first() == Some(&"replicas") && fields.get(17) == Some(&"UP"))
            .filter_map(|fields| fields.get(1).map(|name| (*name).to_owned()))
            .filter(|name| name != "BACKEND")
            .collect()
    };
    let wait_up = |expected: &[&str]| {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            let seen = up();
            if seen == expected {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "HAProxy saw {seen:?} UP, not {expected:?}, within {WAIT:?}\n{}",
                haproxy.dump()
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    };
    wait_up(&["a"]);
    a.signal(Signal::SIGKILL);
    wait_up(&["b"]);
    haproxy.signal(Signal::SIGTERM);
    haproxy.wait_exit();
    let _ = fs::remove_dir_all(&dir);
}
