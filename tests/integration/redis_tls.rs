//! TLS to Redis (`rediss://`) against a real `redis-server` that speaks nothing else
//! (`--port 0 --tls-port`), with a certificate for `localhost` signed by a CA the test makes:
//! pgleader leads with that CA named by `?cacert=`, a crashed TLS leader is still replaced long
//! before its key's TTL and a deleted key still stops the command at once (the keeper and the
//! tracking pushes work under TLS too), and a certificate that does not verify (against the
//! system's roots, against another CA, or for another name) is a permanent error: exit 1 at
//! once, saying so, no retry.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use rcgen::{CertificateParams, KeyPair};

use crate::harness::certs::authority;
use crate::harness::redis::ServerTls;
use crate::harness::run_named as run;
use crate::harness::{Redis, assert_permanent_error, patient_child, unique_lock};

/// The only name the server's certificate is for: not 127.0.0.1, the address it listens on.
const SERVER_NAME: &str = "localhost";

/// How soon a refusal must come: a handshake on the loopback takes milliseconds, and a retry
/// loop's first pause alone would be longer than the handshake.
const AT_ONCE: Duration = Duration::from_secs(5);

/// The TLS server, and a CA file that did not sign its certificate.
struct TlsRedis {
    redis: Redis,
    wrong_ca: String,
}

impl TlsRedis {
    fn ca(&self) -> String {
        self.redis
            .ca_file()
            .expect("a TLS server")
            .display()
            .to_string()
    }

    fn url(&self, host: &str, query: &str) -> String {
        format!("rediss://{host}:{}{query}", self.redis.port)
    }
}

fn server() -> &'static TlsRedis {
    static SERVER: OnceLock<TlsRedis> = OnceLock::new();
    SERVER.get_or_init(|| {
        let (ca_pem, ca) = authority("pgleader redis test CA");
        let (wrong_ca_pem, _) = authority("some other CA");
        let key = KeyPair::generate().expect("key");
        let cert = CertificateParams::new(vec![SERVER_NAME.into()])
            .expect("params")
            .signed_by(&key, &ca)
            .expect("sign the server certificate");
        let redis = Redis::start_tls(
            "tls",
            &ServerTls {
                cert_pem: cert.pem(),
                key_pem: key.serialize_pem(),
                ca_pem,
            },
        );
        let wrong_ca = std::env::temp_dir().join(format!(
            "pgleader-redis-tls-wrong-ca-{}.crt",
            std::process::id()
        ));
        std::fs::write(&wrong_ca, wrong_ca_pem).expect("write the other CA");
        TlsRedis {
            redis,
            wrong_ca: wrong_ca.display().to_string(),
        }
    })
}

fn lock(tag: &str) -> String {
    format!("tls-{tag}-{}", unique_lock())
}

/// Asserts a refusal of `url`: exit 1 within [`AT_ONCE`], the command never run, each of
/// `expected` in the log, no retry. Returns the log.
fn assert_refused(url: &str, expected: &[&str]) -> String {
    let began = Instant::now();
    let a = run("refused", url, &lock("refused"), &[], "echo ran");
    let (status, stdout, stderr) = a.finish();
    let took = began.elapsed();
    let text = stderr.join("\n");
    assert_eq!(status.code(), Some(1), "{url}: {}", a.dump());
    assert!(stdout.is_empty(), "{url}: the command ran: {}", a.dump());
    assert!(took < AT_ONCE, "{url}: refused only after {took:?}\n{text}");
    assert_permanent_error(url, &text, expected);
    text
}

#[test]
fn leads_over_tls_with_the_ca_named_in_the_url() {
    let server = server();
    let url = server.url(SERVER_NAME, &format!("?cacert={}", server.ca()));
    let lock = lock("once");
    let a = run(
        "A",
        &url,
        &lock,
        &["--once"],
        "echo ran epoch=$PGLEADER_EPOCH",
    );
    let (status, stdout, _) = a.finish();
    assert_eq!(status.code(), Some(0), "{}", a.dump());
    let epoch: i64 = stdout
        .iter()
        .find_map(|line| line.strip_prefix("ran epoch="))
        .and_then(|epoch| epoch.parse().ok())
        .unwrap_or_else(|| panic!("no run with an epoch: {}", a.dump()));
    assert!(epoch > 0, "{}", a.dump());
    // Released by compare-and-delete over the same TLS session.
    let key = format!("pgleader:{{{lock}}}");
    assert_eq!(server.redis.cli(&["EXISTS", &key]), "0");
}

#[test]
fn under_tls_a_killed_leader_is_replaced_before_the_ttl_and_a_deleted_key_stops_the_command() {
    let server = server();
    let url = server.url(SERVER_NAME, &format!("?cacert={}", server.ca()));
    let lock = lock("faults");
    let key = format!("pgleader:{{{lock}}}");
    // Checks a minute apart and a lease of 90 s: only the holder's dead connection (its
    // liveness channel) and the tracking push can explain what follows within the waits.
    let slow = ["--check-interval=60s", "--lease=90s"];
    // A follower tries every 200 ms, so that it notices the dead holder quickly.
    let follower = ["--check-interval=200ms", "--lease=90s"];
    let a = run("A", &url, &lock, &slow, &patient_child("A"));
    a.wait_stdout("A started");
    assert!(
        server
            .redis
            .cli(&["GET", &key])
            .contains("session=pgleader:"),
        "the key names the holder"
    );
    let b = run("B", &url, &lock, &follower, &patient_child("B"));
    b.wait_log("waiting for the lock");
    a.signal(Signal::SIGKILL);
    b.wait_stdout("B started");
    // Within the test's 20 s wait: long before A's key (90 s of TTL) could have expired.
    let holder = server.redis.cli(&["GET", &key]);
    assert!(holder.contains(&format!(":{}@", b.pid)), "{holder}");

    assert_eq!(server.redis.cli(&["DEL", &key]), "1");
    let lost = b.wait_lost_leadership();
    assert!(lost.contains("changed by another client"), "{lost}");
    b.signal(Signal::SIGTERM);
    b.wait_exit();
}

#[test]
fn without_the_ca_the_certificate_does_not_verify_against_the_systems_roots() {
    // Were the system's store empty, pgleader would say so (and to install ca-certificates)
    // rather than what is expected here, and the assertion's message would show it.
    let server = server();
    assert_refused(
        &server.url(SERVER_NAME, ""),
        &[
            "certificate does not verify against the system's trusted certificates",
            "UnknownIssuer",
        ],
    );
}

#[test]
fn a_certificate_from_another_ca_does_not_verify() {
    let server = server();
    assert_refused(
        &server.url(SERVER_NAME, &format!("?cacert={}", server.wrong_ca)),
        &[
            &format!(
                "certificate does not verify against the CA file {}",
                server.wrong_ca
            ),
            "UnknownIssuer",
        ],
    );
}

#[test]
fn a_certificate_for_another_name_does_not_verify() {
    let server = server();
    // The right CA, but the certificate names localhost and the URL names 127.0.0.1.
    assert_refused(
        &server.url("127.0.0.1", &format!("?cacert={}", server.ca())),
        &[
            "certificate does not verify against the CA file",
            "not valid for name",
        ],
    );
}
