//! The keeper's end of its channel: waiting, parked, for the start message, and reading
//! pgleader's requests while the command (or a hook) runs. The formats are `protocol.rs`'s.

use std::ffi::OsString;
use std::io::{self, IoSliceMut, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::errno::Errno;
use nix::sys::socket::{ControlMessageOwned, MsgFlags, recv, recvmsg};

use crate::election::socket::Farewell;
use crate::supervise::keeper::protocol::{
    ABORT, KILL_EVERYTHING, MAX_HELD, START, STOPPING, parse_body,
};
use crate::supervise::watchdog::{self, Watch};

/// What a parked keeper receives: the command's environment and the sockets to hold, or
/// nothing (end-of-file: pgleader is gone or no longer needs it).
pub(super) struct Start {
    pub(super) env: Vec<(OsString, OsString)>,
    pub(super) hold: Vec<OwnedFd>,
    /// What to say on each of `hold` if pgleader dies.
    pub(super) farewells: Vec<Option<Farewell>>,
    /// The leadership's deadline to watch, with its terms.
    pub(super) watch: Option<Watch>,
    /// pgleader asked for the end right after the start, before the keeper read either.
    pub(super) kill_now: bool,
    /// What came after the start message in the same read: a session's keeper's first
    /// requests (see `session.rs`).
    pub(super) rest: Vec<u8>,
}

/// Waits, parked, for the start message.
pub(super) fn wait_for_start(channel: &UnixStream) -> io::Result<Option<Start>> {
    let mut received = Vec::new();
    let mut hold = Vec::new();
    loop {
        let mut buf = [0u8; 4096];
        let mut cmsg = nix::cmsg_space!([RawFd; MAX_HELD + 1]);
        let mut iov = [IoSliceMut::new(&mut buf)];
        let message = match recvmsg::<()>(
            channel.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(message) => message,
            Err(Errno::EINTR) => continue,
            Err(err) => return Err(err.into()),
        };
        let n = message.bytes;
        for cmsg in message.cmsgs()? {
            if let ControlMessageOwned::ScmRights(fds) = cmsg {
                // SAFETY: the kernel has just installed these descriptors in this process
                // for us alone (close-on-exec, so the command does not inherit them).
                hold.extend(
                    fds.into_iter()
                        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                );
            }
        }
        if n == 0 {
            return Ok(None);
        }
        received.extend_from_slice(&buf[..n]);
        if received[0] != START {
            return Err(io::Error::other("unexpected message from pgleader"));
        }
        if received.len() >= 5 {
            let len = u32::from_le_bytes([received[1], received[2], received[3], received[4]]);
            let end = 5 + len as usize;
            if received.len() >= end {
                let (env, watch, farewells) = parse_body(&received[5..end])?;
                let mut watch = if watch.is_empty() {
                    None
                } else {
                    let (terms, label) = watchdog::decode(&watch)
                        .ok_or_else(|| io::Error::other("a deadline's terms that do not parse"))?;
                    let page = hold
                        .pop()
                        .ok_or_else(|| io::Error::other("a deadline without its memfd"))?;
                    Some(Watch::new(page, terms, label)?)
                };
                // pgleader began stopping the command right after its start.
                if received[end..].contains(&STOPPING)
                    && let Some(watch) = &mut watch
                {
                    watch.pgleader_stops();
                }
                return Ok(Some(Start {
                    env,
                    hold,
                    farewells,
                    watch,
                    kill_now: received[end..].contains(&KILL_EVERYTHING),
                    rest: received[end..].to_vec(),
                }));
            }
        }
    }
}

pub(super) enum Request {
    None,
    Stopping,
    KillEverything,
    Abort,
    PgleaderGone,
}

/// Whether pgleader's word that it stops the command itself ([`STOPPING`]) waits unread on the
/// channel; nothing is consumed.
pub(super) fn stopping_waits(channel: &UnixStream) -> bool {
    let mut buf = [0u8; 64];
    matches!(
        recv(channel.as_raw_fd(), &mut buf, MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT),
        Ok(n) if buf[..n].contains(&STOPPING)
    )
}

/// Reads what is waiting on the channel.
pub(super) fn read_request(channel: &mut UnixStream) -> Request {
    let mut buf = [0u8; 64];
    match channel.read(&mut buf) {
        Ok(0) => Request::PgleaderGone,
        Ok(n) if buf[..n].contains(&ABORT) => Request::Abort,
        Ok(n) if buf[..n].contains(&KILL_EVERYTHING) => Request::KillEverything,
        Ok(n) if buf[..n].contains(&STOPPING) => Request::Stopping,
        Ok(_) => Request::None,
        Err(err) if err.kind() == io::ErrorKind::Interrupted => Request::None,
        Err(_) => Request::PgleaderGone,
    }
}
