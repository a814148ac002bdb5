//! The Redis membership's keeper: a keeper that runs no command and holds a sharded replica's
//! connection sockets, to say the replica's farewell should pgleader die between runs.
//! pgleader's side of it is `handle::MembershipKeeper`; what the farewell says is
//! `election/shards.rs`' and the backend's.

use std::io;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use tracing::info;

use crate::supervise::keeper::channel::{Request, read_request, wait_for_start};
use crate::supervise::keeper::farewell::{Farewells, Parent};

/// A membership's keeper: it starts no command and holds a replica's connection sockets, so
/// that when pgleader dies between its commands' runs someone is left to end the replica's
/// membership on the server at once (Redis: nobody is told when a connection closes; the
/// others' watcher would find it only at its next check).
///
/// Its channel ends only when every copy of pgleader's end is closed: pgleader's own, and the
/// copy each command's keeper holds (lent with the command's sockets, closed once that
/// command's whole tree is gone). So the end of the channel means pgleader is gone and no
/// command of the replica runs any more: its farewell may free everything the replica held,
/// the others take its jobs, and no run of them overlaps with one of the dead replica's.
/// [`KILL_EVERYTHING`] on the channel instead is pgleader, alive, dismissing it (the session is
/// over, or pgleader releases by itself): it exits without a word.
pub(super) fn hold_membership(mut channel: UnixStream) -> io::Result<i32> {
    let parent = Parent::watch();
    let Some(start) = wait_for_start(&channel)? else {
        return Ok(0);
    };
    if start.kill_now {
        return Ok(0);
    }
    loop {
        let mut fds = [PollFd::new(channel.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::NONE) {
            Err(Errno::EINTR) => continue,
            Err(err) => return Err(err.into()),
            Ok(_) => {}
        }
        match read_request(&mut channel) {
            Request::None | Request::Stopping => {}
            Request::KillEverything | Request::Abort => return Ok(0),
            Request::PgleaderGone => {
                let farewells = Farewells {
                    parent,
                    farewells: start.farewells,
                };
                if farewells.say_if_orphaned(&start.hold) > 0 {
                    info!(
                        event = "farewell",
                        "ended the dead replica's membership on the server: the others take its jobs"
                    );
                }
                return Ok(0);
            }
        }
    }
}
