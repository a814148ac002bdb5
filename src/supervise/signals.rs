//! The signals pgleader listens to, turned into one stream of events for the supervisor.
//!
//! TERM and INT mean "stop the child gracefully, release the lock, exit"; they are also passed
//! on to the child's process group, as are HUP, QUIT, USR1, USR2 and WINCH. CHLD means a child
//! may be waiting to be reaped (the job's keeper, or, when pgleader is PID 1 in a container, any
//! orphan the kernel handed to it).
//!
//! The supervisor reads a channel rather than the signal streams themselves, so a test or
//! another caller can feed it events without sending real signals. Note that once tokio has
//! installed a handler for a signal it stays installed for the life of the process: pgleader
//! must act on every TERM and INT itself.

use nix::sys::signal::Signal;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;

/// A signal, sorted by what it asks of pgleader.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SignalEvent {
    /// TERM or INT: pass it on, stop the child, release, exit.
    Shutdown(Signal),
    /// HUP, QUIT, USR1, USR2, WINCH: pass it on to the child's process group.
    Forward(Signal),
    /// CHLD: reap.
    ChildStateChanged,
    /// Not a signal: the crontab's content changed (`--inotify`, see `file_watch.rs`); read as
    /// HUP under `pgleader cron`.
    CrontabChanged,
}

/// The signals that are forwarded to the child without stopping pgleader.
pub const FORWARDED: [Signal; 5] = [
    Signal::SIGHUP,
    Signal::SIGQUIT,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
    Signal::SIGWINCH,
];

/// Starts listening. Must be called inside the runtime; the listeners live as long as the
/// runtime does. The sender is for events of other sources, told as signals are
/// ([`SignalEvent::CrontabChanged`]).
pub fn listen() -> std::io::Result<(
    mpsc::UnboundedSender<SignalEvent>,
    mpsc::UnboundedReceiver<SignalEvent>,
)> {
    let (tx, rx) = mpsc::unbounded_channel();
    let mut wanted = vec![
        (Signal::SIGTERM, SignalEvent::Shutdown(Signal::SIGTERM)),
        (Signal::SIGINT, SignalEvent::Shutdown(Signal::SIGINT)),
        (Signal::SIGCHLD, SignalEvent::ChildStateChanged),
    ];
    wanted.extend(FORWARDED.map(|sig| (sig, SignalEvent::Forward(sig))));
    for (sig, event) in wanted {
        let mut stream = signal(SignalKind::from_raw(sig as i32))?;
        let tx = tx.clone();
        tokio::spawn(async move {
            while stream.recv().await.is_some() {
                if tx.send(event).is_err() {
                    break;
                }
            }
        });
    }
    Ok((tx, rx))
}
