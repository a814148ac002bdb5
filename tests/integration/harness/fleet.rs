//! Where the replicas of one test meet, on either backend: a server's URL and the lock's option,
//! so that a test body written once runs on PostgreSQL and on Redis (the step-down and hook
//! tests), and the `pgleader` commands its replicas and clients run; and what a test asks of a
//! replica's output that no single wait answers (whether a line never came, how often one did).

use std::ffi::OsStr;
use std::process::Command;

use super::{Cluster, Proc, Redis, Stream, pgleader, unique_lock};

/// A server's URL and the option that names the test's lock on it.
pub struct Fleet {
    pub url: String,
    /// `--lock-id=<n>` on PostgreSQL, `--lock=<name>` on Redis.
    pub lock: String,
}

impl Fleet {
    /// A lock no other test uses, on the shared PostgreSQL cluster.
    pub fn postgres() -> Fleet {
        Fleet {
            url: Cluster::shared().url(),
            lock: format!("--lock-id={}", unique_lock()),
        }
    }

    /// A lock no other test uses, on the shared Redis server, named `<tag>-<n>` (Redis locks
    /// are named in their keys: the tag says which tests a key belongs to).
    pub fn redis(tag: &str) -> Fleet {
        Fleet {
            url: Redis::shared().url(),
            lock: format!("--lock={tag}-{}", unique_lock()),
        }
    }

    /// `pgleader <subcommand> <lock> <args...>` against the fleet's server.
    pub fn pgleader<S: AsRef<OsStr>>(&self, subcommand: &str, args: &[S]) -> Command {
        let mut command = pgleader();
        command
            .env("PGLEADER_DATABASE_URL", &self.url)
            .arg(subcommand)
            .arg(&self.lock)
            .args(args);
        command
    }

    /// A replica: `pgleader run <lock> <args...> -- sh -c <script>`.
    pub fn replica<S: AsRef<OsStr>>(&self, name: &str, args: &[S], script: &str) -> Proc {
        let mut command = self.pgleader("run", args);
        command.args(["--", "sh", "-c", script]);
        Proc::spawn(name, command)
    }

    /// `pgleader <subcommand> <lock> <args...>`, run to its end: exit code, stdout, stderr.
    pub fn client(&self, subcommand: &str, args: &[&str]) -> (i32, String, String) {
        let (status, out, err) = Proc::spawn(subcommand, self.pgleader(subcommand, args)).finish();
        (
            status.code().expect("an exit code"),
            out.join("\n"),
            err.join("\n"),
        )
    }

    /// `pgleader step-down`, given 20 s to see the leadership move, run to its end.
    pub fn step_down(&self) -> (i32, String, String) {
        self.client("step-down", &["--timeout=20s"])
    }
}

/// The lines `replica` wrote so far to `stream` that contain any of `texts`: what it said, and
/// how often, once a wait has shown that it is done saying it.
pub fn lines_with(replica: &Proc, stream: Stream, texts: &[&str]) -> Vec<String> {
    replica
        .lines(stream)
        .into_iter()
        .filter(|line| texts.iter().any(|text| line.contains(text)))
        .collect()
}

/// One test per backend for each body given. `on_both_backends! { postgres, redis; body:
/// postgres_test, redis_test; }` runs `body(postgres)` as `postgres_test` and `body(redis)` as
/// `redis_test` (each test evaluates its backend anew, so each gets a lock of its own): a
/// behaviour both backends promise is written once and fails under its backend's name.
#[allow(
    unused_macros,
    reason = "the integration tests use it and the benchmark, which includes this harness, does not: `expect` would fail in one of them"
)]
macro_rules! on_both_backends {
    ($on_postgres:expr, $on_redis:expr; $($body:ident: $postgres:ident, $redis:ident;)+) => {$(
        #[test]
        fn $postgres() {
            $body($on_postgres);
        }

        #[test]
        fn $redis() {
            $body($on_redis);
        }
    )+};
}
pub(crate) use on_both_backends;
