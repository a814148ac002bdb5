//! The HTTP endpoint (`--http`), its metrics read by real Prometheus tools, the example alert
//! rules, and `pgleader status --watch`, with real leaders changing under them.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::harness::cluster::free_port;
use crate::harness::http::{address_of, get, request, wait_for_status};
use crate::harness::pg::{leader, leader_on, patient_leader, status};
use crate::harness::{
    Cluster, Proc, Stream, WAIT, field, patient_child, pgleader, require_tool, run, run_with_url,
    unique_lock,
};

const HTTP: &str = "--http=127.0.0.1:0";

fn promtool_hint() -> &'static str {
    "the metrics and the example alert rules are checked with Prometheus' promtool (Debian/Ubuntu: apt-get install prometheus)"
}

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples")
}

/// Runs `promtool args...` with `stdin` as its input; fails the test with its output unless
/// it succeeds.
pub(crate) fn promtool(args: &[&str], stdin: &str) {
    require_tool("promtool", promtool_hint());
    let mut child = Command::new("promtool")
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start promtool");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
        .expect("write to promtool");
    let output = child.wait_with_output().expect("wait for promtool");
    assert!(
        output.status.success(),
        "promtool {args:?} failed ({}):\n{}{}\ninput:\n{stdin}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The value of the one sample of `metric` whose labels contain every `labels` pair.
pub(crate) fn sample(metrics: &str, metric: &str, labels: &[&str]) -> f64 {
    metrics
        .lines()
        .filter(|line| !line.starts_with('#'))
        .find(|line| {
            line.starts_with(&format!("{metric}{{")) && labels.iter().all(|l| line.contains(l))
        })
        .and_then(|line| line.rsplit_once(' '))
        .and_then(|(_, value)| value.parse().ok())
        .unwrap_or_else(|| panic!("no sample {metric} with {labels:?} in:\n{metrics}"))
}

#[test]
fn leader_and_follower_answer_every_route_and_the_follower_leads_right_after_a_kill_9() {
    let cluster = Cluster::shared();
    let lock = unique_lock();
    let a = run("A", cluster, lock, &[HTTP], &patient_child("A"));
    let a_http = address_of(&a);
    let started = a.wait_stdout("A started");
    let b = run("B", cluster, lock, &[HTTP], &patient_child("B"));
    let b_http = address_of(&b);
    b.wait_log("waiting for the lock");

    // The leader: /leader 200 once its command runs.
    let (leader, _) = wait_for_status(a_http, "/leader", 200);
    assert_eq!(leader.body, "leader\n");
    assert_eq!(get(a_http, "/healthz").status, 200);
    let status = get(a_http, "/status");
    assert_eq!(status.header("content-type"), Some("application/json"));
    let status = status.json();
    assert_eq!(status["role"], "leader", "{status}");
    assert_eq!(status["leader"], true);
    assert_eq!(status["healthy"], true);
    assert_eq!(status["lock"]["key"], lock);
    assert_eq!(status["epoch"].to_string(), field(&started, "epoch"));
    assert_eq!(
        status["backend_pid"].to_string(),
        field(&started, "backend")
    );
    assert_eq!(status["command"]["state"], "running");
    assert_eq!(
        status["command"]["pid"].as_i64(),
        Some(i64::from(crate::harness::pid_in(&started)))
    );
    assert_eq!(status["pid"], a.pid.as_raw());
    assert_eq!(
        status["connection"],
        cluster.url().trim_start_matches("postgres://")
    );
    assert!(status["last_check"].is_string(), "{status}");
    assert_eq!(status["version"], env!("CARGO_PKG_VERSION"));

    // The follower serves the same routes.
    let leader = get(b_http, "/leader");
    assert_eq!((leader.status, leader.body.as_str()), (503, "follower\n"));
    let health = get(b_http, "/healthz");
    assert_eq!(
        (health.status, health.body.as_str()),
        (200, "ok: follower\n")
    );
    let status = get(b_http, "/status").json();
    assert_eq!(status["role"], "follower", "{status}");
    assert_eq!(status["epoch"], serde_json::Value::Null);
    let metrics = get(b_http, "/metrics").body;
    assert_eq!(sample(&metrics, "pgleader_is_leader", &[]), 0.0);

    a.signal(Signal::SIGKILL);
    wait_for_status(b_http, "/leader", 200);
    let started_b = b.wait_stdout("B started");
    let status = get(b_http, "/status").json();
    assert_eq!(status["role"], "leader", "{status}");
    assert_eq!(status["epoch"].to_string(), field(&started_b, "epoch"));
    assert!(
        status["epoch"].as_i64() > field(&started, "epoch").parse().ok(),
        "the new leader's epoch must be newer: {status}"
    );
    let metrics = get(b_http, "/metrics").body;
    assert_eq!(sample(&metrics, "pgleader_is_leader", &[]), 1.0);
    assert_eq!(sample(&metrics, "pgleader_command_running", &[]), 1.0);
    assert_eq!(
        sample(&metrics, "pgleader_leadership_acquired_total", &[]),
        1.0
    );
}

#[test]
fn the_metrics_pass_promtool_and_count_what_happened() {
    let lock = unique_lock();
    // The command fails after 300 ms, and the leader waits a minute before competing again.
    let a = leader_on(
        lock,
        &[HTTP, "--restart-delay=60s", "--check-interval=50ms"],
        "echo A started epoch=$PGLEADER_EPOCH; sleep 0.3; exit 3",
    );
    let address = address_of(&a);
    let started = a.wait_stdout("A started");
    a.wait_log("entering the election again");

    let reply = get(address, "/metrics");
    assert_eq!(
        reply.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    let metrics = reply.body;
    promtool(&["check", "metrics"], &metrics);
    let lock_label = format!("lock=\"{lock}\"");
    for line in metrics.lines().filter(|line| !line.starts_with('#')) {
        assert!(
            line.contains(&lock_label),
            "a series without the lock: {line}"
        );
    }
    let epoch: f64 = field(&started, "epoch").parse().expect("epoch");
    assert_eq!(sample(&metrics, "pgleader_epoch", &[]), epoch);
    assert_eq!(sample(&metrics, "pgleader_is_leader", &[]), 0.0);
    assert_eq!(sample(&metrics, "pgleader_command_running", &[]), 0.0);
    assert_eq!(
        sample(&metrics, "pgleader_leadership_acquired_total", &[]),
        1.0
    );
    assert_eq!(
        sample(
            &metrics,
            "pgleader_leadership_lost_total",
            &["reason=\"command_exited\""]
        ),
        1.0
    );
    assert_eq!(
        sample(
            &metrics,
            "pgleader_leadership_lost_total",
            &["reason=\"connection_ended\""]
        ),
        0.0
    );
    assert_eq!(
        sample(
            &metrics,
            "pgleader_command_exits_total",
            &["outcome=\"failed\""]
        ),
        1.0
    );
    // 300 ms of leading with a check every 50 ms.
    assert!(sample(&metrics, "pgleader_check_duration_seconds_count", &[]) >= 1.0);
    assert!(
        sample(
            &metrics,
            "pgleader_last_check_success_timestamp_seconds",
            &[]
        ) > 1.7e9
    );
    assert_eq!(
        sample(
            &metrics,
            "pgleader_info",
            &[&format!("lock_key=\"{lock}\""), "lock_name=\"\""]
        ),
        1.0
    );
    assert!(!metrics.contains("scheduled_runs"), "{metrics}");

    // Between leaderships by choice: healthy, not leading.
    assert_eq!(get(address, "/healthz").status, 200);
    let status = get(address, "/status").json();
    assert_eq!(status["role"], "idle", "{status}");
    assert_eq!(status["command"]["last_exit"]["exit_code"], 3, "{status}");
}

#[test]
fn a_real_prometheus_scrapes_the_replicas_and_evaluates_the_example_rules() {
    require_tool(
        "prometheus",
        "a real Prometheus scrapes the endpoint (Debian/Ubuntu: apt-get install prometheus)",
    );
    let cluster = Cluster::shared();
    let name = format!("observed-{}", unique_lock());
    let replica = |tag: &str| {
        let mut command = pgleader();
        command
            .env("PGLEADER_DATABASE_URL", cluster.url())
            .args(["run", "--lock", &name, HTTP, "--", "sh", "-c"])
            .arg(patient_child(tag));
        Proc::spawn(tag, command)
    };
    let a = replica("A");
    a.wait_stdout("A started");
    let b = replica("B");
    b.wait_log("waiting for the lock");
    let targets = [address_of(&a), address_of(&b)];

    let dir = std::env::temp_dir().join(format!("pgleader-prometheus-{}", unique_lock()));
    std::fs::create_dir_all(&dir).expect("create the Prometheus directory");
    std::fs::copy(
        examples().join("prometheus/alerts.yaml"),
        dir.join("alerts.yaml"),
    )
    .expect("copy the rules");
    let config = std::fs::read_to_string(examples().join("prometheus/prometheus.yml"))
        .expect("read the example configuration")
        .replace("15s", "1s")
        .replace(
            r#"["web-1:9187", "web-2:9187", "web-3:9187"]"#,
            &format!(r#"["{}", "{}"]"#, targets[0], targets[1]),
        );
    std::fs::write(dir.join("prometheus.yml"), config).expect("write the configuration");
    let web = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut command = Command::new("prometheus");
    command
        .arg(format!(
            "--config.file={}",
            dir.join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address={web}"));
    let prometheus = Proc::spawn("prometheus", command);

    // Once both replicas were scraped, the leader count per lock is 1 and both are up.
    let query = |expr: &str| {
        let path = format!("/api/v1/query?query={}", encode(expr));
        // Until it is ready, Prometheus answers 503, or nothing at all.
        request(web, "GET", &path)
            .ok()
            .filter(|reply| reply.status == 200)
            .map(|reply| reply.json())
    };
    let deadline = Instant::now() + WAIT;
    let leaders = loop {
        let up = query("sum(up{job=\"pgleader\"})");
        let leaders = query("sum by (lock) (pgleader_is_leader)");
        let value = |answer: &Option<serde_json::Value>| {
            answer.as_ref().and_then(|answer| {
                answer["data"]["result"][0]["value"][1]
                    .as_str()
                    .map(str::to_owned)
            })
        };
        if value(&up).as_deref() == Some("2") && value(&leaders).is_some() {
            break leaders.expect("an answer");
        }
        assert!(
            Instant::now() < deadline,
            "Prometheus did not scrape both replicas within {WAIT:?}: up={up:?}\n{}",
            prometheus.dump()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let result = &leaders["data"]["result"][0];
    assert_eq!(result["metric"]["lock"], name.as_str(), "{leaders}");
    assert_eq!(result["value"][1], "1", "{leaders}");

    // The example rules load and are evaluated without errors, and none is pending or firing.
    // (An evaluation that saw only the follower's series yet puts "no leader" in pending until
    // the next one, a second later.)
    let deadline = Instant::now() + WAIT;
    loop {
        let rules = get(web, "/api/v1/rules").json();
        let loaded = rules["data"]["groups"][0]["rules"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert_eq!(loaded.len(), 11, "{rules}");
        if loaded
            .iter()
            .all(|rule| rule["health"] == "ok" && rule["state"] == "inactive")
        {
            break;
        }
        assert!(
            Instant::now() < deadline && loaded.iter().all(|rule| rule["health"] != "err"),
            "the example rules were not all evaluated without error, or one stayed active: {rules}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    prometheus.signal(Signal::SIGTERM);
    prometheus.wait_exit();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Percent-encodes a query parameter.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|byte| match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (byte as char).to_string()
            }
            other => format!("%{other:02X}"),
        })
        .collect()
}

#[test]
fn the_example_alert_rules_pass_promtool_check_and_test_rules() {
    let dir = examples().join("prometheus");
    let rules = dir.join("alerts.yaml");
    promtool(&["check", "rules", &rules.to_string_lossy()], "");
    promtool(
        &[
            "test",
            "rules",
            &dir.join("alerts.test.yaml").to_string_lossy(),
        ],
        "",
    );
    promtool(
        &[
            "check",
            "config",
            "--syntax-only",
            &dir.join("prometheus.yml").to_string_lossy(),
        ],
        "",
    );
}

#[test]
fn head_gets_the_headers_other_methods_405_unknown_paths_404_and_big_heads_431() {
    let a = leader(&[HTTP], &patient_child("A"));
    let address = address_of(&a);
    wait_for_status(address, "/leader", 200);
    for route in ["/leader", "/healthz", "/status", "/metrics"] {
        let head = request(address, "HEAD", route).expect("HEAD");
        assert_eq!(head.status, 200, "HEAD {route}: {head:?}");
        assert!(head.body.is_empty(), "HEAD {route} sent a body: {head:?}");
        let length: usize = head
            .header("content-length")
            .and_then(|length| length.parse().ok())
            .unwrap_or_else(|| panic!("HEAD {route} without Content-Length: {head:?}"));
        assert!(length > 0, "{head:?}");
        for method in ["POST", "PUT", "DELETE"] {
            let reply = request(address, method, route).expect("request");
            assert_eq!(reply.status, 405, "{method} {route}: {reply:?}");
            assert_eq!(reply.header("allow"), Some("GET, HEAD"), "{reply:?}");
        }
    }
    for path in ["/", "/leaders", "/metrics/x", "/status.json"] {
        assert_eq!(get(address, path).status, 404, "{path}");
    }
    // A query string does not change the route.
    assert_eq!(get(address, "/leader?x=1").status, 200);

    // A request head larger than 8 KiB is refused (431), one of 4 KiB is not.
    for (size, expected) in [(16_000, "431"), (4_000, "200")] {
        let mut stream = TcpStream::connect_timeout(&address, WAIT).expect("connect");
        stream.set_read_timeout(Some(WAIT)).expect("timeout");
        let head = format!(
            "GET /leader HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\nConnection: close\r\n\r\n",
            "a".repeat(size)
        );
        let _ = stream.write_all(head.as_bytes());
        let mut answer = String::new();
        let _ = stream.read_to_string(&mut answer);
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {expected}")),
            "a head of {size} bytes: {answer:?}"
        );
    }
}

#[test]
fn a_taken_port_exits_1_and_a_bad_address_exits_2_before_the_election() {
    let cluster = Cluster::shared();
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = taken.local_addr().expect("address");
    let a = leader(&[&format!("--http={address}")], "echo A started");
    let all = a.log_after_exit(1);
    assert!(
        all.contains(&format!("cannot listen on {address} (--http)")) && all.contains("in use"),
        "{all}"
    );
    assert!(a.lines(Stream::Stdout).is_empty(), "{}", a.dump());
    assert!(
        !all.contains("connected") && !all.contains("waiting for the lock"),
        "entered the election before failing: {all}"
    );

    for (how, bad) in [("--http", "localhost:9187"), ("PGLEADER_HTTP", "9187")] {
        let mut command = pgleader();
        command
            .env("PGLEADER_DATABASE_URL", cluster.url())
            .arg("run");
        if how == "--http" {
            command.arg(format!("--http={bad}"));
        } else {
            command.env("PGLEADER_HTTP", bad);
        }
        command.args(["--lock-id=1", "--", "true"]);
        let all = Proc::spawn("bad address", command).log_after_exit(2);
        assert!(
            all.contains("--http") && all.contains("127.0.0.1:9187"),
            "the message should name the option and show the form: {all}"
        );
    }
    drop(taken);
}

#[test]
fn an_unreachable_database_is_unhealthy_with_the_reason_and_nothing_secret_is_served() {
    let port = free_port();
    let url = format!("postgres://app:s3cret-pw@127.0.0.1:{port}/appdb");
    let a = run_with_url("A", &url, unique_lock(), &[HTTP], "echo A started");
    let address = address_of(&a);
    a.wait_log("cannot connect");
    let (health, _) = wait_for_status(address, "/healthz", 503);
    assert!(
        health.body.starts_with("cannot connect: ") && health.body.contains("retrying in"),
        "{health:?}"
    );
    assert_eq!(get(address, "/leader").status, 503);
    let status = get(address, "/status").json();
    assert_eq!(status["role"], "connecting");
    assert_eq!(status["healthy"], false);
    assert_eq!(status["connection"], format!("app@127.0.0.1:{port}/appdb"));
    let metrics = get(address, "/metrics").body;
    assert!(sample(&metrics, "pgleader_connection_failures_total", &[]) >= 1.0);
    for route in ["/leader", "/healthz", "/status", "/metrics"] {
        let body = get(address, route).body;
        assert!(
            !body.contains("s3cret"),
            "{route} serves the password: {body}"
        );
    }
}

/// Opens a connection and sends nothing.
fn idle_connection(address: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect_timeout(&address, WAIT).expect("connect");
    stream.set_read_timeout(Some(WAIT)).expect("timeout");
    stream
}

/// True once the server has closed `stream` (end of file or a reset), within the timeout.
fn closed_by_server(stream: &mut TcpStream) -> bool {
    let mut buffer = [0u8; 1024];
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(err) if err.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

#[test]
fn idle_slow_and_greedy_clients_cannot_hold_up_a_failover() {
    let cluster = Cluster::shared();
    let lock = unique_lock();
    let a = patient_leader(cluster, lock);
    let b = run("B", cluster, lock, &[HTTP], &patient_child("B"));
    let b_http = address_of(&b);
    b.wait_log("waiting for the lock");

    // A slow client that trickles a request head, a greedy one that asks for the metrics over
    // and over without reading the answers, and clients that say nothing fill every
    // connection slot of the follower (the server takes connections in the order they came).
    let mut slow = idle_connection(b_http);
    let trickle = std::thread::spawn(move || {
        let head = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ";
        for (sent, byte) in head.iter().chain(std::iter::repeat(&b'a')).enumerate() {
            if slow.write_all(&[*byte]).is_err() {
                return (sent, true);
            }
            if sent > 1000 {
                return (sent, false);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        unreachable!("the bytes never run out")
    });
    let mut greedy = idle_connection(b_http);
    greedy
        .set_write_timeout(Some(Duration::from_millis(500)))
        .expect("timeout");
    let _ = greedy.write_all(&b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".repeat(2000));
    let mut idle: Vec<TcpStream> = (2..64).map(|_| idle_connection(b_http)).collect();
    // Beyond the cap a new connection is closed at once, without an answer (not after the
    // read timeout).
    let mut extra = idle_connection(b_http);
    let refused_at = Instant::now();
    assert!(
        closed_by_server(&mut extra),
        "a connection beyond the cap was kept"
    );
    assert!(
        refused_at.elapsed() < Duration::from_secs(4),
        "closed only after {:?}, not at once",
        refused_at.elapsed()
    );

    // The leader dies; the follower, whose HTTP slots are all taken, takes over all the same.
    a.signal(Signal::SIGKILL);
    b.wait_stdout("B started");
    b.wait_log("became leader");

    // The slow client is dropped after the read timeout; the idle ones too, freeing the slots,
    // and /leader then answers from the new leader.
    let (trickled, dropped) = trickle.join().expect("the slow client");
    assert!(
        dropped,
        "the slow client was never dropped ({trickled} bytes)"
    );
    for stream in idle.iter_mut() {
        assert!(closed_by_server(stream), "an idle connection was kept");
    }
    let (leader, _) = wait_for_status(b_http, "/leader", 200);
    assert_eq!(leader.body, "leader\n");
    b.terminate_cleanly();
}

#[test]
fn status_watch_prints_each_change_of_holder_and_waiters_until_interrupted() {
    let cluster = Cluster::shared();
    let lock = unique_lock();
    let watch = |json: bool| {
        if json {
            status("watch --json", cluster, lock, &["--watch", "--json"])
        } else {
            status("watch", cluster, lock, &["--watch"])
        }
    };
    let (text, json) = (watch(false), watch(true));
    // Both have printed the free lock before anyone takes it.
    text.wait_stdout(": free; nobody waiting");
    json.wait_stdout("\"held\":false");

    let a = patient_leader(cluster, lock);
    let a_line = text.wait_stdout(&format!("leader pgleader {}@", a.pid));
    assert!(a_line.contains("nobody waiting"), "{a_line}");
    // B hands over after 2 s of leading: with nobody waiting it leads again at once, on a new
    // session and with a new epoch, which the watch shows as a new holder.
    let b = run(
        "B",
        cluster,
        lock,
        &["--relinquish-after=2s"],
        &patient_child("B"),
    );
    b.wait_log("waiting for the lock");
    text.wait_stdout(&format!("waiting: pgleader {}@", b.pid));

    a.signal(Signal::SIGKILL);
    let b_first = b.wait_stdout("B started");
    let b_line = text.wait_stdout(&format!("leader pgleader {}@", b.pid));
    assert!(b_line.contains("nobody waiting"), "{b_line}");
    assert!(
        b_line.contains(&format!("(backend {})", field(&b_first, "backend"))),
        "{b_line}"
    );
    let b_second = b.wait_for_nth(Stream::Stdout, "B started", 2);
    assert_ne!(field(&b_first, "epoch"), field(&b_second, "epoch"));
    text.wait_stdout(&format!("(backend {})", field(&b_second, "backend")));

    // The watch's own session is terminated: it reconnects and goes on.
    cluster.execute(&format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name LIKE 'pgleader-status:{}@%'",
        text.pid
    ));
    text.wait_log("reconnecting");
    let reconnecting = Instant::now();
    b.signal(Signal::SIGTERM);
    b.wait_exit();
    let after = text.wait_line(
        Stream::Stdout,
        ": free; nobody waiting",
        1,
        Some(reconnecting),
        WAIT,
    );
    assert!(
        after.is_some(),
        "nothing printed after reconnecting\n{}",
        text.dump()
    );

    // Every line of --json is one object; they tell the same story.
    let objects = json.lines(Stream::Stdout);
    let holders: Vec<Option<i64>> = objects
        .iter()
        .map(|line| {
            let object: serde_json::Value =
                serde_json::from_str(line).unwrap_or_else(|err| panic!("{err}: {line}"));
            assert!(object["time"].is_string(), "{line}");
            object["holder"]["pgleader_pid"].as_i64()
        })
        .collect();
    assert_eq!(holders.first(), Some(&None), "{objects:?}");
    assert!(
        holders.contains(&Some(i64::from(a.pid.as_raw()))),
        "{objects:?}"
    );
    assert!(
        holders.contains(&Some(i64::from(b.pid.as_raw()))),
        "{objects:?}"
    );

    for watcher in [&text, &json] {
        watcher.signal(Signal::SIGINT);
        assert_eq!(watcher.wait_code(), 0, "{}", watcher.dump());
    }
    // Each change printed once: no line repeats the one before it.
    let lines = text.lines(Stream::Stdout);
    for pair in lines.windows(2) {
        let strip = |line: &str| line.split_once(' ').map(|(_, rest)| rest.to_owned());
        assert_ne!(strip(&pair[0]), strip(&pair[1]), "{lines:?}");
    }
}

#[test]
fn a_scheduled_leader_leads_between_runs_and_shows_and_counts_its_runs() {
    let cluster = Cluster::shared();
    let lock = unique_lock();
    let table = format!("ledger_{}", unique_lock());
    let replica = |tag: &str| {
        let mut command = pgleader();
        command
            .env("PGLEADER_DATABASE_URL", cluster.url())
            .arg("run")
            .arg(format!("--lock-id={lock}"))
            .args([
                "--schedule",
                "*/2 * * * * *",
                "--ledger-table",
                &table,
                HTTP,
            ])
            .args(["--", "sh", "-c", &format!("echo {tag} ran; exit 0")]);
        Proc::spawn(tag, command)
    };
    let a = replica("A");
    let a_http = address_of(&a);
    a.wait_log("became leader");
    let b = replica("B");
    let b_http = address_of(&b);
    b.wait_log("waiting for the lock");

    // Once a run has ended, the leader still leads (it holds the lock between runs).
    let deadline = Instant::now() + WAIT;
    let status = loop {
        let status = get(a_http, "/status").json();
        let ran = status["schedule"]["last_runs"]
            .as_array()
            .is_some_and(|runs| runs.iter().any(|run| run["outcome"] == "succeeded"));
        if ran && status["command"]["state"] == "not_running" {
            break status;
        }
        assert!(Instant::now() < deadline, "no finished run shown: {status}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status["role"], "leader", "{status}");
    assert_eq!(
        status["schedule"]["expression"], "*/2 * * * * *",
        "{status}"
    );
    assert_eq!(status["schedule"]["timezone"], "UTC", "{status}");
    assert!(
        status["schedule"]["next_occurrence"].is_string(),
        "{status}"
    );
    let run = &status["schedule"]["last_runs"]
        .as_array()
        .and_then(|runs| runs.iter().find(|run| run["outcome"] == "succeeded"))
        .cloned()
        .expect("a succeeded run");
    assert_eq!(run["exit_code"], 0, "{run}");
    assert!(
        run["claimed_at"].is_string() && run["ended_at"].is_string(),
        "{run}"
    );
    assert_eq!(run["host"], status["host"], "{run}");
    a.wait_stdout("A ran");
    // Between runs too (the command state was just seen idle).
    assert_eq!(get(a_http, "/leader").status, 200);
    assert_eq!(get(b_http, "/leader").status, 503);

    let metrics = get(a_http, "/metrics").body;
    promtool(&["check", "metrics"], &metrics);
    assert!(
        sample(
            &metrics,
            "pgleader_scheduled_runs_total",
            &["outcome=\"succeeded\""]
        ) >= 1.0
    );
    assert_eq!(
        sample(
            &metrics,
            "pgleader_leadership_lost_total",
            &["reason=\"command_exited\""]
        ),
        0.0,
        "a scheduled run's end is no loss of leadership"
    );
    // The follower knows the schedule but ran nothing.
    let follower = get(b_http, "/status").json();
    assert_eq!(follower["schedule"]["expression"], "*/2 * * * * *");
    assert_eq!(follower["schedule"]["last_runs"], serde_json::json!([]));
    let metrics = get(b_http, "/metrics").body;
    assert_eq!(
        sample(
            &metrics,
            "pgleader_scheduled_runs_total",
            &["outcome=\"succeeded\""]
        ),
        0.0
    );
}
