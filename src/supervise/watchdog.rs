//! The keeper's own deadline: how a keeper stops its command's tree by itself when news from
//! pgleader stops coming.
//!
//! pgleader promises that a leader's command is already stopping once no check has succeeded
//! for `--check-interval + --check-timeout`, and the lease rule (`election/lease.rs`) rests on
//! it. pgleader keeps that promise while it runs; a pgleader that does not run (stopped with
//! SIGSTOP, stuck writing to a pipe nobody reads, blocked on a hung file system, starved) cannot
//! stop anything, while its command goes on and the server frees the lock after the lease. The
//! keeper can: it is another process, it holds the session's sockets, and it already stops the
//! tree when pgleader dies.
//!
//! So each leadership (the single leader's session, a sharded replica's holder session) has a
//! [`Deadline`]: one 64-bit word in a memory page shared with every keeper that runs a command
//! for it (a memfd, handed over with the start message). It holds the leader's deadline on
//! `CLOCK_BOOTTIME` (a clock that keeps counting while the machine is suspended, so a resumed
//! VM grants its command no extra time), and pgleader renews it with each successful check: one
//! atomic store, no system call, no wake-up of anyone. Each keeper ([`Watch`]) sleeps on a
//! `timerfd` set to the deadline it last read (plus [`GRACE`], in which a pgleader that runs
//! acts first); when it fires, it reads the word again and either sets its timer to the renewed
//! deadline or, the deadline being past, marks the word expired and stops its tree by the rules
//! every stop follows: the kill signal to its process group,
//! `--kill-timeout`, then SIGKILL to everything the command started, the wait for the last
//! descendant, `--post-stop`.
//!
//! Expiry and renewal are one compare-and-swap each on the same word, so exactly one of them
//! wins a race: a renewal that comes late but before any keeper looked keeps the command
//! running; a keeper that looked first makes the renewal fail, and pgleader treats its
//! leadership as lost, as it would have. A late renewal never stops a command pgleader lets
//! run, and a keeper never stops a command later than the deadline pgleader itself promises.
//!
//! A stop pgleader began itself is its own business: it tells the keeper so (one byte, at the
//! stop's start), and the keeper no longer watches the deadline but only makes sure that the
//! SIGKILL comes `--kill-timeout` (and a little grace, [`GRACE`]) after that start,
//! should pgleader freeze in the middle of its stop. No command ever gets the stop signal twice.

use std::io;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::mman::{MapFlags, ProtFlags, mmap, munmap};
use nix::sys::signal::Signal;
use nix::sys::time::TimeSpec;
use nix::sys::timerfd::{
    ClockId as TimerClock, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags,
};
use nix::time::{ClockId, clock_gettime};
use thiserror::Error;

use crate::supervise::label::Label;

/// The word's value once a keeper found the deadline past: no renewal succeeds after it.
const EXPIRED: u64 = u64::MAX;

/// How long past a moment pgleader itself acts at (the deadline, the end of its kill timeout)
/// the keeper waits before it acts in pgleader's place: a pgleader that runs acts first (its
/// own stop at the deadline, after a silent partition, say, tells the keeper so), and only a
/// pgleader that does not run leaves it to the keeper. Taken from the margin the lease keeps
/// beyond the leader's deadline and kill timeout (`election::lease::MARGIN`, 1 s), so the
/// keeper's stop is still over before the server frees the lock.
pub const GRACE: Duration = Duration::from_millis(250);

/// The leadership's deadline expired: a keeper has begun (or finished) stopping its command.
#[derive(Clone, Copy, Debug, Error, PartialEq, Eq)]
#[error("the keepers' deadline expired")]
pub struct Expired;

/// How a keeper stops its tree by itself: the stop's rules, and how long without news that is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Terms {
    /// `--kill-signal`.
    pub signal: Signal,
    /// `--kill-timeout`.
    pub kill_timeout: Duration,
    /// `--check-interval + --check-timeout`: what the log says the command ran without news.
    pub without_news: Duration,
}

/// The current time on `CLOCK_BOOTTIME`, in nanoseconds.
fn boottime_now() -> u64 {
    // CLOCK_BOOTTIME exists on every kernel pgleader runs on (2.6.39 and later); the fallback
    // only keeps a type checker happy.
    let now = clock_gettime(ClockId::CLOCK_BOOTTIME)
        .or_else(|_| clock_gettime(ClockId::CLOCK_MONOTONIC))
        .unwrap_or_else(|_| TimeSpec::new(0, 0));
    (now.tv_sec() as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(now.tv_nsec() as u64)
}

/// `at` on the monotonic clock pgleader's timers use, as nanoseconds of `CLOCK_BOOTTIME`.
fn boottime_of(at: tokio::time::Instant) -> u64 {
    let (now, boot) = (tokio::time::Instant::now(), boottime_now());
    if at >= now {
        boot.saturating_add(nanos(at - now))
    } else {
        boot.saturating_sub(nanos(now - at))
    }
}

fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX - 1)
}

/// One shared word, mapped.
#[derive(Debug)]
struct Page {
    fd: OwnedFd,
    word: NonNull<AtomicU64>,
}

// SAFETY: the mapping is only ever accessed through the atomic it holds, which is Sync.
unsafe impl Send for Page {}
// SAFETY: as above.
unsafe impl Sync for Page {}

/// The length of the mapping: one word (the kernel maps a whole page).
const WORD: NonZeroUsize = NonZeroUsize::new(std::mem::size_of::<u64>()).unwrap();

impl Page {
    /// A new page, holding `value`.
    fn create(value: u64) -> io::Result<Page> {
        let fd = memfd_create(c"pgleader-deadline", MFdFlags::MFD_CLOEXEC)?;
        nix::unistd::ftruncate(&fd, WORD.get() as i64)?;
        let page = Page::map(fd)?;
        page.word().store(value, Ordering::Release);
        Ok(page)
    }

    /// Maps the page `fd` holds (created by [`Page::create`], in this process or pgleader).
    fn map(fd: OwnedFd) -> io::Result<Page> {
        // SAFETY: a new shared mapping of a memfd at least a word long, chosen by the kernel
        // (no address given), so it aliases nothing of this process; it is unmapped on drop.
        let at = unsafe {
            mmap(
                None,
                WORD,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                &fd,
                0,
            )?
        };
        Ok(Page {
            fd,
            word: at.cast(),
        })
    }

    fn word(&self) -> &AtomicU64 {
        // SAFETY: the mapping is page-aligned, a word long and lives as long as `self`; every
        // process that maps it reaches the word only through atomic operations.
        unsafe { self.word.as_ref() }
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `Page::map`, of that length, not referenced any more.
        let _ = unsafe { munmap(self.word.cast(), WORD.get()) };
    }
}

/// pgleader's side: a leadership's deadline, shared with the keepers of its commands.
#[derive(Clone, Debug)]
pub struct Deadline {
    page: Arc<Page>,
    terms: Terms,
}

impl Deadline {
    /// A new deadline at `at`, for keepers that stop by `terms`.
    pub fn new(terms: Terms, at: tokio::time::Instant) -> io::Result<Deadline> {
        Ok(Deadline {
            page: Arc::new(Page::create(boottime_of(at))?),
            terms,
        })
    }

    /// Moves the deadline to `at`, after a successful check; fails once a keeper found it
    /// past, whose command is then already stopping: the leadership is lost.
    pub fn renew(&self, at: tokio::time::Instant) -> Result<(), Expired> {
        let at = boottime_of(at);
        self.page
            .word()
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
                (now != EXPIRED).then_some(now.max(at))
            })
            .map(drop)
            .map_err(|_| Expired)
    }

    /// Whether a keeper found the deadline past (and so stops its command by itself). Read
    /// after telling a keeper that pgleader stops its command (`Job::tell_stopping`), it pairs
    /// with the keeper's expiry, which looks for that word after marking the deadline expired:
    /// one of the two sees the other's, so only one of them signals the command.
    pub fn has_expired(&self) -> bool {
        std::sync::atomic::fence(Ordering::SeqCst);
        self.page.word().load(Ordering::SeqCst) == EXPIRED
    }

    pub fn terms(&self) -> Terms {
        self.terms
    }

    /// The memfd, to hand to a keeper.
    pub fn fd(&self) -> RawFd {
        use std::os::fd::AsRawFd;
        self.page.fd.as_raw_fd()
    }

    /// Why a leadership whose deadline expired is lost, for the log.
    pub fn lost_reason(&self) -> String {
        lost_reason(self.terms.without_news)
    }
}

/// Whether this system lets pgleader share a deadline with its keepers (a memfd, mapped).
pub fn probe() -> io::Result<()> {
    Page::create(0).map(drop)
}

/// Why a leadership is lost when its keepers stopped its commands for lack of news.
pub fn lost_reason(without_news: Duration) -> String {
    format!(
        "pgleader itself did not run (stopped, hung or starved) past its deadline: with no \
         successful check for {} (--check-interval + --check-timeout), the keeper stopped the \
         command by itself",
        crate::time::for_people(without_news)
    )
}

/// The part of a start message that tells a keeper to watch a deadline: the terms and the
/// label of its command, as `start_message` carries them (the memfd travels as the message's
/// last descriptor).
pub fn encode(terms: Terms, label: &Label) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(terms.signal as i32).to_le_bytes());
    out.extend_from_slice(&millis(terms.kill_timeout).to_le_bytes());
    out.extend_from_slice(&millis(terms.without_news).to_le_bytes());
    out.extend_from_slice(&label.shard.map_or(-1, i64::from).to_le_bytes());
    out.extend_from_slice(label.job.as_deref().unwrap_or("").as_bytes());
    out
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// What [`encode`] wrote; `None` if the bytes are not that.
pub fn decode(bytes: &[u8]) -> Option<(Terms, Label)> {
    let signal = Signal::try_from(i32::from_le_bytes(bytes.get(..4)?.try_into().ok()?)).ok()?;
    let kill_timeout = u64::from_le_bytes(bytes.get(4..12)?.try_into().ok()?);
    let without_news = u64::from_le_bytes(bytes.get(12..20)?.try_into().ok()?);
    let shard = i64::from_le_bytes(bytes.get(20..28)?.try_into().ok()?);
    let job = std::str::from_utf8(bytes.get(28..)?).ok()?;
    let label = match (u32::try_from(shard), job) {
        (Ok(shard), _) => Label::shard(shard),
        (Err(_), "") => Label::leader(),
        (Err(_), job) => Label::job(job),
    };
    let terms = Terms {
        signal,
        kill_timeout: Duration::from_millis(kill_timeout),
        without_news: Duration::from_millis(without_news),
    };
    Some((terms, label))
}

/// What a keeper's watch asks of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Nothing now.
    Wait,
    /// The deadline passed without news: stop the tree (the kill signal to the group).
    Stop,
    /// `--kill-timeout` ran out (of the keeper's own stop, or of one pgleader began and did
    /// not follow up): SIGKILL to everything the command started.
    Escalate,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Asleep until the deadline it last read.
    Watching,
    /// pgleader stops the command itself; SIGKILL is the keeper's at this time if pgleader
    /// has not sent it by then.
    FollowingUp { kill_at: u64 },
    /// The keeper stops the command itself; SIGKILL at this time.
    Stopping { kill_at: u64 },
    /// SIGKILL went (after the keeper's own stop, or one pgleader began): nothing more to
    /// watch.
    Over { own: bool },
}

/// The keeper's side: the deadline it watches, on a timer of its own.
#[derive(Debug)]
pub struct Watch {
    page: Page,
    timer: TimerFd,
    pub terms: Terms,
    /// Whose command this is, for the log.
    pub label: Label,
    state: State,
}

impl Watch {
    /// Watches the deadline in the memfd `fd`, with `terms`, for the command `label` names.
    pub fn new(fd: OwnedFd, terms: Terms, label: Label) -> io::Result<Watch> {
        let page = Page::map(fd)?;
        let timer = TimerFd::new(
            TimerClock::CLOCK_BOOTTIME,
            TimerFlags::TFD_NONBLOCK | TimerFlags::TFD_CLOEXEC,
        )?;
        Ok(Watch {
            page,
            timer,
            terms,
            label,
            state: State::Watching,
        })
    }

    /// A watch of the same deadline, with the same terms, for another command, `label`: a
    /// session's keeper watches each run on its own (each may be stopped by pgleader or not).
    pub fn for_another(&self, label: Label) -> io::Result<Watch> {
        Watch::new(self.page.fd.try_clone()?, self.terms, label)
    }

    /// The timer, to poll: readable when [`Watch::check`] has something to say.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.timer.as_fd()
    }

    /// Reads the deadline and the timer: what to do now, with the timer set for the next look.
    /// Called once before the command starts (a deadline already past starts nothing), then
    /// whenever the timer is readable. `pgleader_stopping` says whether pgleader's word that it
    /// stops the command itself waits unread: asked after the word is marked expired, as
    /// pgleader reads the word after it sent that (see [`Deadline::has_expired`]), so that of
    /// two stops begun at once exactly one signals the command.
    pub fn check(&mut self, pgleader_stopping: impl FnOnce() -> bool) -> Step {
        let mut buf = [0u8; 8];
        // Drains the timer's count (nothing to read when called early).
        let _ = nix::unistd::read(&self.timer, &mut buf);
        let now = boottime_now();
        match self.state {
            State::Watching => {
                let word = self.page.word();
                let grace = nanos(GRACE);
                let mut seen = word.load(Ordering::Acquire);
                loop {
                    if seen != EXPIRED && seen.saturating_add(grace) > now {
                        self.arm(seen.saturating_add(grace));
                        return Step::Wait;
                    }
                    if seen == EXPIRED {
                        break;
                    }
                    match word.compare_exchange(seen, EXPIRED, Ordering::SeqCst, Ordering::SeqCst) {
                        Ok(_) => break,
                        Err(renewed) => seen = renewed,
                    }
                }
                if pgleader_stopping() {
                    // pgleader began its stop before it could see the expiry: the stop is its.
                    self.pgleader_stops_at(now);
                    return Step::Wait;
                }
                let kill_at = now.saturating_add(nanos(self.terms.kill_timeout));
                self.state = State::Stopping { kill_at };
                self.arm(kill_at);
                Step::Stop
            }
            State::FollowingUp { kill_at } | State::Stopping { kill_at } => {
                if now >= kill_at {
                    let own = matches!(self.state, State::Stopping { .. });
                    self.state = State::Over { own };
                    Step::Escalate
                } else {
                    self.arm(kill_at);
                    Step::Wait
                }
            }
            State::Over { .. } => Step::Wait,
        }
    }

    /// pgleader began stopping the command itself (its stop signal went to the group): the
    /// deadline is no longer watched, only the SIGKILL that must follow.
    pub fn pgleader_stops(&mut self) {
        if self.state == State::Watching {
            self.pgleader_stops_at(boottime_now());
        }
    }

    fn pgleader_stops_at(&mut self, now: u64) {
        let kill_at = now.saturating_add(nanos(self.terms.kill_timeout + GRACE));
        self.state = State::FollowingUp { kill_at };
        self.arm(kill_at);
    }

    /// Whether the stop under way is the keeper's own (rather than one pgleader began).
    pub fn stops_by_itself(&self) -> bool {
        matches!(
            self.state,
            State::Stopping { .. } | State::Over { own: true }
        )
    }

    /// Sets the timer for `at` (nanoseconds of `CLOCK_BOOTTIME`, absolute).
    fn arm(&self, at: u64) {
        let spec = TimeSpec::new(
            (at / 1_000_000_000) as libc::time_t,
            (at % 1_000_000_000) as libc::c_long,
        );
        // A timer that cannot be set would leave the command unwatched; it cannot fail with a
        // valid descriptor and time, so this only keeps going.
        let _ = self.timer.set(
            Expiration::OneShot(spec),
            TimerSetTimeFlags::TFD_TIMER_ABSTIME,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn terms() -> Terms {
        Terms {
            signal: Signal::SIGTERM,
            kill_timeout: Duration::from_millis(50),
            without_news: Duration::from_millis(30),
        }
    }

    fn watch_of(deadline: &Deadline) -> Watch {
        let fd = nix::unistd::dup(
            // SAFETY: the deadline's memfd, open for as long as `deadline` lives.
            unsafe { BorrowedFd::borrow_raw(deadline.fd()) },
        )
        .expect("dup");
        Watch::new(fd, deadline.terms(), Label::job("nightly")).expect("a watch")
    }

    fn wait_readable(watch: &Watch) {
        let mut fds = [nix::poll::PollFd::new(
            watch.fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        let n = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(2000u16)).expect("poll");
        assert_eq!(n, 1, "the watch's timer did not fire");
    }

    #[test]
    fn the_keeper_s_grace_leaves_room_in_the_lease_s_margin() {
        // The lease outlives the deadline and the kill timeout by MARGIN: a keeper that acts
        // GRACE late must still be done before the server frees the lock.
        assert!(GRACE * 2 <= crate::election::lease::MARGIN);
    }

    #[test]
    fn terms_and_label_survive_a_round_trip() {
        for label in [Label::leader(), Label::shard(7), Label::job("backup db")] {
            let bytes = encode(terms(), &label);
            assert_eq!(decode(&bytes), Some((terms(), label)));
        }
        assert_eq!(decode(b"short"), None);
    }

    #[test]
    fn a_renewed_deadline_keeps_the_command_and_a_missed_one_stops_it_once() {
        let now = tokio::time::Instant::now();
        let deadline = Deadline::new(terms(), now + Duration::from_millis(30)).expect("a deadline");
        let mut watch = watch_of(&deadline);
        assert_eq!(watch.check(|| false), Step::Wait);
        // Renewed before the keeper looks: it sleeps on.
        deadline
            .renew(now + Duration::from_millis(80))
            .expect("renewed");
        wait_readable(&watch);
        let step = watch.check(|| false);
        if step == Step::Wait {
            // The timer fired at the first deadline: the renewal was seen, and the timer set
            // again for the second one.
            wait_readable(&watch);
            assert_eq!(watch.check(|| false), Step::Stop);
        } else {
            assert_eq!(step, Step::Stop);
        }
        assert!(deadline.has_expired());
        assert!(watch.stops_by_itself());
        // No renewal succeeds after an expiry.
        assert_eq!(
            deadline.renew(tokio::time::Instant::now() + Duration::from_secs(10)),
            Err(Expired)
        );
        // The kill timeout: SIGKILL follows.
        wait_readable(&watch);
        assert_eq!(watch.check(|| false), Step::Escalate);
        assert!(watch.fd().as_raw_fd() >= 0);
    }

    #[test]
    fn a_stop_pgleader_began_is_only_followed_up() {
        let now = tokio::time::Instant::now();
        let deadline = Deadline::new(terms(), now + Duration::from_millis(10)).expect("a deadline");
        let mut watch = watch_of(&deadline);
        assert_eq!(watch.check(|| false), Step::Wait);
        watch.pgleader_stops();
        wait_readable(&watch);
        assert_eq!(watch.check(|| false), Step::Escalate);
        // The deadline was never the keeper's to expire.
        assert!(!deadline.has_expired());
        assert!(!watch.stops_by_itself());
    }
}
