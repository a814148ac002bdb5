//! What the election needs of a connection socket that a backend opens itself (PostgreSQL and
//! Redis both dial their servers rather than let their drivers do it): keepalives that add up to
//! the lease, and a descriptor that can be lent to the keeper.
//!
//! The keeper holds a leader's socket until the command's whole tree is gone, so that a kill -9
//! of pgleader frees the lock only after the last process of that tree (see
//! [`Session::sockets`](super::Session::sockets)). A backend lends the socket's number, which
//! stays valid only while its driver runs: [`LentSocket`] remembers which file the number named.
//!
//! A backend whose server does not free the lock when the connection closes (Redis: a key lives
//! until its TTL) also gives the keeper a [`Farewell`] for the socket: a command the keeper
//! writes on it, once pgleader died and the whole tree is gone, to release the lock at once
//! (see `supervise/keeper/farewell.rs`).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::time::Duration;

use nix::sys::socket::{setsockopt, sockopt};

use crate::election::lease::Lease;

/// Keepalives that give up on a silent server within about a lease, so that a waiting follower
/// notices a dead server, and a user timeout for unacknowledged data. Failures are ignored: a
/// socket without them still works, it only notices a dead peer later.
pub fn keepalives(socket: BorrowedFd<'_>, lease: &Lease) {
    let seconds = |duration: Duration| u32::try_from(duration.as_secs()).unwrap_or(u32::MAX);
    let _ = setsockopt(&socket, sockopt::KeepAlive, &true);
    let _ = setsockopt(
        &socket,
        sockopt::TcpKeepIdle,
        &seconds(lease.keepalive_idle()),
    );
    let _ = setsockopt(
        &socket,
        sockopt::TcpKeepInterval,
        &seconds(lease.keepalive_interval()),
    );
    let _ = setsockopt(&socket, sockopt::TcpKeepCount, &lease.keepalive_count());
    let _ = setsockopt(
        &socket,
        sockopt::TcpUserTimeout,
        &u32::try_from(lease.duration().as_millis()).unwrap_or(u32::MAX),
    );
}

/// A connection socket's descriptor, owned by a driver task, with what tells it from a later
/// descriptor of the same number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LentSocket {
    fd: RawFd,
    /// The socket's device and inode.
    id: (u64, u64),
}

impl LentSocket {
    /// Remembers `socket`, which the caller is about to hand to its driver.
    pub fn of(socket: &impl AsFd) -> io::Result<LentSocket> {
        let fd = socket.as_fd();
        let stat = nix::sys::stat::fstat(fd)?;
        Ok(LentSocket {
            fd: fd.as_raw_fd(),
            id: (stat.st_dev, stat.st_ino),
        })
    }

    /// The descriptor, if it still is this socket. When the connection ends (the server closed
    /// it), the driver closes the socket and its number goes to the next descriptor opened: a
    /// keeper handed that number would hold some other file, typically pgleader's own end of
    /// the keeper's channel (opened just before the keeper starts). The keeper would then hold
    /// both ends, never see pgleader die, and keep the command running after a kill -9 of
    /// pgleader, into the next leader's run (the quorum nemesis, seed 13746908687529957116).
    pub fn open(&self) -> Option<RawFd> {
        // SAFETY: the borrow lasts only for this fstat, which merely inspects whatever the number
        // names now (nothing, or another file: both are what this checks for).
        let fd = unsafe { BorrowedFd::borrow_raw(self.fd) };
        let stat = nix::sys::stat::fstat(fd).ok()?;
        ((stat.st_dev, stat.st_ino) == self.id).then_some(self.fd)
    }
}

/// What the keeper is lent: a connection socket, and what to say on it if pgleader dies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lent {
    pub fd: RawFd,
    pub farewell: Option<Farewell>,
}

impl Lent {
    /// A socket the keeper only holds (PostgreSQL: the server frees the lock itself when the
    /// connection closes; Redis over TLS: another process cannot write on it).
    pub fn hold(fd: RawFd) -> Lent {
        Lent { fd, farewell: None }
    }
}

/// A command, in the server's own wire format, that ends a leadership on the server (compare,
/// then release, then wake the waiters), and the bytes its answer carries, so that the keeper
/// can tell that the server has run it (and not merely received it) before it closes the socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Farewell {
    pub command: Vec<u8>,
    pub marker: Vec<u8>,
}

impl Farewell {
    /// A fresh marker: unique to one farewell, so that no other answer on the socket (another
    /// keeper's, on a socket several keepers share) can be mistaken for this one's.
    pub fn marker() -> String {
        format!(
            "pgleader-farewell-{:016x}{:016x}",
            fastrand::u64(..),
            fastrand::u64(..)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_lent_socket_is_not_mistaken_for_the_next_file_of_its_number() {
        let (socket, _peer) = UnixStream::pair().expect("socketpair");
        let lent = LentSocket::of(&socket).expect("fstat");
        assert_eq!(lent.open(), Some(socket.as_raw_fd()));
        // Another file under the socket's number, as after the driver closed it and something
        // else was opened (dup2 rather than close and reopen: other tests open files meanwhile).
        let mut number = std::os::fd::OwnedFd::from(socket);
        let (other, _other_peer) = UnixStream::pair().expect("socketpair");
        nix::unistd::dup2(&other, &mut number).expect("dup2");
        assert_eq!(number.as_raw_fd(), lent.fd);
        assert_eq!(lent.open(), None);
    }

    #[test]
    fn keepalives_add_up_to_the_lease() {
        use nix::sys::socket::getsockopt;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let tcp = std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("dial");
        let lease = Lease::new(Duration::from_secs(15));
        keepalives(tcp.as_fd(), &lease);
        let fd = tcp.as_fd();
        assert!(getsockopt(&fd, sockopt::KeepAlive).expect("SO_KEEPALIVE"));
        let idle = getsockopt(&fd, sockopt::TcpKeepIdle).expect("TCP_KEEPIDLE");
        let interval = getsockopt(&fd, sockopt::TcpKeepInterval).expect("TCP_KEEPINTVL");
        let count = getsockopt(&fd, sockopt::TcpKeepCount).expect("TCP_KEEPCNT");
        assert!(
            u64::from(idle + interval * count) >= 15,
            "{idle}+{interval}x{count}"
        );
        assert_eq!(
            getsockopt(&fd, sockopt::TcpUserTimeout).expect("TCP_USER_TIMEOUT"),
            15_000
        );
    }
}
