//! systemd's notification protocol (`sd_notify`), spoken when `NOTIFY_SOCKET` is set: `READY=1`
//! once pgleader is connected and waiting for the lock or leading, `STATUS=` lines that say
//! whether it leads or follows and what it waits for, `STOPPING=1` on shutdown, and
//! `WATCHDOG=1` every half of `WATCHDOG_USEC`.
//!
//! Notifications are an output, like the log: the supervisor calls the functions below at its
//! transitions and never waits for or depends on them. They go out as datagrams on a
//! non-blocking socket, so a manager that does not read them can never stall pgleader; a
//! failed send is logged once and otherwise ignored. Without `NOTIFY_SOCKET` every call does
//! nothing.
//!
//! The watchdog pings come from a task on the runtime's one thread, the thread that runs the
//! supervisor: if that thread is stuck, the pings stop and systemd restarts the service.
//!
//! The command pgleader runs does not inherit `NOTIFY_SOCKET` and `WATCHDOG_*`
//! ([`PRIVATE_ENV`]): readiness and liveness are pgleader's to report.

use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tracing::{debug, warn};

use crate::election::lock::LockKey;

/// The variables that configure notifications; removed from the command's environment.
pub const PRIVATE_ENV: [&str; 3] = ["NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"];

/// Where notifications go, and whether the watchdog is ours to feed.
#[derive(Debug)]
struct Notifier {
    socket: UnixDatagram,
    address: SocketAddr,
    /// Shown in messages about this notifier.
    shown: String,
    ready_sent: AtomicBool,
    send_failed: AtomicBool,
}

static NOTIFIER: OnceLock<Option<Notifier>> = OnceLock::new();

/// What the environment asks for, before any socket is opened.
#[derive(Debug, PartialEq, Eq)]
pub struct Settings {
    /// `NOTIFY_SOCKET`: a path, or an abstract address when it starts with `@`.
    pub socket: Option<String>,
    /// Half of `WATCHDOG_USEC`, if the watchdog is on and meant for this process.
    pub watchdog: Option<Duration>,
    /// Why a watchdog that is set is not fed, for the log.
    pub watchdog_ignored: Option<String>,
}

impl Settings {
    /// Reads the variables through `var`, for the process `pid`.
    pub fn read(var: impl Fn(&str) -> Option<String>, pid: u32) -> Settings {
        let socket = var("NOTIFY_SOCKET").filter(|value| !value.is_empty());
        let mut watchdog = None;
        let mut watchdog_ignored = None;
        if let Some(usec) = var("WATCHDOG_USEC") {
            match usec.trim().parse::<u64>() {
                Ok(0) => {}
                Ok(usec) => {
                    // As sd_watchdog_enabled(3): WATCHDOG_PID, when set, names the process the
                    // watchdog is for; a command started by a watched service must not feed it.
                    match var("WATCHDOG_PID").map(|p| p.trim().parse::<u32>()) {
                        Some(Ok(owner)) if owner != pid => {
                            watchdog_ignored =
                                Some(format!("WATCHDOG_PID={owner} is not this process ({pid})"));
                        }
                        Some(Err(_)) => {
                            watchdog_ignored = Some("WATCHDOG_PID is not a number".to_owned());
                        }
                        _ => watchdog = Some(Duration::from_micros(usec) / 2),
                    }
                }
                Err(_) => watchdog_ignored = Some("WATCHDOG_USEC is not a number".to_owned()),
            }
        }
        if socket.is_none() && watchdog.is_some() {
            watchdog = None;
            watchdog_ignored = Some("WATCHDOG_USEC is set but NOTIFY_SOCKET is not".to_owned());
        }
        Settings {
            socket,
            watchdog,
            watchdog_ignored,
        }
    }
}

/// Reads `NOTIFY_SOCKET` and `WATCHDOG_*` and, if the watchdog is on, starts feeding it. Call
/// once, inside the runtime, before the supervisor starts.
pub fn init() {
    let settings = Settings::read(|name| std::env::var(name).ok(), std::process::id());
    if let Some(reason) = &settings.watchdog_ignored {
        debug!(
            event = "watchdog",
            "not feeding the systemd watchdog: {reason}"
        );
    }
    let notifier = settings
        .socket
        .as_deref()
        .and_then(|value| match Notifier::open(value) {
            Ok(notifier) => Some(notifier),
            Err(err) => {
                warn!(event = "notify_failed", socket = value, reason = %err, "cannot use NOTIFY_SOCKET; not notifying systemd");
                None
            }
        });
    let enabled = notifier.is_some();
    let _ = NOTIFIER.set(notifier);
    if let (true, Some(interval)) = (enabled, settings.watchdog) {
        debug!(
            event = "watchdog",
            "pinging the systemd watchdog every {}",
            humantime::format_duration(interval)
        );
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                send("WATCHDOG=1");
            }
        });
    }
}

impl Notifier {
    fn open(value: &str) -> io::Result<Notifier> {
        let address = match value.strip_prefix('@') {
            // Linux abstract namespace: the name after '@', no file involved.
            Some(name) => SocketAddr::from_abstract_name(name.as_bytes())?,
            None if value.starts_with('/') => SocketAddr::from_pathname(value)?,
            None => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "expected an absolute path or an abstract address starting with '@'",
                ));
            }
        };
        let socket = UnixDatagram::unbound()?;
        socket.set_nonblocking(true)?;
        Ok(Notifier {
            socket,
            address,
            shown: value.to_owned(),
            ready_sent: AtomicBool::new(false),
            send_failed: AtomicBool::new(false),
        })
    }

    fn send(&self, message: &str) {
        match self.socket.send_to_addr(message.as_bytes(), &self.address) {
            Ok(_) => {}
            // Only the first failure is worth a warning: the same cause repeats at every ping.
            Err(err) if !self.send_failed.swap(true, Ordering::Relaxed) => {
                warn!(event = "notify_failed", socket = %self.shown, reason = %err, "cannot notify systemd");
            }
            Err(err) => debug!(event = "notify_failed", reason = %err, "cannot notify systemd"),
        }
    }
}

fn notifier() -> Option<&'static Notifier> {
    NOTIFIER.get().and_then(Option::as_ref)
}

fn send(message: &str) {
    if let Some(notifier) = notifier() {
        notifier.send(message);
    }
}

/// A status line, with `READY=1` in front the first time pgleader is ready.
fn ready_with_status(status: &str) {
    if let Some(notifier) = notifier() {
        let first = !notifier.ready_sent.swap(true, Ordering::Relaxed);
        let ready = if first { "READY=1\n" } else { "" };
        notifier.send(&format!("{ready}STATUS={}", one_line(status)));
    }
}

/// Connected and queued for the lock: ready, as a follower.
pub fn following(lock: &LockKey) {
    ready_with_status(&format!("follower: waiting for lock {lock}"));
}

/// Holding the lock: ready, as the leader.
pub fn leading(lock: &LockKey, epoch: i64, command: &str) {
    ready_with_status(&format!(
        "leader of lock {lock} (epoch {epoch}), running: {}",
        shortened(command, 80)
    ));
}

/// A command line fit for one line of `systemctl status` (a whole shell script would not be).
fn shortened(text: &str, max_chars: usize) -> String {
    if text.chars().count() <= max_chars {
        return text.to_owned();
    }
    let mut short: String = text.chars().take(max_chars - 1).collect();
    short.push('…');
    short
}

/// Anything else worth showing in `systemctl status`: connecting, a failure, a lost
/// leadership. Does not make pgleader ready.
pub fn status(text: &str) {
    send(&format!("STATUS={}", one_line(text)));
}

/// pgleader is shutting down (TERM or INT).
pub fn stopping(text: &str) {
    send(&format!("STOPPING=1\nSTATUS={}", one_line(text)));
}

/// A notification is a list of newline-separated assignments: a newline in a value (a server
/// error message) would start a bogus one.
fn one_line(text: &str) -> String {
    text.replace('\n', " ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn read(vars: &[(&str, &str)], pid: u32) -> Settings {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Settings::read(|name| vars.get(name).cloned(), pid)
    }

    #[test]
    fn the_watchdog_is_fed_at_half_its_timeout_only_by_the_process_it_names() {
        let socket = ("NOTIFY_SOCKET", "@x");
        let on = read(&[socket, ("WATCHDOG_USEC", "3000000")], 42);
        assert_eq!(on.watchdog, Some(Duration::from_millis(1500)));
        let ours = read(
            &[socket, ("WATCHDOG_USEC", "3000000"), ("WATCHDOG_PID", "42")],
            42,
        );
        assert_eq!(ours.watchdog, Some(Duration::from_millis(1500)));
        let theirs = read(
            &[socket, ("WATCHDOG_USEC", "3000000"), ("WATCHDOG_PID", "7")],
            42,
        );
        assert_eq!(theirs.watchdog, None);
        assert!(theirs.watchdog_ignored.is_some());
        assert_eq!(read(&[socket, ("WATCHDOG_USEC", "0")], 42).watchdog, None);
        assert_eq!(read(&[("WATCHDOG_USEC", "3000000")], 42).watchdog, None);
        assert_eq!(read(&[], 42), read(&[("NOTIFY_SOCKET", "")], 42));
    }

    #[test]
    fn long_commands_are_shortened_for_the_status_line() {
        assert_eq!(shortened("./job.sh", 80), "./job.sh");
        let long = "x".repeat(100);
        let short = shortened(&long, 80);
        assert_eq!(short.chars().count(), 80);
        assert!(short.ends_with('…'));
    }

    #[test]
    fn a_relative_socket_path_is_refused() {
        assert!(Notifier::open("relative/path").is_err());
        assert!(Notifier::open("@abstract").is_ok());
        assert!(Notifier::open("/run/systemd/notify").is_ok());
    }
}
