//! A monitor for `ping=` to talk to: a real HTTP (or HTTPS) server on a free port that records
//! every request it receives and answers as told (200, another status, or never).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rcgen::{CertificateParams, KeyPair};

use super::WAIT;

/// How the monitor answers each request.
#[derive(Clone, Copy, Debug)]
pub enum Answer {
    Status(u16),
    /// 200, this long after the request.
    Slowly(Duration),
    /// Reads the request, then never answers (holding the connection).
    Hang,
}

/// One request the monitor received.
#[derive(Clone, Debug)]
pub struct Received {
    pub method: String,
    /// The path and query.
    pub target: String,
    pub body: String,
}

pub struct Monitor {
    pub address: SocketAddr,
    received: Arc<Mutex<Vec<Received>>>,
}

impl Monitor {
    /// A plain HTTP monitor.
    pub fn start(answer: Answer) -> Monitor {
        Monitor::serve(answer, None)
    }

    /// An HTTPS monitor for `localhost`, its certificate signed by a CA of its own, whose PEM
    /// is returned (for the client's `SSL_CERT_FILE`).
    pub fn start_tls(answer: Answer) -> (Monitor, String) {
        let (ca_pem, ca) = super::certs::authority("pgleader ping test CA");
        let key = KeyPair::generate().expect("key");
        let cert = CertificateParams::new(vec!["localhost".into()])
            .expect("params")
            .signed_by(&key, &ca)
            .expect("sign the monitor's certificate");
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .expect("the monitor's certificate");
        (Monitor::serve(answer, Some(Arc::new(config))), ca_pem)
    }

    fn serve(answer: Answer, tls: Option<Arc<rustls::ServerConfig>>) -> Monitor {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the monitor");
        let address = listener.local_addr().expect("its address");
        let received = Arc::new(Mutex::new(Vec::new()));
        let record = received.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (record, tls) = (record.clone(), tls.clone());
                std::thread::spawn(move || match tls {
                    Some(config) => {
                        let connection =
                            rustls::ServerConnection::new(config).expect("a TLS connection");
                        handle(
                            rustls::StreamOwned::new(connection, stream),
                            answer,
                            &record,
                        );
                    }
                    None => handle(stream, answer, &record),
                });
            }
        });
        Monitor { address, received }
    }

    pub fn received(&self) -> Vec<Received> {
        self.received.lock().expect("the monitor's record").clone()
    }

    /// Waits for a request for which `wanted` holds; `what` names it in the failure.
    pub fn wait_for(&self, what: &str, wanted: impl Fn(&Received) -> bool) -> Received {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(found) = self.received().into_iter().find(|r| wanted(r)) {
                return found;
            }
            assert!(
                Instant::now() < deadline,
                "the monitor on {} received no {what} within {WAIT:?}: {:#?}",
                self.address,
                self.received()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Reads one request from `stream`, records it, and answers as `answer` says.
fn handle<S: Read + Write>(stream: S, answer: Answer, record: &Mutex<Vec<Received>>) {
    let mut reader = BufReader::new(stream);
    let mut head = String::new();
    if reader.read_line(&mut head).unwrap_or(0) == 0 {
        return;
    }
    let mut length = 0;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0; length];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    let mut words = head.split_whitespace();
    record.lock().expect("the monitor's record").push(Received {
        method: words.next().unwrap_or_default().to_owned(),
        target: words.next().unwrap_or_default().to_owned(),
        body: String::from_utf8_lossy(&body).into_owned(),
    });
    let mut stream = reader.into_inner();
    if let Answer::Slowly(pause) = answer {
        std::thread::sleep(pause);
    }
    match answer {
        Answer::Slowly(_) | Answer::Status(200) => {
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nOK"
            );
            let _ = stream.flush();
        }
        Answer::Status(status) => {
            let _ = write!(
                stream,
                "HTTP/1.1 {status} X\r\nContent-Length: 2\r\nConnection: close\r\n\r\nOK"
            );
            let _ = stream.flush();
        }
        Answer::Hang => {
            // Until the client gives up and closes.
            let _ = stream.read(&mut [0; 1]);
        }
    }
}
