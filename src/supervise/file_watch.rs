//! `pgleader cron --inotify`: the crontab reread when its content changes, as supercronic's
//! `-inotify` does, a Kubernetes ConfigMap's update included.
//!
//! A ConfigMap mounted as a volume changes by a symlink swap: the file's path goes through
//! `..data`, a symlink in the mount's directory that the kubelet replaces (by a rename) with one
//! to a new directory, and the file read before is never written. Watching the file would miss
//! that. So what is watched is each directory on the way to the file: the path's own, and the
//! directory of every symlink's target on the way. Anything created, moved, written or removed
//! in them makes the file be read again, and only a content that differs from the one read
//! last asks for a reread (a directory's other files, a `touch`, the kubelet's cleaning up
//! change nothing). Events come in bursts (an editor's save, a swap): they are gathered for a
//! moment before the file is read. After each change the directories are looked up again, as a
//! swap changes where the links lead.
//!
//! A file that cannot be read (gone for a moment, mid-swap) is no change: the next event reads
//! it again. A new content that does not parse is the reread's to refuse, as for HUP: the
//! crontab read before keeps running, and the same bad content is not read twice.

use std::io;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc::UnboundedSender;
use tracing::{debug, info, warn};

use crate::supervise::signals::SignalEvent;

/// How long the events of one change are gathered before the file is read.
const SETTLE: Duration = Duration::from_millis(100);

/// The most symlinks followed on the way to the file (as the kernel's own limit).
const MOST_LINKS: usize = 40;

/// What makes a watched directory's content worth a look.
fn wanted() -> AddWatchFlags {
    AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_CLOSE_WRITE
        | AddWatchFlags::IN_MODIFY
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_DELETE_SELF
        | AddWatchFlags::IN_MOVE_SELF
}

/// Watches `path` from now on; each change of its content sends
/// [`SignalEvent::CrontabChanged`] on `events`. The directories that cannot be watched are an
/// error at once (exit status 1: a replica that was asked to follow its file and cannot).
pub fn spawn(path: PathBuf, events: UnboundedSender<SignalEvent>) -> io::Result<()> {
    let mut watch = Watch::new(&path)?;
    let mut known = std::fs::read(&path).ok();
    tokio::spawn(async move {
        loop {
            if let Err(err) = watch.changed().await {
                warn!(event = "inotify_failed", path = %path.display(), reason = %err, "cannot watch the crontab any more (--inotify); HUP or USR2 still reread it");
                return;
            }
            tokio::time::sleep(SETTLE).await;
            watch.forget_pending();
            let now = std::fs::read(&path).ok();
            if now.is_some() && now != known {
                known = now;
                info!(event = "crontab_changed", path = %path.display(), "the crontab changed (--inotify): rereading it");
                if events.send(SignalEvent::CrontabChanged).is_err() {
                    return;
                }
            }
            // A swap changes where the links lead.
            if watch.directories != directories(&path) {
                match Watch::new(&path) {
                    Ok(again) => watch = again,
                    Err(err) => {
                        debug!(event = "inotify_failed", reason = %err, "cannot watch the crontab's new directories yet")
                    }
                }
            }
        }
    });
    Ok(())
}

/// An inotify instance watching the directories on the way to a file.
struct Watch {
    fd: AsyncFd<Instance>,
    directories: Vec<PathBuf>,
}

/// The instance, as tokio polls it.
struct Instance(Inotify);

impl AsRawFd for Instance {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

impl Watch {
    fn new(path: &Path) -> io::Result<Watch> {
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)?;
        let directories = directories(path);
        for directory in &directories {
            inotify.add_watch(directory, wanted()).map_err(|err| {
                io::Error::other(format!("cannot watch {}: {err}", directory.display()))
            })?;
        }
        // SAFETY: the instance owns its descriptor, open until the `AsyncFd` (its only owner)
        // drops it, and `as_raw_fd` always gives that one.
        let fd = unsafe { AsyncFd::register_with_interest(Instance(inotify), Interest::READABLE) }
            .map_err(|err| err.into_parts().1)?;
        Ok(Watch { fd, directories })
    }

    /// Waits for the next events in the directories, and takes them.
    async fn changed(&mut self) -> io::Result<()> {
        loop {
            let mut ready = self.fd.readable().await?;
            // Nothing to read (`Err`): tokio waits for the next readiness.
            match ready.try_io(|fd| fd.get_ref().0.read_events().map_err(io::Error::from)) {
                Ok(Ok(events)) if !events.is_empty() => return Ok(()),
                Ok(Ok(_)) | Err(_) => continue,
                Ok(Err(err)) => return Err(err),
            }
        }
    }

    /// Drops the events that came while the change settled: the file is read after them.
    fn forget_pending(&mut self) {
        while let Ok(events) = self.fd.get_ref().0.read_events() {
            if events.is_empty() {
                break;
            }
        }
    }
}

/// The directories on the way to `path`: its own, and for each symlink on the way (the path's
/// last part, then its target's, ...), the directory of its target.
pub fn directories(path: &Path) -> Vec<PathBuf> {
    let mut directories = Vec::new();
    let mut at = std::path::absolute(path).unwrap_or_else(|_| path.to_owned());
    for _ in 0..MOST_LINKS {
        let directory = at
            .parent()
            .map_or_else(|| PathBuf::from("/"), Path::to_owned);
        if !directories.contains(&directory) {
            directories.push(directory.clone());
        }
        match std::fs::read_link(&at) {
            Ok(target) => at = directory.join(target),
            Err(_) => break,
        }
    }
    directories
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_directories_of_a_configmap_s_links_are_all_watched() {
        // A ConfigMap's volume: crontab -> ..data/crontab, ..data -> ..2026_11_28/.
        let dir = std::env::temp_dir().join(format!("pgleader-watch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let version = dir.join("..2026_11_28");
        std::fs::create_dir_all(&version).expect("a directory");
        std::fs::write(version.join("crontab"), "* * * * * true\n").expect("a file");
        std::os::unix::fs::symlink("..2026_11_28", dir.join("..data")).expect("a link");
        std::os::unix::fs::symlink("..data/crontab", dir.join("crontab")).expect("a link");
        let found = directories(&dir.join("crontab"));
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(found, vec![dir.clone(), dir.join("..data")]);
    }
}
