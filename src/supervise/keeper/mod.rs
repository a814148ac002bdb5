//! The keeper: a small process of pgleader's own that leads the command's process group, so
//! that nothing in that group outlives pgleader.
//!
//! A parent-death signal reaches only a direct child. When the command is a shell script, the
//! `pg_dump` it started would live on after a `kill -9` of pgleader and overlap with the next
//! leader's run. So pgleader does not start the command itself: it starts this keeper (its own
//! binary, re-executed under the name `pgleader-keeper`) as the leader of a new process group,
//! and the keeper starts the command inside that group.
//!
//! The keeper is started before it is needed: pgleader parks one while it waits for the lock,
//! so that winning costs one fork and exec (the command's), not two. A parked keeper has set
//! itself up (signals blocked, subreaper) and waits on its channel for the one message that
//! only the new leader can send: the command's environment (`PGLEADER_EPOCH` and the rest,
//! known once the fencing token is taken) and, by `SCM_RIGHTS`, the leader's connection sockets
//! to hold. End-of-file instead (pgleader died while following, or dropped it) makes it exit:
//! it has started nothing. A parked keeper serves one command, then exits with it; the next
//! leadership or occurrence gets a fresh one. The keeper:
//!
//! - holds one end of a socket pair whose other end only pgleader holds. When pgleader dies, by
//!   any means, the kernel closes its end, the keeper reads end-of-file and SIGKILLs every
//!   process that descends from it, then exits. Unlike a parent-death signal this does not depend
//!   on which thread of pgleader did the spawning. pgleader uses the same path, by sending one
//!   byte, when its kill timeout runs out;
//! - gives the command a parent-death signal (SIGKILL) of its own, in case the keeper itself is
//!   killed (the keeper is single-threaded, so the thread that spawns is the one that lives);
//! - keeps every signal blocked, so the signals pgleader sends to the group reach the command
//!   and its descendants but not the keeper (SIGKILL, which cannot be blocked, takes it too);
//! - is a child subreaper: descendants orphaned inside the job are reparented to it, so it can
//!   tell when the whole tree is gone (even processes that left the process group with setsid),
//!   and reaps them meanwhile;
//! - starts the command with a child that shares its memory until `execve` (see [`spawn`]),
//!   so that starting costs no copy of the keeper;
//! - reports over the socket: the command's pid once it has been executed (the keeper resumes
//!   only after `execve` succeeded or failed), or why it could not start, and
//!   the command's exit status once it ends, and that nothing is left (then it exits) once it
//!   has no children left: being a subreaper, it has then outlived every descendant, so
//!   pgleader can release the lock without waiting for the keeper's own exit or reading the
//!   process table;
//! - holds copies of the leader's connection sockets (where the backend lends them) until it
//!   has reaped its last child, and closes them then, before its own exit. When pgleader is
//!   killed -9, the server sees that connection close only once the keeper has killed and
//!   reaped the whole tree, so no follower can take over while any of it still runs;
//! - when pgleader died, says the leader's farewell on those sockets before it closes them
//!   (Redis, see [`farewell`]): it ends the leadership on the server at once, so a follower
//!   takes over the moment the old tree is gone rather than at its next check.
//!
//! A sharded replica's session whose commands have no hooks (`pgleader cron`) has one keeper
//! for all of them instead, started with the session and keeping every promise above for each
//! run ([`session`]): a keeper per run was a process per due job, and a thousand jobs falling
//! due at once held a thousand.
//!
//! Two processes' code lives here, and the files say which runs where:
//!
//! - [`protocol`], both: the keeper's arguments, the start message, the request bytes and the
//!   reports, each writer beside its reader (a session's keeper's in `protocol/session.rs`);
//! - [`handle`], pgleader only: the command it checks, the keeper it parks, starts and
//!   signals ([`handle::Parked`], [`handle::Job`], [`handle::MembershipKeeper`],
//!   [`handle::SessionKeeper`]);
//! - everything else, the keeper's own process only: its way in and its run (`process.rs`), its
//!   end of the channel (`channel.rs`), the command's tree (`tree.rs`), the hooks it runs
//!   (`hooks.rs`, what a hook is being `supervise/hook.rs`), the command's start
//!   ([`spawn`]), the farewell ([`farewell`]), a crontab job's output as log lines
//!   (`output.rs`), the Redis membership's keeper (`membership.rs`) and a session's keeper
//!   ([`session`]). `keeper.ld` gathers these files' code, and the readers of
//!   `protocol.rs`, by their symbols' paths (so not `handle.rs`): a function moved to another
//!   file may move in or out of the keeper's resident pages.

pub mod handle;
pub mod protocol;

mod channel;
mod farewell;
mod hooks;
mod membership;
pub(crate) mod output;
mod process;
mod session;
mod spawn;
mod tree;

pub use process::main;
pub use protocol::is_keeper_invocation;
