//! The keeper's farewell: how a keeper ends a dead pgleader's leadership on a Redis server
//! itself, the moment the command's whole tree is gone, instead of leaving it to the followers'
//! next check.
//!
//! A PostgreSQL server frees an advisory lock when the connection closes, so holding the
//! leader's socket until the tree is gone and then closing it is all a keeper must do. A Redis
//! key outlives its connection: once the keeper closes the socket, a follower notices only at
//! its next check (by the holder's liveness channel), a check interval later. So with each lent
//! Redis socket the leader hands the keeper a farewell ([`Farewell`]): a script in RESP that
//! releases the key only if it still carries this leadership's nonce, wakes the first waiter
//! (its wake list) and publishes the release (what a quorum's followers wait for), answering
//! with a marker unique to that farewell. For a shard it releases that shard, and the membership
//! with the replica's last shard, which makes the others deal its share out at once.
//!
//! The keeper says it only when pgleader died: its channel read end-of-file and pgleader is
//! gone ([`Parent`], a pidfd). A live pgleader releases by itself, and a farewell written beside
//! its driver would hand that driver an answer it never asked for.
//!
//! Pitfalls, and what this does about each:
//! - **Unread data.** The connection speaks RESP3: tracking invalidations, pub/sub messages and
//!   answers to the dead pgleader's last commands may wait unread in the socket's receive
//!   queue. Closing a TCP socket with unread data sends a reset rather than a FIN, which
//!   throws away what of the command the kernel has not sent yet (on loopback, where sending is
//!   immediate, it still ran 200 times of 200; across a network it need not). So the keeper
//!   closes only
//!   once the server's answer, carrying the farewell's marker, has arrived (the server has run
//!   the script), or after [`TIMEOUT`] (then the lease and the next check bound the takeover, as
//!   they did before).
//! - **A shared socket.** The keepers of one replica's shards all hold copies of its one holder
//!   connection, and each says the farewell of its own shard. Each reads with `MSG_PEEK` and
//!   never consumes, so no keeper takes another's answer; the last one to close may send a
//!   reset, but by then every keeper that closed before had seen its answer, and so its command
//!   run. Waiting on a queue that holds data without the marker polls every millisecond (poll
//!   would report the data again at once), bounded by [`TIMEOUT`]. Each farewell (a few KiB)
//!   goes out in one `send`, which the kernel copies whole, under the socket's lock, unless the
//!   send buffer is full; then the rest follows later and two keepers' farewells could
//!   interleave: the server answers with errors, the markers never come, and both close after
//!   [`TIMEOUT`], as before this existed.
//! - **TLS.** Bytes written on the socket by another process would break pgleader's TLS
//!   session, and the keeper has no TLS stack (nor should it: it must stay small). A TLS
//!   connection is lent without a farewell: the takeover waits for the next check, as before.
//! - **A quorum.** One socket per server, each with its own farewell: the keeper writes them
//!   all, then waits for every answer it can get; a release on a majority lets a follower win.
//! - **A command pgleader was writing when it died.** Its rest would be read as the farewell's
//!   start: the server answers with an error, the marker never comes, and the keeper closes
//!   after [`TIMEOUT`].
//!
//! Everything is blocking system calls in the keeper's one thread, and a 64 KiB buffer
//! allocated only when a farewell is said.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::socket::{MsgFlags, recv, send};
use nix::unistd::{Pid, getppid};

use crate::election::socket::Farewell;

/// The longest the keeper waits for the server's answers before it closes the sockets anyway.
pub const TIMEOUT: Duration = Duration::from_secs(1);

/// How long the keeper waits, after its channel ended, for pgleader's exit to complete (the
/// kernel closes a dying process's files just before it reparents its children).
const PARENT_EXIT: Duration = Duration::from_millis(100);

/// The most the keeper reads (peeks) of a socket's receive queue.
const PEEK: usize = 64 * 1024;

/// pgleader, the keeper's parent, watched from the keeper's start: whether it has died.
#[derive(Debug)]
pub struct Parent {
    pid: Pid,
    /// A pidfd (Linux 5.3 and later): readable once the process has exited.
    pidfd: Option<OwnedFd>,
}

impl Parent {
    /// Watches the parent the keeper has now.
    pub fn watch() -> Parent {
        let pid = getppid();
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1; it
        // touches no memory of ours.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid.as_raw(), 0) };
        // SAFETY: a non-negative answer is a descriptor the kernel just opened for us alone.
        let pidfd = (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) });
        // Opened after pgleader died, the pidfd may name whoever has its pid now: only a
        // parent that is still ours makes it pgleader's.
        let pidfd = pidfd.filter(|_| getppid() == pid);
        Parent { pid, pidfd }
    }

    /// Whether the parent has exited, waiting up to [`PARENT_EXIT`] for an exit under way.
    fn is_gone(&self) -> bool {
        match &self.pidfd {
            Some(pidfd) => {
                let mut fds = [PollFd::new(pidfd.as_fd(), PollFlags::POLLIN)];
                loop {
                    match poll(&mut fds, millis(PARENT_EXIT)) {
                        Err(Errno::EINTR) => continue,
                        Ok(ready) => return ready > 0,
                        Err(_) => return getppid() != self.pid,
                    }
                }
            }
            None => {
                let deadline = Instant::now() + PARENT_EXIT;
                while getppid() == self.pid {
                    if Instant::now() >= deadline {
                        return false;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                true
            }
        }
    }
}

/// Whether the keeper's channel from pgleader has ended (end-of-file waits in it), read
/// without taking anything from it.
pub fn channel_ended(channel: BorrowedFd<'_>) -> bool {
    let mut byte = [0u8; 1];
    matches!(
        recv(
            channel.as_raw_fd(),
            &mut byte,
            MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT
        ),
        Ok(0)
    )
}

/// What the keeper says, if pgleader died, before it closes the leader's sockets.
#[derive(Debug)]
pub struct Farewells {
    pub parent: Parent,
    /// One per held socket, in order; empty when the start message carried none.
    pub farewells: Vec<Option<Farewell>>,
}

impl Farewells {
    /// Says each farewell on its socket if pgleader has died, and waits until the server has
    /// answered each (or [`TIMEOUT`]). Returns how many were answered.
    pub fn say_if_orphaned(&self, held: &[OwnedFd]) -> usize {
        if self.farewells.len() != held.len() || self.farewells.iter().all(Option::is_none) {
            return 0;
        }
        if !self.parent.is_gone() {
            return 0;
        }
        let pairs: Vec<(BorrowedFd<'_>, &Farewell)> = held
            .iter()
            .zip(&self.farewells)
            .filter_map(|(fd, farewell)| Some((fd.as_fd(), farewell.as_ref()?)))
            .collect();
        say(&pairs, Instant::now() + TIMEOUT)
    }
}

/// Writes each farewell, then waits, up to `deadline`, for each answer's marker.
fn say(pairs: &[(BorrowedFd<'_>, &Farewell)], deadline: Instant) -> usize {
    let mut pending: Vec<&(BorrowedFd<'_>, &Farewell)> = pairs
        .iter()
        .filter(|(fd, farewell)| write_all(*fd, &farewell.command, deadline).is_ok())
        .collect();
    let mut answered = 0;
    let mut buf = vec![0u8; PEEK];
    while !pending.is_empty() {
        let mut busy = false;
        let mut done = vec![false; pending.len()];
        for (at, (fd, farewell)) in pending.iter().enumerate() {
            let peeked = recv(
                fd.as_raw_fd(),
                &mut buf,
                MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT,
            );
            done[at] = match peeked {
                Ok(n) if contains(&buf[..n], &farewell.marker) => {
                    answered += 1;
                    true
                }
                // The server closed the connection, or the queue holds more than is read here
                // without the answer in what is: nothing more to wait for.
                Ok(0) => true,
                Ok(n) if n == buf.len() => true,
                Ok(_) => {
                    busy = true;
                    false
                }
                Err(Errno::EAGAIN | Errno::EINTR) => false,
                Err(_) => true,
            };
        }
        let mut at = 0;
        pending.retain(|_| {
            at += 1;
            !done[at - 1]
        });
        let left = deadline.saturating_duration_since(Instant::now());
        if pending.is_empty() || left.is_zero() {
            break;
        }
        // Sockets with data but no answer yet would make poll return at once: look again in a
        // millisecond. Otherwise sleep until some answer arrives.
        let wait = if busy {
            Duration::from_millis(1).min(left)
        } else {
            left
        };
        let mut fds: Vec<PollFd<'_>> = pending
            .iter()
            .map(|(fd, _)| PollFd::new(*fd, PollFlags::POLLIN))
            .collect();
        let _ = poll(&mut fds, millis(wait));
    }
    answered
}

/// Writes all of `bytes` on a (possibly non-blocking) socket by `deadline`.
fn write_all(fd: BorrowedFd<'_>, mut bytes: &[u8], deadline: Instant) -> io::Result<()> {
    while !bytes.is_empty() {
        match send(
            fd.as_raw_fd(),
            bytes,
            MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT,
        ) {
            Ok(n) => bytes = &bytes[n..],
            Err(Errno::EINTR) => {}
            Err(Errno::EAGAIN) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::ErrorKind::TimedOut.into());
                }
                let _ = poll(&mut [PollFd::new(fd, PollFlags::POLLOUT)], millis(left));
            }
            Err(err) => return Err(err.into()),
        }
    }
    Ok(())
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty()
        && haystack
            .windows(needle.len())
            .any(|window| window == needle)
}

fn millis(duration: Duration) -> PollTimeout {
    PollTimeout::try_from(duration.as_millis().clamp(0, 60_000) as i32).unwrap_or(PollTimeout::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;

    fn farewell(command: &str, marker: &str) -> Farewell {
        Farewell {
            command: command.as_bytes().to_vec(),
            marker: marker.as_bytes().to_vec(),
        }
    }

    #[test]
    fn a_farewell_waits_for_its_own_answer_and_leaves_the_others_in_the_queue() {
        // Two keepers' farewells on one shared socket: each sees its own answer, whoever
        // answered first, and neither takes the other's out of the queue.
        let (ours, mut server) = UnixStream::pair().expect("socketpair");
        let a = farewell("A?", "answer-a");
        let b = farewell("B?", "answer-b");
        let writer = std::thread::spawn(move || {
            let mut got = [0u8; 2];
            server.read_exact(&mut got).expect("B's farewell");
            server
                .write_all(b">2\r\n:1\r\n$8\r\nanswer-b\r\n")
                .expect("b");
            std::thread::sleep(Duration::from_millis(20));
            server
                .write_all(b">2\r\n:1\r\n$8\r\nanswer-a\r\n")
                .expect("a");
            server
        });
        let deadline = Instant::now() + Duration::from_secs(5);
        let fd = ours.as_fd();
        assert_eq!(say(&[(fd, &b)], deadline), 1);
        assert_eq!(say(&[(fd, &a)], deadline), 1);
        let _server = writer.join().expect("the server thread");
        assert!(Instant::now() < deadline);
        let mut queued = [0u8; 64];
        let n = recv(fd.as_raw_fd(), &mut queued, MsgFlags::MSG_DONTWAIT).expect("still queued");
        assert!(contains(&queued[..n], b"answer-b"));
    }

    #[test]
    fn a_farewell_without_an_answer_gives_up_at_its_deadline() {
        let (ours, _server) = UnixStream::pair().expect("socketpair");
        let start = Instant::now();
        let silent = farewell("?", "never");
        assert_eq!(
            say(
                &[(ours.as_fd(), &silent)],
                start + Duration::from_millis(50)
            ),
            0
        );
        assert!(start.elapsed() >= Duration::from_millis(50));
        assert!(start.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn the_end_of_the_channel_is_seen_without_reading_it() {
        let (ours, theirs) = UnixStream::pair().expect("socketpair");
        assert!(!channel_ended(ours.as_fd()));
        drop(theirs);
        assert!(channel_ended(ours.as_fd()));
    }
}
