//! Who takes part in an election, as the server shows it, and how pgleader names its sessions
//! so that the others (and `pgleader status`) can tell who is who.
//!
//! Every backend lets a connection carry a short name (PostgreSQL's `application_name`, Redis'
//! `CLIENT SETNAME`). pgleader's is `<name>:<pid>@<host>`, where name is the user's own
//! application name or `pgleader`; a scheduled pgleader adds its fingerprints,
//! `<name>#<schedule>[<ledger>]:<pid>@<host>`, so that a leader can see whether the replicas
//! waiting behind it agree with it on the schedule and on where runs are recorded. This module
//! writes and reads that name; the backends only carry it.

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The longest name every backend keeps whole (PostgreSQL cuts `application_name` at 63 bytes).
pub const MAX_LABEL: usize = 63;

/// What a session's id on the server is, so that `status` names it as the server does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SessionId {
    /// PostgreSQL's backend pid.
    #[default]
    BackendPid,
    /// Redis' client id (`CLIENT ID`).
    ClientId,
}

impl SessionId {
    /// The id's name in a full description: `backend pid`, `client id`.
    pub fn name(self) -> &'static str {
        match self {
            SessionId::BackendPid => "backend pid",
            SessionId::ClientId => "client id",
        }
    }

    /// Its name in a short one: `backend`, `client`.
    pub fn short_name(self) -> &'static str {
        match self {
            SessionId::BackendPid => "backend",
            SessionId::ClientId => "client",
        }
    }
}

/// A session that holds or waits for a lock.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Participant {
    /// The session's id on the server (PostgreSQL's backend pid, Redis' client id).
    pub backend_pid: i32,
    /// Which of the two `backend_pid` is.
    pub id_kind: SessionId,
    /// Whether it holds the lock (else it waits).
    pub granted: bool,
    /// The name the session gave itself.
    pub application_name: Option<String>,
    pub client_address: Option<String>,
    pub client_port: Option<i32>,
    /// When the session started, RFC 3339.
    pub backend_start: Option<String>,
    /// Since when it waits, RFC 3339 (waiters only).
    pub waiting_since: Option<String>,
}

/// Who holds a lock and who waits for it, waiters in the order they began waiting (on Redis also
/// the order the server will grant it; on PostgreSQL that order changes at each turn of a
/// follower's wait).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LockView {
    pub holder: Option<Participant>,
    pub waiting: Vec<Participant>,
    /// The key the lock is on, where the backend names it (Redis: `pgleader:{NAME}`); `None`
    /// for PostgreSQL's advisory lock, whose key is the lock's number.
    pub key_name: Option<String>,
    /// For a backend of several servers (a quorum): what each of them shows.
    pub servers: Vec<ServerView>,
    /// For a sharded lock (`--shards`) with replicas running: who holds which shard.
    pub shards: Option<ShardsView>,
}

/// A sharded lock as its server shows it: the shard count its replicas run with, and each
/// replica with the shards it holds, in the order of their ids.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardsView {
    pub count: u32,
    pub replicas: Vec<ShardReplica>,
}

/// One replica of a sharded lock: its holder session, its `--max-shards` and its shards.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardReplica {
    /// Its id on the roster, as its log and `/status` name the other members (PostgreSQL: its
    /// holder session's backend pid; Redis: the number it joined with).
    pub member: i32,
    pub participant: Participant,
    pub cap: Option<u32>,
    pub holds: Vec<u32>,
    /// For a crontab: how its file defines each job it knows, by job number (see
    /// `Listing::definitions`).
    pub defines: BTreeMap<u32, u32>,
}

impl ShardsView {
    /// Who holds shard `shard`, if anyone does.
    pub fn holder_of(&self, shard: u32) -> Option<&ShardReplica> {
        self.replicas
            .iter()
            .find(|replica| replica.holds.contains(&shard))
    }

    /// The shards nobody holds.
    pub fn free(&self) -> Vec<u32> {
        (0..self.count)
            .filter(|shard| self.holder_of(*shard).is_none())
            .collect()
    }
}

/// What one server of a quorum shows: who holds the lock there, or why it cannot be asked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerView {
    /// The server, as logs name it (never with a password).
    pub server: String,
    /// `Ok(None)`: the lock is free there; `Err`: the server could not be asked.
    pub holder: Result<Option<Participant>, String>,
}

impl Participant {
    /// The pid and host of the pgleader that owns this session, from its name
    /// `<name>:<pid>@<host>`.
    pub fn pgleader_process(&self) -> Option<(u32, &str)> {
        let name = self.application_name.as_deref()?;
        let (_, rest) = name.rsplit_once(':')?;
        let (pid, host) = rest.split_once('@')?;
        Some((pid.parse().ok()?, host))
    }

    /// The fingerprints the session announces: its schedule's, then its ledger's once it has
    /// prepared the ledger.
    pub fn fingerprints(&self) -> Option<(&str, Option<&str>)> {
        fingerprints_in(self.application_name.as_deref()?)
    }

    /// The schedule fingerprint the session announces, if it is a scheduled pgleader.
    pub fn fingerprint(&self) -> Option<&str> {
        self.fingerprints().map(|(schedule, _)| schedule)
    }

    /// The ledger fingerprint it announces, once it has prepared its ledger.
    pub fn ledger_fingerprint(&self) -> Option<&str> {
        self.fingerprints().and_then(|(_, ledger)| ledger)
    }

    /// `pgleader#1a2b3c4d:42@web-1 (backend pid 8581)`, for messages about disagreements.
    pub fn describe_briefly(&self) -> String {
        format!(
            "{} ({} {})",
            self.application_name.as_deref().unwrap_or(""),
            self.id_kind.name(),
            self.backend_pid
        )
    }

    /// A short name for one line: `pgleader 4242@web-1 (backend 8581)`.
    pub fn short(&self) -> String {
        let id = self.id_kind.short_name();
        match (self.pgleader_process(), &self.application_name) {
            (Some((pid, host)), _) => {
                format!("pgleader {pid}@{host} ({id} {})", self.backend_pid)
            }
            (None, Some(name)) if !name.is_empty() => {
                format!("{id} {} ({name:?})", self.backend_pid)
            }
            _ => format!("{id} {}", self.backend_pid),
        }
    }

    /// Everything known of it on one line, for `pgleader status`.
    pub fn describe(&self) -> String {
        let mut line = format!("{} {}", self.id_kind.name(), self.backend_pid);
        if let Some((pid, host)) = self.pgleader_process() {
            let _ = write!(line, ", pgleader pid {pid} on {host}");
            if let Some((schedule, ledger)) = self.fingerprints() {
                let _ = write!(line, ", schedule {schedule}");
                if let Some(ledger) = ledger {
                    let _ = write!(line, ", ledger {ledger}");
                }
            }
        } else if let Some(name) = &self.application_name
            && !name.is_empty()
        {
            let _ = write!(line, ", application {name:?}");
        }
        match (&self.client_address, self.client_port) {
            (Some(addr), Some(port)) if port > 0 => {
                let _ = write!(line, ", client {addr}:{port}");
            }
            (Some(addr), _) => {
                let _ = write!(line, ", client {addr}");
            }
            // PostgreSQL shows no address for a Unix-socket session; Redis shows none at all.
            (None, Some(-1)) | (None, None) if self.id_kind == SessionId::BackendPid => {
                line.push_str(", local socket");
            }
            _ => {}
        }
        if let Some(since) = &self.waiting_since {
            let _ = write!(line, ", waiting since {since}");
        } else if let Some(start) = &self.backend_start {
            let _ = write!(line, ", session started {start}");
        }
        line
    }
}

/// The fingerprints in a name `<name>#<schedule>[<ledger>]:<pid>@<host>`: the schedule's eight
/// hex digits, then the ledger's once the session has prepared it.
pub fn fingerprints_in(name: &str) -> Option<(&str, Option<&str>)> {
    let (name, _) = name.rsplit_once(':')?;
    let (_, fingerprint) = name.rsplit_once('#')?;
    if !fingerprint.chars().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    match fingerprint.len() {
        8 => Some((fingerprint, None)),
        16 => Some((&fingerprint[..8], Some(&fingerprint[8..]))),
        _ => None,
    }
}

/// This host's name, as pgleader shows it in session names, the ledger and `/status`.
pub fn host_name() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|name| name.into_string().ok())
        .unwrap_or_else(|| "unknown".into())
}

/// `<name>:<pid>@<host>`, where name is the user's application name or "pgleader", at most
/// [`MAX_LABEL`] bytes. With fingerprints (a scheduled pgleader's), `<name>#<fingerprints>:...`:
/// the fingerprints survive the cut.
pub fn label(user_given: Option<&str>, fingerprints: Option<&str>) -> String {
    let host = host_name();
    let mut prefix = user_given.unwrap_or("pgleader").to_owned();
    if let Some(fingerprints) = fingerprints {
        prefix.truncate(floor_char_boundary(&prefix, 32));
        prefix = format!("{prefix}#{fingerprints}");
    }
    let mut name = format!("{prefix}:{}@{}", std::process::id(), host);
    name.truncate(floor_char_boundary(&name, MAX_LABEL));
    name
}

/// The largest index at most `at` that cuts `text` between two characters.
fn floor_char_boundary(text: &str, at: usize) -> usize {
    let mut cut = at.min(text.len());
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    cut
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_label_fits_the_servers_limit() {
        let name = label(Some(&"x".repeat(80)), None);
        assert_eq!(name.len(), 63);
        let name = label(None, None);
        assert!(
            name.starts_with(&format!("pgleader:{}@", std::process::id())),
            "{name}"
        );
        let scheduled = label(Some(&"é".repeat(40)), Some("0a1b2c3d"));
        assert!(scheduled.contains("#0a1b2c3d:"), "{scheduled}");
    }

    #[test]
    fn reads_the_pgleader_pid_host_and_fingerprints_from_the_name() {
        let participant = Participant {
            backend_pid: 1,
            granted: true,
            application_name: Some("billing:job:4242@web-1.example".into()),
            ..Participant::default()
        };
        assert_eq!(
            participant.pgleader_process(),
            Some((4242, "web-1.example"))
        );
        assert_eq!(
            fingerprints_in("pgleader#0a1b2c3d:42@web-1"),
            Some(("0a1b2c3d", None))
        );
        assert_eq!(
            fingerprints_in("billing:x#0a1b2c3d99887766:42@web-1"),
            Some(("0a1b2c3d", Some("99887766")))
        );
        assert_eq!(fingerprints_in("pgleader:42@web-1"), None);
        assert_eq!(fingerprints_in("pgleader#xyz:42@web-1"), None);
    }
}
