//! TLS against a real server with `ssl = on` and certificates made by the test: what each
//! sslmode accepts, what it refuses, and that a refusal says why and is not retried.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::OnceLock;

use rcgen::{CertificateParams, DnType, KeyPair};

use crate::harness::certs::authority;
use crate::harness::cluster::{Options, SECRET_PASSWORD, SECRET_USER, ServerTls};
use crate::harness::pg::assert_password_hidden;
use crate::harness::{
    Cluster, Proc, assert_permanent_error, patient_child, pgleader, pid_field, unique_lock,
};

/// The only name (besides 127.0.0.1) the server's certificate is for.
const SERVER_NAME: &str = "pgleader-test.invalid";
/// A role that may log in only with a client certificate.
const CERT_USER: &str = "cert_user";

/// A server that accepts TCP connections only over TLS, and the files a client needs.
struct TlsServer {
    cluster: Cluster,
    dir: PathBuf,
}

impl TlsServer {
    fn file(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    fn url(&self, host: &str, query: &str) -> String {
        format!(
            "postgres://postgres@{host}:{}/postgres?{query}",
            self.cluster.port
        )
    }
}

fn server() -> &'static TlsServer {
    static SERVER: OnceLock<TlsServer> = OnceLock::new();
    SERVER.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("pgleader-test-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create the certificate directory");
        let (ca_pem, ca) = authority("pgleader test CA");
        let (wrong_ca_pem, _) = authority("some other CA");

        let server_key = KeyPair::generate().expect("key");
        let server_cert = CertificateParams::new(vec![SERVER_NAME.into(), "127.0.0.1".into()])
            .expect("params")
            .signed_by(&server_key, &ca)
            .expect("sign the server certificate");

        // A client certificate for `cert` authentication: the role is the common name.
        let client_key = KeyPair::generate().expect("key");
        let mut client_params = CertificateParams::new(Vec::<String>::new()).expect("params");
        client_params
            .distinguished_name
            .push(DnType::CommonName, CERT_USER);
        let client_cert = client_params
            .signed_by(&client_key, &ca)
            .expect("sign the client certificate");

        for (name, pem) in [
            ("ca.crt", &ca_pem),
            ("wrong-ca.crt", &wrong_ca_pem),
            ("client.crt", &client_cert.pem()),
            ("client.key", &client_key.serialize_pem()),
        ] {
            let path = dir.join(name);
            std::fs::write(&path, pem).expect("write a certificate file");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        }

        let cluster = Cluster::with_options(
            "tls",
            Options {
                tls: Some(ServerTls {
                    cert_pem: server_cert.pem(),
                    key_pem: server_key.serialize_pem(),
                    client_ca_pem: Some(ca_pem),
                }),
                hba: Some(format!(
                    "hostssl all {CERT_USER} 127.0.0.1/32 cert\n\
                     hostssl all {SECRET_USER} 127.0.0.1/32 scram-sha-256\n\
                     hostssl all all 127.0.0.1/32 trust\n"
                )),
                ..Options::default()
            },
        );
        cluster.execute(&format!("CREATE ROLE {CERT_USER} LOGIN SUPERUSER"));
        TlsServer { cluster, dir }
    })
}

/// `pgleader run --once` with this URL (and extra environment) to its end.
fn run_once(url: &str, env: &[(&str, String)]) -> (i32, String, Vec<String>) {
    let mut command = pgleader();
    command
        .env("PGLEADER_DATABASE_URL", url)
        .envs(env.iter().map(|(key, value)| (key, value)))
        .args(["run", "--once", "--lock-id"])
        .arg(unique_lock().to_string())
        .args(["--", "sh", "-c", "echo ran"]);
    let process = Proc::spawn("pgleader", command);
    let (status, stdout, stderr) = process.finish();
    let code = status
        .code()
        .unwrap_or_else(|| panic!("died by a signal\n{}", process.dump()));
    (code, stderr.join("\n"), stdout)
}

/// Asserts a refusal: exit 1 at once, the command never run, each of `expected` in the log,
/// no retry.
fn assert_refused(url: &str, expected: &[&str]) {
    let (code, stderr, stdout) = run_once(url, &[]);
    assert_eq!(code, 1, "{url}:\n{stderr}");
    assert!(stdout.is_empty(), "the command ran: {stdout:?}");
    assert_permanent_error(url, &stderr, expected);
}

/// Whether the server sees this backend's connection as encrypted.
fn encrypted(server: &TlsServer, backend_pid: i32) -> bool {
    server
        .cluster
        .client()
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = $1",
            &[&backend_pid],
        )
        .expect("pg_stat_ssl")
        .get(0)
}

#[test]
fn require_and_prefer_encrypt_the_session() {
    let server = server();
    for mode in ["require", "prefer"] {
        let mut command = pgleader();
        command
            .env(
                "PGLEADER_DATABASE_URL",
                server.url("127.0.0.1", &format!("sslmode={mode}")),
            )
            .args(["run", "--lock-id"])
            .arg(unique_lock().to_string())
            .args(["--", "sh", "-c", &patient_child("A")]);
        let a = Proc::spawn(mode, command);
        let started = a.wait_stdout("A started");
        let backend = pid_field(&started, "backend");
        assert!(encrypted(server, backend), "sslmode={mode}: not encrypted");
        a.terminate_cleanly();
    }
}

#[test]
fn verify_full_with_the_right_ca_connects_by_ip_address_and_by_host_name() {
    let server = server();
    let ca = server.file("ca.crt");
    for url in [
        server.url(
            "127.0.0.1",
            &format!("sslmode=verify-full&sslrootcert={ca}"),
        ),
        // The name is checked (and sent as SNI); the address only says where to connect.
        server.url(
            SERVER_NAME,
            &format!("sslmode=verify-full&sslrootcert={ca}&hostaddr=127.0.0.1"),
        ),
    ] {
        let (code, stderr, stdout) = run_once(&url, &[]);
        assert_eq!(code, 0, "{url}:\n{stderr}");
        assert_eq!(stdout, ["ran"]);
    }
}

#[test]
fn sslmode_and_sslrootcert_are_read_from_the_environment() {
    let server = server();
    let url = format!(
        "postgres://postgres@{SERVER_NAME}:{}/postgres?hostaddr=127.0.0.1",
        server.cluster.port
    );
    let (code, stderr, _) = run_once(
        &url,
        &[
            ("PGSSLMODE", "verify-full".into()),
            ("PGSSLROOTCERT", server.file("ca.crt")),
        ],
    );
    assert_eq!(code, 0, "{stderr}");
    let (code, stderr, _) = run_once(
        &url,
        &[
            ("PGSSLMODE", "verify-full".into()),
            ("PGSSLROOTCERT", server.file("wrong-ca.crt")),
        ],
    );
    assert_eq!(
        code, 1,
        "the environment's root certificate was ignored:\n{stderr}"
    );
}

#[test]
fn verify_full_with_a_wrong_host_name_fails_with_a_clear_message() {
    let server = server();
    let query = format!(
        "sslmode=verify-full&sslrootcert={}&hostaddr=127.0.0.1",
        server.file("ca.crt")
    );
    assert_refused(
        &server.url("localhost", &query),
        &[
            "certificate verify failed: hostname mismatch",
            &format!("\"{SERVER_NAME}\""),
            "not for \"localhost\"",
        ],
    );
    // verify-ca checks the chain only: the same name is fine there.
    let (code, stderr, _) = run_once(
        &server.url("localhost", &query.replace("verify-full", "verify-ca")),
        &[],
    );
    assert_eq!(code, 0, "{stderr}");
}

#[test]
fn verify_full_and_verify_ca_with_a_wrong_ca_fail_with_a_clear_message() {
    let server = server();
    let wrong = server.file("wrong-ca.crt");
    for mode in ["verify-full", "verify-ca"] {
        assert_refused(
            &server.url("127.0.0.1", &format!("sslmode={mode}&sslrootcert={wrong}")),
            &[
                "certificate verify failed: the server's certificate is not signed by a trusted CA",
                &wrong,
            ],
        );
    }
    // require checks the chain too once a root certificate is given (libpq's rule).
    assert_refused(
        &server.url("127.0.0.1", &format!("sslmode=require&sslrootcert={wrong}")),
        &["not signed by a trusted CA"],
    );
}

#[test]
fn verify_full_without_a_root_certificate_says_how_to_give_one() {
    let server = server();
    assert_refused(
        &server.url("127.0.0.1", "sslmode=verify-full"),
        &[
            "root certificate file \"",
            "does not exist",
            "sslrootcert=system",
        ],
    );
}

#[test]
fn sslmode_disable_against_a_server_that_requires_tls_fails_clearly() {
    let server = server();
    assert_refused(
        &server.url("127.0.0.1", "sslmode=disable"),
        &["no encryption", "use sslmode=require or stronger"],
    );
}

#[test]
fn prefer_falls_back_to_plaintext_when_the_handshake_fails() {
    // The certificate check fails (wrong CA), so prefer tries again without TLS, as libpq
    // does; this server takes no plaintext, which ends it.
    let server = server();
    assert_refused(
        &server.url(
            "127.0.0.1",
            &format!("sslmode=prefer&sslrootcert={}", server.file("wrong-ca.crt")),
        ),
        &[
            "no encryption",
            "the TLS handshake failed; connecting without TLS",
        ],
    );
}

#[test]
fn a_client_certificate_logs_in_where_pg_hba_asks_for_one() {
    let server = server();
    let url = format!(
        "postgres://{CERT_USER}@127.0.0.1:{}/postgres?sslmode=verify-full&sslrootcert={}",
        server.cluster.port,
        server.file("ca.crt")
    );
    let with_cert = format!(
        "{url}&sslcert={}&sslkey={}",
        server.file("client.crt"),
        server.file("client.key")
    );
    let (code, stderr, _) = run_once(&with_cert, &[]);
    assert_eq!(code, 0, "{stderr}");
    assert_refused(&url, &["connection requires a valid client certificate"]);
}

#[test]
fn a_password_logs_in_over_tls_with_scram_and_channel_binding() {
    // Over TLS the server offers SCRAM-SHA-256-PLUS, and the driver takes it when the TLS
    // layer supplies the server certificate's hash: a wrong hash would fail the login.
    let server = server();
    let url = format!(
        "{}?sslmode=require",
        server.cluster.url_as_secret_user(SECRET_PASSWORD)
    );
    let (code, stderr, _) = run_once(&url, &[]);
    assert_eq!(code, 0, "{stderr}");
    assert_password_hidden(&stderr, SECRET_PASSWORD);
}

#[test]
fn require_against_a_server_without_tls_fails_clearly() {
    // The shared cluster runs with ssl off.
    let cluster = Cluster::shared();
    let ca = server().file("ca.crt");
    for (mode, query) in [
        ("require", "sslmode=require".to_owned()),
        (
            "verify-full",
            format!("sslmode=verify-full&sslrootcert={ca}"),
        ),
    ] {
        assert_refused(
            &format!("{}?{query}", cluster.url()),
            &[
                "the server does not accept TLS connections",
                &format!("sslmode={mode} insists on TLS"),
            ],
        );
    }
}
