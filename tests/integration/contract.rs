//! The election's contract (`src/election/mod.rs`), written once and run against every backend,
//! the way object_store's `integration.rs` runs one suite against every store: acquire, wait in
//! order, confirm, lose by the connection's end, lose by a failed check, release, epochs that
//! increase, a wait that is abandoned, and a ledger claim refused without leadership.
//!
//! A backend joins the suite by implementing [`Subject`] (how to make a backend for a fresh
//! lock, and how the server ends a session) and one line of [`contract_suite!`]. PostgreSQL, one
//! Redis server and a Redlock quorum of three run it; a backend says what it does not promise
//! (a quorum does not queue its waiters and keeps no ledger yet) through [`Subject`].

use std::future::Future;
use std::time::Duration;

use pgleader::election::ledger::{Claim, Claimant, Definition, Ledger};
use pgleader::election::lock::LockKey;
use pgleader::election::{Backend, Check, Confirmation, Observer, Session};

use crate::harness::{Cluster, Redis, WAIT, unique_lock, within};

/// A backend under test.
pub trait Subject {
    type Backend: Backend;

    /// A backend for a lock no other test uses.
    fn backend(&self) -> Self::Backend;

    /// The server ends the session with this id, as an administrator would (PostgreSQL's
    /// `pg_terminate_backend`, Redis' `CLIENT KILL`).
    fn end_session(&self, id: i32);

    /// Whether the server notices at once that a waiting client went away. Where it cannot
    /// (PostgreSQL 13 has no `client_connection_check_interval`), an abandoned waiter leaves
    /// the queue only when it is granted the lock, and frees it at that moment.
    fn drops_dead_waiters(&self) -> bool;

    /// Starts the server, outside the test's runtime (the harness's clients block).
    fn prepare(&self);

    /// Whether waiters queue up and are granted the lock in the order they asked (a Redlock
    /// quorum hands a released lock to whichever waiter reaches a majority first).
    fn queues_waiters(&self) -> bool {
        true
    }

    /// Whether the backend keeps a ledger for scheduled jobs.
    fn has_ledger(&self) -> bool {
        true
    }
}

/// PostgreSQL, through the harness's shared cluster.
pub struct Postgres;

impl Subject for Postgres {
    type Backend = pgleader::postgres::PgBackend;

    fn backend(&self) -> Self::Backend {
        let url = Cluster::shared().url();
        let lock = unique_lock();
        // Keys with high bits set, half of them negative: a check that looked at pg_locks'
        // objid alone would find the wrong lock, or none.
        let key = if lock % 2 == 0 {
            (lock << 32) | 0x5eed
        } else {
            -((lock << 32) | 0x5eed)
        };
        let (settings, _) = pgleader::postgres::conninfo::resolve(Some(&url), &NoEnvironment)
            .unwrap_or_else(|err| panic!("{url}: {err}"));
        let table = pgleader::postgres::ledger::TableName::parse(&format!("contract_{lock}"))
            .expect("a table name");
        pgleader::postgres::PgBackend::new(
            settings,
            LockKey::from_id(key),
            pgleader::election::lease::Lease::new(Duration::from_secs(15)),
            table,
            Duration::from_secs(1),
            // The default turn: in-order grants hold within a turn, and the contract's waits
            // are shorter (the election tests go through turns).
            Duration::from_secs(10),
        )
    }

    fn end_session(&self, id: i32) {
        // The harness's client is a blocking one: not on the runtime's thread, and bounded.
        let (done, terminated) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            Cluster::shared().terminate_backend(id);
            let _ = done.send(());
        });
        terminated.recv_timeout(WAIT).unwrap_or_else(|_| {
            panic!("pg_terminate_backend({id}) did not return within {WAIT:?}")
        });
    }

    fn prepare(&self) {
        SERVER_MAJOR.get_or_init(|| Cluster::shared().server_major());
    }

    fn drops_dead_waiters(&self) -> bool {
        let major = *SERVER_MAJOR.get().expect("prepare reads it");
        major == 0 || major >= 14
    }
}

/// One Redis server, the harness's shared one.
pub struct OneRedis;

impl Subject for OneRedis {
    type Backend = pgleader::redis::RedisBackend;

    fn backend(&self) -> Self::Backend {
        let lock = unique_lock();
        // Names with the characters a key could trip on, and numbers, half each.
        let lock = if lock % 2 == 0 {
            LockKey::from_name(&format!("contract: {lock}}}{{x"))
        } else {
            LockKey::from_id(-lock)
        };
        let server = pgleader::redis::url::RedisServer::parse(
            &Redis::shared().url(),
            None,
            Duration::from_secs(5),
        )
        .expect("the harness's URL");
        pgleader::redis::RedisBackend {
            server,
            lock,
            lease: pgleader::election::lease::Lease::new(Duration::from_secs(15)),
            poll: Duration::from_millis(500),
            ledger_timeout: Duration::from_secs(1),
            user_name: None,
        }
    }

    fn end_session(&self, id: i32) {
        let killed = Redis::shared().cli(&["CLIENT", "KILL", "ID", &id.to_string()]);
        assert_eq!(killed, "1", "CLIENT KILL ID {id} killed no connection");
    }

    fn drops_dead_waiters(&self) -> bool {
        true
    }

    fn prepare(&self) {
        // A just-started server's ledger remembers from its start, which INFO gives in whole
        // seconds: the ledger test's occurrence, a second ago, must come after it.
        let redis = Redis::shared();
        let deadline = std::time::Instant::now() + WAIT;
        while uptime(redis) < 3 {
            assert!(
                std::time::Instant::now() < deadline,
                "the shared Redis server reports no uptime"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A Redlock quorum of three Redis servers, shared by the quorum's contract tests. A server
/// younger than the lease refuses its vote (the delayed restart), so the servers are let age
/// a lease first.
pub struct ThreeRedis;

const QUORUM_LEASE: Duration = Duration::from_secs(4);

fn trio() -> &'static [Redis; 3] {
    static TRIO: std::sync::OnceLock<[Redis; 3]> = std::sync::OnceLock::new();
    TRIO.get_or_init(|| {
        [
            Redis::new("quorum-a"),
            Redis::new("quorum-b"),
            Redis::new("quorum-c"),
        ]
    })
}

impl Subject for ThreeRedis {
    type Backend = pgleader::redis::quorum::QuorumBackend;

    fn backend(&self) -> Self::Backend {
        let lock = unique_lock();
        let servers = trio()
            .iter()
            .map(|redis| {
                pgleader::redis::url::RedisServer::parse(&redis.url(), None, Duration::from_secs(5))
                    .expect("the harness's URL")
            })
            .collect();
        pgleader::redis::quorum::QuorumBackend {
            servers,
            lock: LockKey::from_name(&format!("quorum-{lock}")),
            lease: pgleader::election::lease::Lease::new(QUORUM_LEASE),
            poll: Duration::from_millis(500),
            ledger_timeout: Duration::from_secs(1),
            user_name: None,
        }
    }

    /// Kills the session's connection on every server: the one with this id on the first
    /// server, and those of the same name on the others.
    fn end_session(&self, id: i32) {
        let clients = trio()[0].cli(&["CLIENT", "LIST", "ID", &id.to_string()]);
        let name = clients
            .split_whitespace()
            .find_map(|field| field.strip_prefix("name="))
            .unwrap_or_else(|| panic!("no client {id}: {clients}"))
            .to_owned();
        for redis in trio() {
            for client in redis.cli(&["CLIENT", "LIST"]).lines() {
                let fields: Vec<&str> = client.split_whitespace().collect();
                if fields.contains(&format!("name={name}").as_str())
                    && let Some(id) = fields.iter().find_map(|f| f.strip_prefix("id="))
                {
                    redis.cli(&["CLIENT", "KILL", "ID", id]);
                }
            }
        }
    }

    fn drops_dead_waiters(&self) -> bool {
        true
    }

    fn prepare(&self) {
        let deadline = std::time::Instant::now() + WAIT;
        for redis in trio() {
            while uptime(redis) <= QUORUM_LEASE.as_secs() {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the quorum's servers report no uptime"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    fn queues_waiters(&self) -> bool {
        false
    }

    fn has_ledger(&self) -> bool {
        true
    }
}

/// A Redis server's uptime in whole seconds.
fn uptime(redis: &Redis) -> u64 {
    redis
        .cli(&["INFO", "server"])
        .lines()
        .find_map(|line| line.trim().strip_prefix("uptime_in_seconds:")?.parse().ok())
        .unwrap_or(0)
}

/// The shared cluster's major version, read before the runtime starts (the harness's client
/// blocks).
static SERVER_MAJOR: std::sync::OnceLock<u32> = std::sync::OnceLock::new();

/// No PG* variables, no ~/.pgpass: the URL says everything.
pub struct NoEnvironment;

impl pgleader::environment::Environment for NoEnvironment {
    fn var(&self, _: &str) -> Option<String> {
        None
    }

    fn home(&self) -> Option<std::path::PathBuf> {
        None
    }

    fn os_user(&self) -> Option<String> {
        None
    }

    fn socket_exists(&self, _: &std::path::Path) -> bool {
        false
    }
}

/// Runs one contract test on a runtime like pgleader's own (one thread). The subject's server
/// is started first ([`Subject::prepare`]), outside the runtime.
pub fn block_on(test: impl Future<Output = ()>) {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
        .block_on(test);
}

async fn connect<B: Backend>(backend: &B, name: &str) -> B::Session {
    // Unique across tests: the quorum's subject ends a session by its name on every server.
    let unique = unique_lock();
    within(
        name,
        backend.connect(&format!("contract-{name}-{unique}:1@test")),
    )
    .await
    .unwrap_or_else(|err| panic!("{name} cannot connect: {err}"))
}

async fn try_acquire<S: Session>(session: &S) -> bool {
    within("try_acquire", session.try_acquire())
        .await
        .expect("try_acquire answers")
}

async fn held<S: Session>(session: &S) -> bool {
    matches!(
        within("confirm", session.confirm()).await,
        Ok(Check {
            confirmation: Confirmation::Held,
            ..
        })
    )
}

/// Two sessions of `backend`, `a` holding the lock and `b` not asking yet.
async fn a_holding<B: Backend>(backend: &B) -> (B::Session, B::Session) {
    let (a, b) = (connect(backend, "a").await, connect(backend, "b").await);
    assert!(try_acquire(&a).await);
    (a, b)
}

/// Whether a wait for the lock is still pending, polled for a millisecond.
async fn still_waiting<F: Future + Unpin>(wait: &mut F) -> bool {
    tokio::time::timeout(Duration::from_millis(1), wait)
        .await
        .is_err()
}

async fn observe<B: Backend>(backend: &B) -> B::Observer {
    within("observe", backend.observe())
        .await
        .expect("an observer connects")
}

/// The ids of the sessions waiting, in the order the server will grant them the lock.
async fn waiting<O: Observer>(observer: &O) -> Vec<i32> {
    let view = within("lock_view", observer.lock_view())
        .await
        .expect("the lock can be read");
    view.waiting.iter().map(|p| p.backend_pid).collect()
}

/// Waits until the server lists exactly `expected` as waiting, in that order.
async fn until_waiting<B: Backend>(backend: &B, expected: &[i32]) {
    let observer = observe(backend).await;
    within("the waiters to queue up", async {
        while waiting(&observer).await != expected {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

pub async fn only_one_session_acquires<T: Subject>(subject: &T) {
    let backend = subject.backend();
    let a = connect(&backend, "a").await;
    let b = connect(&backend, "b").await;
    assert!(try_acquire(&a).await, "a free lock is taken");
    assert!(!try_acquire(&b).await, "a held lock is not taken twice");
    within("release", a.release(WAIT)).await.expect("released");
    assert!(try_acquire(&b).await, "a released lock is free again");
}

pub async fn waiters_are_granted_the_lock_in_order<T: Subject>(subject: &T) {
    if !subject.queues_waiters() {
        return;
    }
    let backend = subject.backend();
    let (a, b, c) = (
        connect(&backend, "a").await,
        connect(&backend, "b").await,
        connect(&backend, "c").await,
    );
    assert!(try_acquire(&a).await);
    let b_waits = b.wait();
    tokio::pin!(b_waits);
    // The waits are sent when first polled: b's must reach the server before c's.
    let pending = tokio::time::timeout(Duration::from_millis(1), &mut b_waits).await;
    assert!(pending.is_err(), "b waits while a holds the lock");
    until_waiting(&backend, &[b.id()]).await;
    let c_waits = c.wait();
    tokio::pin!(c_waits);
    let pending = tokio::time::timeout(Duration::from_millis(1), &mut c_waits).await;
    assert!(pending.is_err(), "c waits too");
    until_waiting(&backend, &[b.id(), c.id()]).await;

    within("release a", a.release(WAIT))
        .await
        .expect("released");
    tokio::select! {
        biased;
        granted = &mut b_waits => granted.expect("b is granted the lock"),
        _ = &mut c_waits => panic!("c was granted the lock before b, who asked first"),
        () = tokio::time::sleep(WAIT) => panic!("nobody was granted the released lock"),
    }
    assert!(held(&b).await, "b leads");
    // c still waits (a waiting session has its one statement in flight: ask the server).
    until_waiting(&backend, &[c.id()]).await;
    within("release b", b.release(WAIT))
        .await
        .expect("released");
    within("c's grant", &mut c_waits)
        .await
        .expect("c is granted the lock");
    assert!(held(&c).await, "c leads");
}

pub async fn a_check_confirms_only_the_holder<T: Subject>(subject: &T) {
    let backend = subject.backend();
    let (a, b) = (connect(&backend, "a").await, connect(&backend, "b").await);
    assert!(!held(&a).await, "nobody leads yet");
    assert!(try_acquire(&a).await);
    assert!(held(&a).await, "the holder is confirmed");
    assert!(!held(&b).await, "another session is not");
}

pub async fn the_end_of_the_connection_is_noticed_at_once<T: Subject>(subject: &T) {
    let backend = subject.backend();
    let mut a = connect(&backend, "a").await;
    assert!(try_acquire(&a).await);
    subject.end_session(a.id());
    // "At once": well before any check or keepalive could have noticed (WAIT is 20 s, longer
    // than the 15 s lease, so `within` alone would not tell).
    let noticed = tokio::time::Instant::now();
    let reason = within("the connection's end", a.ended()).await;
    assert!(
        noticed.elapsed() < Duration::from_secs(1),
        "the end was noticed only after {:?}",
        noticed.elapsed()
    );
    assert!(!reason.is_empty(), "the end says why");
    // And the lock is free for the next one.
    let b = connect(&backend, "b").await;
    within("b's grant after a's end", b.wait())
        .await
        .expect("b is granted the lock");
}

pub async fn a_check_fails_once_the_session_is_gone<T: Subject>(subject: &T) {
    let backend = subject.backend();
    let a = connect(&backend, "a").await;
    assert!(try_acquire(&a).await);
    assert!(held(&a).await);
    subject.end_session(a.id());
    assert!(
        !held(&a).await,
        "a check on an ended session must not confirm"
    );
}

pub async fn a_release_wakes_the_next_waiter<T: Subject>(subject: &T) {
    let backend = subject.backend();
    let (a, b) = a_holding(&backend).await;
    let b_waits = b.wait();
    tokio::pin!(b_waits);
    assert!(
        still_waiting(&mut b_waits).await,
        "b waits while a holds the lock"
    );
    within("release", a.release(WAIT)).await.expect("released");
    within("b's grant", &mut b_waits)
        .await
        .expect("b is granted the lock");
    assert!(held(&b).await);
}

pub async fn an_abandoned_wait_leaves_the_lock_free<T: Subject>(subject: &T) {
    let backend = subject.backend();
    let (a, b) = a_holding(&backend).await;
    {
        let b_waits = b.wait();
        tokio::pin!(b_waits);
        assert!(still_waiting(&mut b_waits).await);
        if subject.queues_waiters() {
            until_waiting(&backend, &[b.id()]).await;
        }
    }
    let observer = observe(&backend).await;
    // The contract: a session whose acquisition was abandoned is dropped, never reused.
    drop(b);
    // Dropping it gives up the wait on the server at once, not when it would be granted (and
    // well before the 15 s lease could end a's idle session instead), where the server can tell.
    let dropped = tokio::time::Instant::now();
    while subject.drops_dead_waiters() && !waiting(&observer).await.is_empty() {
        assert!(
            dropped.elapsed() < Duration::from_secs(2),
            "the abandoned session still waits on the server"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    within("release", a.release(WAIT)).await.expect("released");
    let c = connect(&backend, "c").await;
    assert!(
        within("c's grant", c.wait()).await.is_ok(),
        "the abandoned waiter holds nothing"
    );
}

pub async fn epochs_increase_from_one_leadership_to_the_next<T: Subject>(subject: &T) {
    let backend = subject.backend();
    let mut last = None;
    for name in ["a", "b", "a-again"] {
        let session = connect(&backend, name).await;
        assert!(try_acquire(&session).await);
        let fence = within("fence", session.fence())
            .await
            .expect("a fencing token");
        if let Some(last) = last {
            assert!(
                fence.epoch > last,
                "epoch {} after {last}: tokens must strictly increase",
                fence.epoch
            );
        }
        last = Some(fence.epoch);
        within("release", session.release(WAIT))
            .await
            .expect("released");
    }
}

pub async fn the_ledger_claims_only_for_the_leader<T: Subject>(subject: &T) {
    if !subject.has_ledger() {
        return;
    }
    let backend = subject.backend();
    let definition = Definition {
        expression: "0 0 3 * * *".into(),
        timezone: "UTC".into(),
    };
    let claimant = |epoch| Claimant {
        host: "test".into(),
        pid: 1,
        epoch,
    };
    let (a, b) = (connect(&backend, "a").await, connect(&backend, "b").await);
    let (ledger_a, ledger_b) = (a.ledger(&definition), b.ledger(&definition));
    within("prepare", ledger_a.prepare())
        .await
        .expect("the ledger can be prepared");
    let now = within("server time", ledger_a.server_time())
        .await
        .expect("the server's clock");
    let occurrence = now - jiff::SignedDuration::from_secs(1);

    let refused = within(
        "claim",
        ledger_a.claim(occurrence, Duration::ZERO, &claimant(1), 0),
    )
    .await;
    assert_eq!(
        refused.expect("an answer"),
        Claim::NotLeader,
        "a session that does not lead claims nothing"
    );
    assert!(try_acquire(&a).await);
    let epoch = within("fence", a.fence()).await.expect("a token").epoch;
    let claimed = within(
        "claim",
        ledger_a.claim(occurrence, Duration::ZERO, &claimant(epoch), 0),
    )
    .await;
    assert_eq!(claimed.expect("an answer"), Claim::Claimed { attempt: 1 });
    let other = within(
        "claim",
        ledger_b.claim(occurrence, Duration::ZERO, &claimant(epoch), 0),
    )
    .await;
    assert_eq!(
        other.expect("an answer"),
        Claim::NotLeader,
        "a follower claims nothing, not even what is taken"
    );

    // The leader that lost the lock a moment ago claims nothing either.
    let later = occurrence + jiff::SignedDuration::from_millis(500);
    within("release", a.release(WAIT)).await.expect("released");
    assert!(try_acquire(&b).await);
    // On PostgreSQL `release` closes a's session, so this claim fails on the closed connection
    // whatever the ledger's guard does (`Err(Query("connection closed"))`): it exercises the
    // guard only for a backend whose release keeps the connection. The follower's claim above
    // is what proves PostgreSQL's guard.
    let stale = within(
        "claim",
        ledger_a.claim(later, Duration::ZERO, &claimant(epoch), 0),
    )
    .await;
    assert!(
        matches!(stale, Err(_) | Ok(Claim::NotLeader)),
        "a released leadership cannot claim: {stale:?}"
    );
    let recent = within("history", ledger_b.recent(10))
        .await
        .expect("history");
    assert_eq!(
        recent.iter().map(|e| e.scheduled_for).collect::<Vec<_>>(),
        vec![occurrence],
        "only the leader's claim was written"
    );
}

/// A crontab job's claim goes out a moment ahead of its occurrence (its command starts at the
/// instant): the ledger takes it within the lead the claim names and not before, records the
/// occurrence itself as when it was claimed, and the next holder's sweep takes back a claim
/// whose occurrence has not come (its command cannot have started) rather than record it as
/// interrupted, so that the occurrence still runs.
pub async fn a_claim_lands_within_its_lead_and_one_not_yet_due_is_taken_back<T: Subject>(
    subject: &T,
) {
    if !subject.has_ledger() {
        return;
    }
    let backend = subject.backend();
    let definition = Definition {
        expression: "0 0 4 * * *".into(),
        timezone: "UTC".into(),
    };
    let session = connect(&backend, "a").await;
    let ledger = session.ledger(&definition);
    within("prepare", ledger.prepare())
        .await
        .expect("the ledger can be prepared");
    assert!(try_acquire(&session).await);
    let epoch = within("fence", session.fence())
        .await
        .expect("a token")
        .epoch;
    let claimant = Claimant {
        host: "test".into(),
        pid: 1,
        epoch,
    };
    let now = within("server time", ledger.server_time())
        .await
        .expect("the server's clock");
    let occurrence = now + jiff::SignedDuration::from_secs(30);
    let claim = |ahead: u64| ledger.claim(occurrence, Duration::from_secs(ahead), &claimant, 0);

    let early = within("claim", claim(10)).await.expect("an answer");
    assert!(
        matches!(early, Claim::Early { .. }),
        "30 s ahead with a lead of 10 s is early: {early:?}"
    );
    let recent = within("history", ledger.recent(10)).await.expect("history");
    assert!(
        recent.is_empty(),
        "an early claim writes nothing: {recent:?}"
    );

    let claimed = within("claim", claim(60)).await.expect("an answer");
    assert_eq!(claimed, Claim::Claimed { attempt: 1 }, "within its lead");
    let recent = within("history", ledger.recent(10)).await.expect("history");
    let rows: Vec<_> = recent
        .iter()
        .map(|e| (e.scheduled_for, e.outcome.as_str(), e.claimed_at))
        .collect();
    assert_eq!(
        rows,
        vec![(occurrence, "running", occurrence)],
        "claimed ahead, recorded as claimed at its occurrence"
    );

    let swept = within("sweep", ledger.interrupt_stale())
        .await
        .expect("the sweep");
    assert!(
        swept.is_empty(),
        "nothing ran, nothing interrupted: {swept:?}"
    );
    let recent = within("history", ledger.recent(10)).await.expect("history");
    assert!(
        recent.is_empty(),
        "a claim whose occurrence has not come is taken back: {recent:?}"
    );
    let again = within("claim", claim(60)).await.expect("an answer");
    assert_eq!(
        again,
        Claim::Claimed { attempt: 1 },
        "and the occurrence can be claimed anew"
    );
}

/// One `#[test]` per contract test, for one subject: each prepares the subject and runs the
/// contract test of its name on it.
macro_rules! contract_suite {
    ($backend:ident, $subject:expr) => {
        contract_suite!(
            $backend,
            $subject,
            only_one_session_acquires,
            waiters_are_granted_the_lock_in_order,
            a_check_confirms_only_the_holder,
            the_end_of_the_connection_is_noticed_at_once,
            a_check_fails_once_the_session_is_gone,
            a_release_wakes_the_next_waiter,
            an_abandoned_wait_leaves_the_lock_free,
            epochs_increase_from_one_leadership_to_the_next,
            the_ledger_claims_only_for_the_leader,
            a_claim_lands_within_its_lead_and_one_not_yet_due_is_taken_back,
        );
    };
    ($backend:ident, $subject:expr, $($test:ident),+ $(,)?) => {
        mod $backend {
            use super::*;

            $(
                #[test]
                fn $test() {
                    let subject = $subject;
                    subject.prepare();
                    block_on(super::$test(&subject));
                }
            )+
        }
    };
}

contract_suite!(postgres, Postgres);
contract_suite!(redis, OneRedis);
contract_suite!(quorum, ThreeRedis);

/// What only PostgreSQL's ledger needs: its statement bound (`SET LOCAL` in a transaction of
/// the statement's own) must not outlive the statement on the session.
mod postgres_only {
    use super::*;

    #[test]
    fn a_ledger_statements_bound_does_not_outlive_it_on_the_session() {
        Postgres.prepare();
        block_on(async {
            let mut backend = Postgres.backend();
            backend.ledger.statement_timeout = Duration::from_millis(100);
            let (a, b) = (connect(&backend, "a").await, connect(&backend, "b").await);
            let definition = Definition {
                expression: "0 0 3 * * *".into(),
                timezone: "UTC".into(),
            };
            let ledger = a.ledger(&definition);
            within("prepare", ledger.prepare()).await.expect("prepared");
            within("a bounded read", ledger.recent(1))
                .await
                .expect("the ledger can be read");
            // With the bound left on the session, this wait would be cancelled after 100 ms.
            assert!(try_acquire(&b).await);
            let a_waits = a.wait();
            tokio::pin!(a_waits);
            let early = tokio::time::timeout(Duration::from_millis(500), &mut a_waits).await;
            assert!(
                early.is_err(),
                "the wait ended while the lock was held: {early:?}"
            );
            within("release", b.release(WAIT)).await.expect("released");
            within("a's grant", &mut a_waits)
                .await
                .expect("a is granted the lock, never cancelled");
        });
    }
}
