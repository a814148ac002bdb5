//! A small HTTP/1.1 client on a plain `TcpStream`, for pgleader's `--http` endpoint: one
//! request per connection (`Connection: close`), every read and write under the harness's hard
//! timeout.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::process::{Proc, WAIT};

/// An answer: the status code, the headers (names in lower case) and the body.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|err| panic!("not JSON ({err}): {}", self.body))
    }
}

/// Sends `method path` and reads the whole answer.
pub fn request(address: SocketAddr, method: &str, path: &str) -> std::io::Result<Reply> {
    let mut stream = TcpStream::connect_timeout(&address, WAIT)?;
    stream.set_read_timeout(Some(WAIT))?;
    stream.set_write_timeout(Some(WAIT))?;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("no head: {text:?}"),
        )
    })?;
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("bad status: {head:?}"),
            )
        })?;
    let headers = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.trim().to_ascii_lowercase(), value.trim().to_owned()))
        .collect();
    let mut reply = Reply {
        status,
        headers,
        body: body.to_owned(),
    };
    if reply.header("transfer-encoding") == Some("chunked") {
        reply.body = dechunk(&reply.body);
    }
    Ok(reply)
}

/// The body of a chunked answer (Prometheus' API sends them): each chunk is its size in
/// hexadecimal, CRLF, the data, CRLF; a chunk of size 0 ends it.
fn dechunk(mut rest: &str) -> String {
    let mut body = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if size == 0 || after.len() < size {
            break;
        }
        body.push_str(&after[..size]);
        rest = after[size..].trim_start_matches("\r\n");
    }
    body
}

/// `GET path`, failing the test if no answer comes.
pub fn get(address: SocketAddr, path: &str) -> Reply {
    request(address, "GET", path).unwrap_or_else(|err| panic!("GET {path} on {address}: {err}"))
}

/// Asks `GET path` again and again until it answers `status`; returns that answer and when
/// it came. There is no event to wait on from outside, so this polls, every 2 ms, with the
/// hard timeout.
pub fn wait_for_status(address: SocketAddr, path: &str, status: u16) -> (Reply, Instant) {
    let deadline = Instant::now() + WAIT;
    loop {
        match request(address, "GET", path) {
            Ok(reply) if reply.status == status => return (reply, Instant::now()),
            last => assert!(
                Instant::now() < deadline,
                "GET {path} on {address} did not answer {status} within {WAIT:?}; last: {last:?}"
            ),
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The address a pgleader started with `--http 127.0.0.1:0` listens on, from its log.
pub fn address_of(process: &Proc) -> SocketAddr {
    let line = process.wait_log("serving /leader");
    super::field(&line, "address")
        .parse()
        .unwrap_or_else(|err| panic!("no address in {line:?}: {err}"))
}
