//! The manual page and the shell completions, generated from the clap definitions so they
//! cannot drift from what the program accepts. Both are committed (`man/pgleader.1`,
//! `completions/`); a test fails when the committed copies are stale, and
//! `PGLEADER_UPDATE_DOCS=1 cargo test --test integration docs` rewrites them.
//!
//! The options come from clap; the sections clap knows nothing about (exit status,
//! environment, signals, the failure model) are written here.

use clap::CommandFactory;
use clap_complete::Shell;

use crate::cli::Cli;

/// A man-page section: a heading and its paragraphs or tagged entries.
struct Section {
    heading: &'static str,
    body: &'static [Block],
}

enum Block {
    Para(&'static str),
    Entry(&'static str, &'static str),
}

use Block::{Entry, Para};

const SECTIONS: &[Section] = &[
    Section {
        heading: "EXIT STATUS",
        body: &[
            Para("pgleader run:"),
            Entry(
                "the command's status",
                "Under --once, or after a shutdown (TERM, INT) that stopped the command: its exit code, or 128+N if it was killed by signal N. With --shards, which stops several commands, 0.",
            ),
            Entry(
                "0",
                "Shut down while no command was running. Also --no-wait when another instance holds the lock, and --once --schedule when its occurrence is already claimed or none is due, unless --busy-exit-code says otherwise.",
            ),
            Entry(
                "1",
                "A fatal error: authentication failed, the database does not exist, the server's TLS certificate does not verify, the connection goes through a transaction-mode pooler, the server runs a PostgreSQL older than 13, the database is unreachable under --no-wait. With --schedule: the ledger table cannot be created or used; under --once, this timer's schedule disagrees with the one the lock's replicas established. Also an --http address that cannot be listened on (the port is taken, the address is not this host's), reported before the election.",
            ),
            Entry(
                "2",
                "A usage error: an unknown option (before the command, every argument that starts with \"-\" is an option; a command whose name starts with \"-\" must follow --), an invalid option value (an --http address that does not parse, too), a missing command, timings that do not fit inside the lease. Also --shards beside a replica of the same lock that runs another shard count, or none, and a plain replica beside sharded ones (see SHARDS).",
            ),
            Entry(
                "75",
                "Under --once: leadership was lost while the command ran; the command was stopped.",
            ),
            Entry("126", "The command exists but cannot be executed."),
            Entry("127", "The command was not found."),
            Para("pgleader status:"),
            Entry(
                "0",
                "The lock is held (a sharded lock: a replica holds a shard).",
            ),
            Entry(
                "3",
                "The lock is free (a sharded lock: no replica holds a shard).",
            ),
            Entry("1, 2", "An error, a usage error."),
            Para(
                "pgleader status --job JOB: 0 when a run of the job is recorded, 3 when none is (nothing there, as for a free lock), 1 on errors, 2 on usage errors (a name no job can have).",
            ),
            Para(
                "pgleader cron run: the run's exit status (0 when it succeeded; 128+N when a signal N ended it), 75 when it was not run (overlap=skip beside a run going on) or was interrupted, 0 at once with --no-wait; 1 when no replica of the fleet runs, or on errors; 2 when no replica defines the job, or on usage errors.",
            ),
            Para(
                "pgleader cron pause and resume: 0 when done, 1 when resuming one job while every job is paused (nothing resumed) or on errors, 2 on usage errors.",
            ),
            Para(
                "pgleader status --watch: 0 when interrupted by TERM or INT, or when its output is closed; 1 on errors that retrying cannot fix (a bad password); 2 on usage errors.",
            ),
            Para("pgleader step-down:"),
            Entry("0", "Another replica leads now."),
            Entry("3", "Nobody led: there was nothing to step down."),
            Entry(
                "4",
                "No replica waited to take over: the request was not sent, and the leader keeps leading.",
            ),
            Entry(
                "5",
                "The request was sent, but no other replica led within --timeout (the leader may lead again if the replica it handed over to went away meanwhile), or, on Redis, no leader heard it.",
            ),
            Entry(
                "1, 2",
                "An error; a usage error, which includes --to, a sharded lock and a Redlock quorum.",
            ),
        ],
    },
    Section {
        heading: "STEP-DOWN",
        body: &[
            Para(
                "pgleader step-down asks the leader of a lock to hand over: it stops its command as on a lost leadership (--kill-signal, --kill-timeout, then SIGKILL to the process group, and the whole tree gone, then --post-stop), releases the lock, and queues again after --check-interval, so that the replica waiting first takes over within milliseconds while the old one stays in the fleet as a follower. It logs event=step_down, and pgleader_leadership_lost_total counts it under reason stepped_down. Under --once a stepped-down leader exits 75, as after a lost leadership.",
            ),
            Para(
                "The request travels through the lock's own server, not a port of pgleader's: on PostgreSQL a NOTIFY on the channel pgleader_step_down_<key as 16 hex digits>, which the leader LISTENs on from the moment it wins; on Redis a PUBLISH to pgleader:{NAME}:step-down, to which the leader subscribes on its session's connection. On PostgreSQL the leader obeys a request only from a session of its own role, or of a role that is a member of it (a superuser is): NOTIFY itself needs no privilege. On Redis whoever may PUBLISH to that channel (ACL: +publish and &pgleader:*) can ask. The whole request is bounded by --timeout; leadership counts as moved when a replica that was waiting, or another pgleader process, holds the lock.",
            ),
            Para(
                "Refused with exit status 2: --to (a released lock goes to whichever replica waits first; pgleader cannot steer it to one replica without stopping the others from waiting, and never risks running the command twice for it), a sharded lock (its replicas share the shards out and have no single leader; stop or restart a replica to move its shards) and a Redlock quorum (its leader does not listen for requests; stop it with TERM).",
            ),
        ],
    },
    Section {
        heading: "THE COMMAND'S ENVIRONMENT",
        body: &[
            Para(
                "The command inherits pgleader's standard input, output, error and environment, plus:",
            ),
            Entry("PGLEADER_LOCK_ID", "The lock's 64-bit key."),
            Entry("PGLEADER_LOCK_NAME", "The lock's name, with --lock."),
            Entry(
                "PGLEADER_BACKEND_PID",
                "The pid of the PostgreSQL session that holds the lock.",
            ),
            Entry(
                "PGLEADER_EPOCH",
                "A fencing token: a number that strictly increases from one leadership of the lock to the next (a transaction id taken right after winning). A resource the command writes to can refuse writes that carry an older epoch than one it has already seen. On PostgreSQL the new leader waits until the transaction's commit is flushed to the WAL (its session sets synchronous_commit on), so that a crash cannot hand the same id out again.",
            ),
            Entry(
                "PGLEADER_SCHEDULED_TIME",
                "With --schedule: the occurrence the command runs for, in RFC 3339 and UTC (2026-11-23T02:00:00Z). The same on every attempt at that occurrence: an idempotency key.",
            ),
            Entry(
                "PGLEADER_ATTEMPT",
                "With --schedule: 1, or more when --retry-interrupted starts an interrupted occurrence again.",
            ),
            Entry(
                "PGLEADER_SHARD, PGLEADER_SHARDS",
                "With --shards K: which shard this command runs (0 to K-1), and K. Its PGLEADER_EPOCH is that shard's, and PGLEADER_BACKEND_PID the replica's holder session.",
            ),
            Para("The hooks (--pre-start, --post-stop) get the same environment, plus:"),
            Entry("PGLEADER_HOOK", "Which hook runs: pre-start or post-stop."),
            Entry(
                "PGLEADER_EXIT_CODE",
                "In --post-stop, when the command ran: its exit code, or 128+N when signal N killed it.",
            ),
        ],
    },
    Section {
        heading: "HOOKS",
        body: &[
            Para(
                "--pre-start and --post-stop run a shell command line (sh -c) around the command, in order, once per transition: the old leader's post-stop has finished before the new leader's pre-start begins, and that before its command starts. Their output goes to pgleader's log, one hook_output event per line, tagged hook=pre-start or hook=post-stop; hook_started, hook_finished and hook_failed say when each ran and how it ended. A hook that runs past --hook-timeout is killed with everything it started, and whatever a hook leaves running when it exits is killed too.",
            ),
            Para(
                "--pre-start runs after this replica won and took its fencing token (and after --takeover-delay or the restart fence), in the command's process group, so a lost lock or a shutdown stops it as it would the command, and the signals pgleader passes on reach it. If it exits non-zero or times out, the command does not start: --post-stop runs, the lock is released, and the replica sits out 1s before it queues again, doubling up to 1m while its pre-start keeps failing.",
            ),
            Para(
                "--post-stop runs, in a process group of its own, once the command's whole tree is gone, whatever ended it (its exit, a lost lock, a signal, a handoff, a failed pre-start, pgleader killed -9: the keeper runs it then), and before the lock is released or the leader's connection let go. A second TERM or INT to pgleader kills it. Where the server ends the leader's session itself (pg_terminate_backend, a restart, a Redis key deleted), the lock is free already: only --takeover-delay (at least --kill-timeout + --hook-timeout) or the restart fence orders the next pre-start behind it. With --post-stop, --lease must be at least --check-interval + --check-timeout + --kill-timeout + --hook-timeout + 1s (14s with the defaults). With --schedule the hooks wrap each run; with --shards, each shard's command (a shard whose pre-start fails stays and is tried again after 1s, doubling up to 1m).",
            ),
        ],
    },
    Section {
        heading: "ENVIRONMENT",
        body: &[
            Para(
                "Every option of run can be set from the environment variable shown in --help (PGLEADER_LOCK_ID, PGLEADER_KILL_TIMEOUT, ...); a value on the command line wins. The lock is read from PGLEADER_LOCK_ID or PGLEADER_LOCK only when neither --lock-id nor --lock is given. --shards has no variable: a shard's command is given PGLEADER_SHARDS, and a pgleader it starts must not take it for its own.",
            ),
            Entry(
                "PGLEADER_DATABASE_URL, DATABASE_URL",
                "The connection, when --database-url is not given: a postgres:// URL or key=value pairs, as libpq accepts them.",
            ),
            Entry(
                "PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE, PGAPPNAME, PGCONNECT_TIMEOUT, PGSSLMODE, PGSSLROOTCERT, PGSSLCERT, PGSSLKEY, PGPASSFILE, ...",
                "As for psql: they fill in what the connection string leaves out. Without any of them pgleader connects like psql: to the Unix socket in /var/run/postgresql if a server listens there, else to localhost, as the operating-system user, to the database of the same name.",
            ),
            Entry(
                "REDISCLI_AUTH",
                "The Redis password, when a redis:// URL has none (redis-cli's convention).",
            ),
            Entry(
                "NOTIFY_SOCKET, WATCHDOG_USEC, WATCHDOG_PID",
                "Set by systemd for a unit with Type=notify and WatchdogSec=; see SYSTEMD. The command does not inherit them.",
            ),
            Entry(
                "~/.pgpass",
                "Passwords, with libpq's format and rules; a file that group or others can read is ignored with a warning.",
            ),
        ],
    },
    Section {
        heading: "SHARDS",
        body: &[
            Para(
                "With --shards K (PostgreSQL, or one Redis server), K numbered instances of the command run across the replicas of the lock, each exactly once, and every replica runs its share: with R replicas, K/R rounded down or up, --max-shards N at most. Each instance gets PGLEADER_SHARD and PGLEADER_SHARDS, a PGLEADER_EPOCH of its own and a process group of its own, under a keeper, with every promise a single leader's command has. A replica over its share stops the surplus (the kill signal, --kill-timeout, SIGKILL) and releases each shard only once its command's whole tree is gone; a replica short of its share takes it at once, and the shards of a replica that died run on the others within milliseconds on PostgreSQL, within about a --check-interval on Redis. A command that exits on its own keeps its shard: what it left behind is stopped, and it starts again on the same replica after --restart-delay, with the same PGLEADER_EPOCH. A command that ignores PGLEADER_SHARD runs at most K times across the fleet: a semaphore.",
            ),
            Para(
                "With --schedule, each shard runs at the schedule's occurrences instead, each occurrence of each shard once across the fleet, on whichever replica holds the shard: its runs are claimed and recorded in the ledger under a key of its own (the lock's key, U+001F, \"shard N\"), with every rule of --schedule (--catch-up, --retry-interrupted, skipped and missed occurrences), and its command gets PGLEADER_SCHEDULED_TIME and PGLEADER_ATTEMPT too. A shard that moves to another replica keeps its ledger: an occurrence claimed on one replica never runs on another (one claimed ahead of its instant, as a crontab job's are, whose command had not started, is taken back and runs where the shard went).",
            ),
            Para(
                "Every replica keeps two sessions whatever K is: a holder session, which holds its shards, LISTENs on pgleader_shards_<space in hex> and reads the roster (pg_locks) when told of a change and every --check-interval (its check, with a single leader's deadline), and a watcher session, which waits for the next replica's membership lock in turns and tells everyone the moment that replica is gone. The locks are two-int4 advisory locks (space, n), never the plain key of the name: space is hashtextextended('pgleader shards ' || key, 0)::bit(32)::int4 of the plain key; n is the shard (0 to K-1), minus the holder session's pid (membership), -2^31+K (shared: the shard count) or -2^30+N (shared: --max-shards N).",
            ),
            Para(
                "On one Redis server, every replica keeps two connections whatever K is. Shard n is the key pgleader:{NAME}:shard:<n>, whose value names its holder and epoch; each replica's card is pgleader:{NAME}:member:<id> (its K and --max-shards, TTL the lease), the ids in the set pgleader:{NAME}:members. A shard key counts as held only while its holder's card lives: its own TTL (ten leases, 10 minutes at least) only clears what an abandoned name leaves. The holder connection subscribes to its liveness channel and to pgleader:{NAME}:shards, on which every change is said, and reads the roster when told of a change and every --check-interval with one script that also renews its card, and its shards every half of their TTL (compare, then extend; a shard key that vanished is lost, never re-created); a read whose answer is the same as the last one comes back as its digest alone. The watcher connection asks every --check-interval whether the next replica's liveness channel still has a subscriber: a killed replica's shards run elsewhere within about a check interval, long before the TTL, and only once its commands' trees are gone (a keeper holds its connection's socket). Where the server ends a replica's connection or its keys are deleted while its pgleader lives on, use --takeover-delay above --check-interval + --check-timeout + --kill-timeout; an eviction or FLUSHALL is such a deletion, so give the server maxmemory-policy noeviction. The roster read looks at all K shard keys: about 10 ms of the server's time at K = 4096.",
            ),
            Para(
                "Every replica of a lock must give the same K: one that starts beside a replica with another K, or beside a plain replica of the lock, exits with status 2 and names it, and so does a plain replica that starts beside sharded ones. Not yet: Redlock quorums, --schedule, --once, --no-wait and --relinquish-* are refused with status 2 and the reason.",
            ),
            Para(
                "pgleader status (PostgreSQL: from pg_locks; Redis: from the keys) shows a sharded lock as its shard count, each replica with the shards it holds, then every shard with its holder (--json: shards.count, shards.replicas with holds and max_shards, shards.holders, shards.free); status --watch prints a line each time a shard moves. On a sharded replica, GET /leader answers 200 while the command of at least one shard runs there; /status adds shards (count, and held: each shard held here with its epoch, since and command); the metrics add pgleader_shards (gauge, K), pgleader_shards_held (gauge) and, with a shard label for every shard from 0 to K-1, pgleader_shard_held, pgleader_shard_epoch, pgleader_shard_command_running (gauges) and pgleader_shard_acquired_total (counter). pgleader_is_leader is 1 while the replica holds a shard, and pgleader_command_running counts the shards' commands that run there. Log lines about one shard carry shard=N.",
            ),
        ],
    },
    Section {
        heading: "SCHEDULED JOBS",
        body: &[
            Para(
                "With --schedule, each occurrence of a cron schedule starts at most once across every replica and timer of the lock. Occurrences are instants on the database server's clock: each leader measures its offset from the server at every check and waits on its own monotonic clock, so a replica whose clock is off neither runs early, nor late, nor twice. Before the command starts, the leader claims the occurrence in the ledger table (--ledger-table, created when missing) on its own session while it holds the lock; a claimed occurrence is never started again, except by --retry-interrupted.",
            ),
            Para(
                "As a service (without --once) the leader runs the command at each occurrence and keeps the lock between runs; the others wait in the lock's queue and take over within milliseconds. A failing command does not end the service. From a timer (--once) pgleader runs the occurrence the timer fired for (the most recent one, or one at most a minute ahead on the server's clock) and exits with the command's status, or at once with --busy-exit-code if a replica has claimed it or holds the lock.",
            ),
            Entry(
                "missed",
                "An occurrence that came while no leader could run it is run by the next leader if it is at most --catch-up old (only the most recent one); an older one is recorded as missed, and so are those passed over before it (logged, the latest recorded with their count). A ledger statement waits at most half of --check-timeout; one that times out is rolled back and tried again.",
            ),
            Entry(
                "skipped",
                "An occurrence that comes while the previous run is still going is not started and is recorded as skipped.",
            ),
            Entry(
                "interrupted",
                "A run whose leader lost the lock, or was shut down, is stopped as always and recorded as interrupted. It is started again by the next leader only under --retry-interrupted, with the same PGLEADER_SCHEDULED_TIME and a new PGLEADER_EPOCH.",
            ),
            Entry(
                "disagreement",
                "Each scheduled pgleader shows a fingerprint of its schedule, time zone and ledger table in its application_name. A leader whose schedule differs from the one that ran last, while a replica with that one is still connected, does not run its version: a service hands the lock over, a timer exits 1. Once no replica with the old schedule is left, the new one takes over. Every replica must use the same ledger table: one that sees another table in use does not catch up earlier occurrences for --catch-up afterwards.",
            ),
            Para(
                "The ledger keeps the newest 100 rows of each lock. pgleader status shows the schedule, the next occurrence and the last runs. The repository's docs/scheduled-jobs.md gives the table's definition and the grants for a role that may not create tables.",
            ),
        ],
    },
    Section {
        heading: "CRONTAB",
        body: &[
            Para(
                "pgleader cron CRONTAB, on every replica with the same --lock and file, runs a crontab across the fleet (PostgreSQL or one Redis server): each occurrence of each job at most once, on the database server's clock, through the ledger as --schedule does, each job claimed only while its owner's session holds the job's lock. A job's occurrence is claimed up to 500 ms ahead (a quarter of the time to its next one at most; not under jitter= nor while a run of it goes on) and its command starts at the instant, on the server's clock: a claim whose command has not started yet is taken back when the job moves, and by the job's next owner when its replica died with the instant still 100 ms away or more, so the occurrence still runs there (nearer, it is recorded as interrupted). The jobs are the items of a sharded lock of that name: shared out evenly by count over the replicas (with --health-cmd, the healthy ones), moved within milliseconds when a replica dies or leaves, on two connections per replica whatever the number of jobs. A replica takes only jobs its own file has, so in a rolling deploy a job only some replicas know runs on one of those.",
            ),
            Para(
                "The file is read as supercronic reads it: seven fields (seconds first, year last), six (year last), five, or @hourly, @daily, @weekly, @monthly, @yearly and @every DURATION; the first reading whose fields parse in supercronic's grammar wins, whether or not it occurs again (a schedule with no future occurrence, such as a past year, is accepted, warned of and never run); day and month names, N/step, L, W and # as supercronic reads them. NAME=value lines are given to every job, the last value of a name winning, as in supercronic: CRON_TZ= (the zone of the schedules; without it the local zone: TZ, else /etc/localtime, else UTC; an unknown TZ is exit status 2) and SHELL= (the shell, /bin/sh by default) too. A comment directly above a job sets its options: # pgleader: name=NAME catch-up=DURATION timeout=DURATION (a run that takes longer is stopped and recorded as failed) jitter=DURATION (each occurrence starts after a delay of up to DURATION, drawn from the job's name and the occurrence so that every replica waits alike; shorter than the time between two occurrences; PGLEADER_SCHEDULED_TIME stays the occurrence, and --check shows each start) ping=URL (each run reported to a monitor in healthchecks.io's protocol: URL/start when it starts, URL on success, URL/N for exit status N, URL/fail with a line for an occurrence skipped, missed or interrupted, each with rid=, a run id; PGLEADER_PING=URL gives every job a default, {job} standing for its name, ping=none opts out; a job's pings are queued and sent in order, never hold up a run, time out after 5 s, are tried 3 times, and those undelivered are counted in pgleader_job_pings_undelivered_total (an ending replica waits up to 5 s for those still queued); logs name the monitor's scheme and host only) zone=ZONE (a zone of the job's own). A job is known by its name, or without one by a name made from its command. Each command runs through SHELL -c, with the crontab's variables, PGLEADER_JOB, PGLEADER_SCHEDULED_TIME, PGLEADER_ATTEMPT and PGLEADER_EPOCH. Each line a job writes on stdout or stderr becomes a log line of pgleader's on stderr, in --log-format, whatever -q says, with job=NAME, stream=stdout or stderr, occurrence=TIME and replica=PID@HOST (in JSON: the event output, the line as its message, and those fields); a line longer than one 4 KiB log line is split into parts marked part=N, bytes that are not UTF-8 are written \\xNN (in text, control characters but the tab too), and the keeper writes them, so that a run's last lines survive a kill -9 of pgleader. --passthrough-logs writes the jobs' output as it is, on pgleader's stdout and stderr. The end of each run's output (--keep-output, 1KiB by default: the last whole lines that fit) is kept with the run's ledger row and shown by pgleader status --lock NAME --job JOB; nothing is kept with --passthrough-logs. A job still running when its next occurrence comes skips it; with overlap=replace that run is stopped, recorded as interrupted, and the new occurrence runs once it is gone; with overlap=allow it runs beside it (up to 4 runs of one job at once). pgleader cron pause --lock NAME JOB (or --all) pauses a job across the fleet, kept by the server through restarts and deploys: its occurrences are recorded as paused, neither run nor missed, until pgleader cron resume, after which it runs from its next occurrence. pgleader cron run --lock NAME JOB runs a job once, now, on the replica that owns it: the request is kept by the server beside the ledger and the owner is woken by the fleet's channel (NOTIFY, PUBLISH), takes the request once, while it holds the job, and records the run on it with who asked (user@host), never as one of the job's occurrences; the run gets PGLEADER_ASKED_BY and PGLEADER_SCHEDULED_TIME = when it was asked, follows the job's overlap= and timeout=, and keeps its output like any run; the command waits for it and prints its last lines (--no-wait returns at once), and pgleader status --job JOB lists it. A run whose owner dies is recorded as interrupted by the job's next owner and never started again. One Redis server works as PostgreSQL does; a Redlock quorum is refused with exit status 2.",
            ),
            Para(
                "HUP or USR2 (supercronic's reload signal) rereads the file: added jobs start, removed ones are no longer scheduled (a run in progress finishes), changed ones follow their new definition, unchanged ones are not touched; an added job, or one whose schedule or zone changed (by a reread or a deploy), runs from its next occurrence, never the one just before (catch-up is for a known definition's occurrences, missed while no replica ran them); a file that cannot be used is logged with its file and line, and the one read before keeps running. With --inotify a change of the file's content rereads it with no signal: the directories on the way to the file are watched (its own, and those of the symlinks it goes through), so a Kubernetes ConfigMap's update, a symlink swap that never writes the file read before, is seen too; the file is read 100 ms after a burst of events and reread only if its content differs from the one read last. TERM drains the replica, as supercronic does: no run starts any more, the jobs that are not running are handed over at once, and the running ones end by themselves with no signal, each job kept until its run has ended (so that no replica starts its next occurrence beside it); then pgleader releases everything and exits 0. --drain-timeout DURATION bounds that wait (none by default); past it, or on INT or a second TERM, every running command is stopped (the signal passed on, SIGKILL after --kill-timeout), its run recorded as interrupted, the jobs released, and pgleader exits 0. On Kubernetes, give the pod a terminationGracePeriodSeconds longer than the longest run plus --kill-timeout, and --drain-timeout a little under the grace period minus --kill-timeout. pgleader cron --check CRONTAB reads the file without connecting and prints its warnings (a name set twice or below a job, where cron reads the file otherwise; a line supercronic would refuse; a job that never runs; also logged at start) and each job, with its zone and where that comes from, its definition (the eight hex digits status shows) and its next occurrences (--from TIME, --next COUNT); exit status 2 names the file and line of a bad one.",
            ),
            Para(
                "pgleader status --lock NAME of a crontab fleet (its replicas' count marker is 0) lists each job with its owner (backend pid, pgleader pid and host, client address), its next occurrence (from the schedule and zone of its newest ledger row, after the server's clock) and its newest run's outcome and when (a claim made ahead of an occurrence not yet come is left out until then), reading the ledger (the rows whose lock_name starts with the fleet's key and U+001F) and pg_locks; A job whose definition differs between replicas (a rolling deploy half done: each replica announces, per job, a hash of its definition) shows each definition, as eight hex digits, with the replicas that hold it. --json puts them under crontab.jobs (definitions, defined_otherwise), and --watch prints a line when an owner, a newest run or the number of a job's definitions changes. On each replica, /status adds jobs (each with owned, command, schedule, timezone, next_occurrence, last_run with lateness_seconds, last_success, definition, and defined_otherwise_by: the member ids of the replicas that define it otherwise) and /leader answers 200 while it owns a job. The metrics add, with a job label (the job's name): pgleader_job_runs_total (counter, by outcome), pgleader_job_last_success_timestamp_seconds, pgleader_job_lateness_seconds, pgleader_job_running, pgleader_job_owned, pgleader_job_period_seconds, pgleader_job_known_since_timestamp_seconds and pgleader_job_definition_mismatch (gauges; the last is 1 while another replica defines the job otherwise).",
            ),
        ],
    },
    Section {
        heading: "TLS",
        body: &[
            Para(
                "pgleader speaks TLS 1.2 and 1.3 through rustls; it needs no OpenSSL. sslmode, sslrootcert, sslcert and sslkey come from the connection string or from PGSSLMODE, PGSSLROOTCERT, PGSSLCERT and PGSSLKEY, with libpq's meanings and defaults (~/.postgresql/root.crt, postgresql.crt, postgresql.key). TLS is never used over Unix sockets.",
            ),
            Entry("disable", "Never TLS."),
            Entry(
                "allow, prefer (the default)",
                "TLS if the server offers it, the certificate checked as under require; if the TLS handshake fails, one more attempt without TLS. allow tries TLS first too.",
            ),
            Entry(
                "require",
                "Always TLS. The server's certificate is not checked, unless a root certificate file exists: then it is checked as under verify-ca (libpq's rule).",
            ),
            Entry(
                "verify-ca",
                "Always TLS; the server's certificate must be signed by a CA from sslrootcert. The host name is not compared.",
            ),
            Entry(
                "verify-full",
                "As verify-ca, and the certificate must be issued for the host name given in host (not hostaddr).",
            ),
            Para(
                "sslrootcert=system trusts the system's certificate store and requires verify-full (the default with it). A certificate that does not verify, a server that refuses TLS under require, and a server that accepts this client only over TLS under sslmode=disable are permanent errors: pgleader exits 1 with a message that says which, without retrying. The certificate files are read again at each connection attempt, so a renewed certificate is used from the next reconnection.",
            ),
        ],
    },
    Section {
        heading: "REDIS",
        body: &[
            Para(
                "A redis:// or rediss:// URL elects through one Redis server (6 or later, a primary, not a Cluster node) instead of PostgreSQL; every option keeps its meaning, and --ledger-table, which has none there, is refused. The lock is the key pgleader:{NAME} (pgleader:{ID} for --lock-id), set only if absent with --lease as its TTL; its value names the holder: nonce, epoch, since, client id and session name (redis-cli GET shows who leads). PGLEADER_EPOCH is max(previous + 1, the server's clock in microseconds), so it keeps growing across a restart that kept nothing, as long as the server's clock does not go back.",
            ),
            Para(
                "The leader renews its own key only (compare, then extend, never re-create) and is told at once, by client-side tracking, when anyone else deletes, overwrites or flushes it; its command is then stopped. Followers block on a wake list (BLPOP) and try again every --check-interval: a released lock is taken in milliseconds, and a holder whose connection is gone (each session subscribes to a channel of its own, and PUBSUB NUMSUB tells) is replaced within a check interval, long before its TTL. A killed pgleader's connection closes only when its keeper has killed its whole tree. A waiting follower costs the server two commands per check interval. Scheduled jobs keep their ledger in the lock's keys (pgleader:{NAME}:runs and :rows); after a restart that kept nothing, an occurrence at or before the server's start is never claimed, since its record may be lost.",
            ),
            Para(
                "The user needs: +@read +@write +@scripting +@pubsub +@blocking +time +info +client|id +client|setname +client|tracking on ~pgleader:* and &pgleader:*. A wrong password or an ACL that refuses TIME, INFO or SUBSCRIBE is a permanent error (exit status 1); without PUBSUB NUMSUB a crashed leader is replaced only when its key expires (logged once). One Redis server is a single point of failure, and a replica promoted after a failover may not have the key: PGLEADER_EPOCH is what a protected resource can check. Sentinel and Unix sockets are refused. status names the key (pgleader:{NAME}) and each session by its Redis client id.",
            ),
            Para(
                "Given -d three or more times with Redis URLs (or one PGLEADER_DATABASE_URL of space-separated URLs), pgleader runs Redlock over a quorum of independent servers: a leadership holds while a majority holds this session's value, acquired at once on every server with validity left after the round and a drift allowance, renewed on every server and confirmed by a majority; a server up for less than --lease refuses its vote (delayed restart), and epochs are the majority's largest, written back before the command starts. A leader connects again to a server it lost and sets its key there where it is free, so a rolling restart of the servers never stops the command. A waiting follower costs each server one command per try (every --check-interval, with jitter), the leader one per check. Use it when the lock must outlive any one Redis server: the servers must be independent primaries (not replicas of each other) whose clocks do not jump. It protects against a server's death, its restart without data and a partition; a frozen pgleader's command is stopped by its keeper at the leader's deadline, but not a paused machine's: PGLEADER_EPOCH, checked by the protected resource, is what does. Two servers are refused and an even count is warned about. With --schedule, each server keeps the ledger, and an occurrence runs only if a majority of the servers accepted its claim under this leadership's value (a claim that reached only a minority is taken back); outcomes count when a majority recorded them, and status reads the history from a majority.",
            ),
        ],
    },
    Section {
        heading: "POSTGRESQL VERSIONS",
        body: &[Para(
            "PostgreSQL 13 to 18; an older server is refused with exit status 1. PostgreSQL 13 has no idle_session_timeout: there, a leader cut off from the server behind a proxy, pooler or load balancer keeps its lock until that middlebox closes the connection (its command is still stopped on time), and pgleader warns about it once at start. A direct connection is covered by TCP keepalives on every version.",
        )],
    },
    Section {
        heading: "HTTP ENDPOINT",
        body: &[
            Para(
                "With --http ADDR (PGLEADER_HTTP), leaders and followers serve four routes. HEAD answers as GET without the body; other methods get 405, other paths 404. Nothing secret is served: the connection shows as user@host:port/db.",
            ),
            Entry(
                "GET /leader",
                "200 while this instance leads: it holds the lock and its command runs (with --schedule: it holds the lock, between runs too). 503 otherwise, with what it does instead. During a --takeover-delay or --restart-fence wait the instance holds the lock (pgleader_is_leader is 1) but /leader stays 503 until the command runs. For readiness probes that send traffic to the leader only, HAProxy's httpchk, vip-manager. With --shards: 200 while the command of at least one shard runs on this replica.",
            ),
            Entry(
                "GET /healthz",
                "200 while this instance is healthy: following, leading with a successful check within --check-interval + --check-timeout, or idle between leaderships (--restart-delay). 503 with the reason while it is not: connecting or failing to connect, leadership being lost, shutting down. For probes that must not block rolling updates.",
            ),
            Entry(
                "GET /status",
                "One JSON object: version, role (connecting, follower, leader, stepping_down, idle, shutting_down), since, leader, healthy, problem, lock (key, name), connection, pid, host, backend_pid, epoch (of the current or last leadership), last_check, command (state: not_running, waiting, running or stopping; pid, started_at, last_exit), schedule (with --schedule: expression, timezone, next_occurrence on this host's clock, last_runs this instance claimed or recorded; else null), shards (with --shards: count, and held, the shards held here; else null).",
            ),
            Entry(
                "GET /metrics",
                "Prometheus' text format, version 0.0.4. Every series carries the label lock (the name with --lock, the key with --lock-id). pgleader_info{version,lock_key,lock_name} (gauge, 1); pgleader_is_leader (gauge); pgleader_epoch (gauge); pgleader_leadership_acquired_total (counter); pgleader_leadership_lost_total{reason} (counter; reason: connection_ended, check_failed, check_timeout, not_held, command_exited, relinquished, stepped_down, ledger_failed, shutdown, unhealthy, pre_start_failed); pgleader_last_check_success_timestamp_seconds (gauge); pgleader_check_duration_seconds (histogram); pgleader_command_running (gauge); pgleader_command_exits_total{outcome} (counter; outcome: succeeded, failed, signaled); pgleader_connection_failures_total (counter); with --schedule, pgleader_scheduled_runs_total{outcome} (counter; outcome: succeeded, failed, interrupted, skipped, missed, busy; each ledger outcome counted by the instance that recorded it); with --shards, the shard metrics of SHARDS.",
            ),
            Para(
                "The endpoint runs beside the election on pgleader's one thread and only reads what the election publishes, so no client can delay a check, a stop or a handoff. At most 64 connections are served at once (one more is closed at once), a request head may be at most 8 KiB (else 431) and must arrive within 5 s, and no connection is kept longer than 30 s.",
            ),
            Para(
                "pgleader status --watch polls pg_locks every 250 ms on one connection and prints a line (with --json, an object) each time the holder or the waiters change, reconnecting with backoff when the connection breaks. The fencing token is not in pg_locks; each leadership takes a new one on a new session, so a new epoch shows as a new holder.",
            ),
        ],
    },
    Section {
        heading: "SYSTEMD",
        body: &[
            Para("SYSTEMD"),
            Para(
                "In the unit: Type=notify and NotifyAccess=main; KillMode=mixed, so that systemctl stop sends TERM to pgleader alone, which stops the command's process group itself before releasing the lock; TimeoutStopSec longer than --kill-timeout; SuccessExitStatus=143, the status after a stop when the command died of the TERM passed on to it; TimeoutStartSec=infinity if the database may be down at boot. The repository's examples/systemd holds such a unit. The Debian package installs pgleader@.service, a template that runs the command of /etc/pgleader/INSTANCE.env (PGLEADER_COMMAND, split at white space, and any PGLEADER_ option) under a lock named after the instance, as the system user pgleader: systemctl enable --now pgleader@INSTANCE.",
            ),
        ],
    },
    Section {
        heading: "CONTAINERS",
        body: &[Para(
            "pgleader can be a container's entrypoint, PID 1: it passes signals on to the command's process group and reaps every orphan the kernel hands it, so no separate init (tini, docker run --init) is needed. Give the container a stop grace period longer than --kill-timeout. The release image (FROM scratch: the static binary at /pgleader and a CA bundle) is meant to be copied from: COPY --from=pgleader:VERSION /pgleader /usr/local/bin/pgleader. The binary is statically linked and needs nothing from the image it is copied into; it resolves host names from /etc/hosts and DNS (/etc/resolv.conf) only, loading no NSS module. The repository's examples/docker holds a Dockerfile.",
        )],
    },
    Section {
        heading: "SIGNALS",
        body: &[
            Para(
                "The command runs in a process group of its own, led by a small keeper process of pgleader's. pgleader passes HUP, QUIT, USR1, USR2 and WINCH on to that process group, and TERM and INT too (under pgleader cron, HUP and USR2 reread the crontab instead). TERM and INT also shut pgleader down: it waits for the command to exit (up to --kill-timeout, then SIGKILL), releases the lock and exits. A second TERM or INT sends SIGKILL at once. A replica waiting for the lock keeps a keeper ready, parked, so that winning costs one fork and exec, the command's; a parked keeper exits with pgleader, having started nothing. A replica of pgleader cron (and of --schedule --shards) runs all its commands under one keeper instead, its session's, started when it joins: each command leads a session and process group of its own, and the keeper keeps every run the promises above, telling whose an orphan is by its session, else by PGLEADER_JOB and PGLEADER_SCHEDULED_TIME in its environment, else counting it as every unfinished run's. It holds the replica's connection from the start: when pgleader is killed, it kills every run's tree and, once the last process is gone, on one Redis server (not over TLS) ends the replica's membership, and the other replicas take its jobs within milliseconds instead of at their next check. With --pre-start or --post-stop, each run has a keeper of its own, parked a quarter of a second before its occurrence, beside one more keeper, of the replica's membership, which does the same once every job's keeper has killed its job's tree and released the job.",
            ),
            Para(
                "The stop signal is followed by SIGCONT, so that a stopped command can act on it. When --kill-timeout runs out, the keeper SIGKILLs every process the command started, including those that left its process group with setsid (the keeper is a child subreaper, so they come back to it). If pgleader itself dies, even by SIGKILL, the keeper notices and does the same, so no part of the command outlives pgleader. If pgleader stops running without dying (stopped by SIGSTOP, blocked writing its log to a pipe nobody reads, stuck on a hung file system, starved), the keeper stops the command by itself once the leader's deadline (--check-interval + --check-timeout after the last successful check, renewed by each one, counted on a clock that goes on while the machine is suspended) has passed: the kill signal and SIGCONT to the process group, SIGKILL to everything after --kill-timeout, then --post-stop; when pgleader runs again it treats the leadership as lost and says why. Processes the command leaves behind when it exits are stopped too, and the lock is released only once the keeper has reaped every one of them (or, were the keeper killed from outside, once no member of the command's process group is alive).",
            ),
        ],
    },
    Section {
        heading: "FAILURE MODEL",
        body: &[
            Entry(
                "pgleader killed (kill -9, OOM)",
                "The keeper kills everything the command started. It holds a copy of pgleader's connection socket, so the server sees the connection close, and frees the lock, only once all of it is dead. A waiting replica starts its command within milliseconds of that, never before.",
            ),
            Entry(
                "graceful stop (SIGTERM)",
                "The command is stopped, then the lock is released; the next replica starts as soon as the command has exited.",
            ),
            Entry(
                "the leader's session terminated by the server",
                "pg_terminate_backend, idle_session_timeout or a restart: noticed the moment the connection ends, not at the next check; the command is signalled within milliseconds. The lock is free at once (pgleader lives on, so nothing holds it back), and the next replica may start while the old command is still stopping: --takeover-delay closes that window.",
            ),
            Entry(
                "database restart or crash",
                "Every session ends; the leader stops its command; everyone reconnects with backoff and jitter (100 ms doubling to 2 s), and a new leader wins within about 2 s of the server accepting connections again. A restart, or the crash of any server process, frees every lock at once, possibly before the old leader has stopped its command. So a leader that wins less than --restart-fence after the server last started or reset waits until that long has passed before starting its command; after a failover, a leader that has just lost its previous session waits until its new one is that old.",
            ),
            Entry(
                "silent network partition of the leader",
                "Checks stop succeeding; the command is being stopped at most --check-interval + --check-timeout after the last successful check. The server frees the lock about one --lease after it last heard from the leader, and never before the old command is gone: start-up refuses a lease shorter than check-interval + check-timeout + kill-timeout + 1 s.",
            ),
            Entry(
                "pgleader alone frozen (SIGSTOP, a log pipe nobody reads, a hung file system, starved)",
                "Its command's keeper, which runs on, stops the command by itself at the leader's deadline (--check-interval + --check-timeout after the last successful check), by the same rules as any stop, within --kill-timeout more; the server frees the lock only a --lease after it last heard from the leader, so the next replica's command never overlaps it. When pgleader runs again it finds its leadership lost (the log says the keeper stopped the command) and takes part in the election again.",
            ),
            Entry(
                "the whole machine paused (VM pause, a frozen container: pgleader, keeper and command together) longer than the lease",
                "The server ends the paused leader's idle session and another replica leads; when the machine runs again, the keeper (counting on a clock that includes a suspend) and pgleader stop the command at once. The two commands may overlap meanwhile: only a fencing token (PGLEADER_EPOCH) checked by the protected resource prevents harm.",
            ),
            Entry(
                "standby server",
                "pgleader never leads through a server in recovery; it logs why and retries. With several hosts listed it looks for the read-write one (target_session_attrs=read-write is the default then), so it follows a failover to a promoted standby. The restart fence covers a promotion too: no pgleader session existed on the standby before it.",
            ),
            Entry(
                "followers waiting for days, and VACUUM",
                "A statement holds a snapshot, which holds back VACUUM and CREATE INDEX CONCURRENTLY in its database. A follower waits in turns, on the server, without a round trip: it asks for the lock with a lock_timeout a little under --wait-refresh (10 s), catches the timeout (nothing is logged at ERROR) and asks again in a new transaction, so that no snapshot of a waiting follower is older than --wait-refresh. A released lock is still granted at once; followers are granted in the order they last queued. --wait-refresh 0 waits in one statement, first come first served, holding its snapshot until it wins: for a database of pgleader's own.",
            ),
            Entry(
                "transaction-mode pooler",
                "Refused at connection time with exit status 1: a probe connection that is handed this session's server process, or a session whose statements run on different server processes, means the lock would not belong to pgleader's session. Connect directly or through a session-mode pool. The probe runs unless the server reports this very TCP connection's two ends (inet_client_addr and port, inet_server_addr and port), which a pooler or proxy in between does not show, since it opens connections of its own; it relies on the pooler reusing server connections last-in-first-out (PgBouncer's default). The leader's checks keep comparing backend pids in any case.",
            ),
        ],
    },
    Section {
        heading: "EXAMPLES",
        body: &[
            Entry(
                "pgleader run --lock-id 10 -- ./nightly-job.sh",
                "Run the job on one replica at a time; another replica takes over if this one goes away.",
            ),
            Entry(
                "pgleader run --once --no-wait --lock nightly -- ./nightly-job.sh",
                "From cron on every host: whichever host wins runs the job; the others exit 0 at once.",
            ),
            Entry(
                "pgleader run --lock nightly --schedule '0 3 * * *' --schedule-timezone Europe/Paris -- ./nightly-job.sh",
                "On every replica: the job runs once a night at 03:00 Paris time, on whichever replica leads.",
            ),
            Entry(
                "pgleader run --once --lock nightly --schedule '0 3 * * *' --schedule-timezone Europe/Paris -- ./nightly-job.sh",
                "From cron or a systemd timer on every host: the first timer runs that night's occurrence; later ones exit 0 at once.",
            ),
            Entry(
                "pgleader cron --lock app-cron /app/crontab",
                "On every replica: each occurrence of each job of the crontab runs once, the jobs shared out over the replicas.",
            ),
            Entry(
                "pgleader run --lock consumer --relinquish-schedule '0 0 * * *' -- ./consume",
                "Hand the consumer over to the next replica every midnight.",
            ),
            Entry(
                "pgleader run --http 0.0.0.0:9187 --lock consumer -- ./consume",
                "Serve /leader, /healthz, /status and Prometheus /metrics on port 9187.",
            ),
            Entry("pgleader status --lock nightly", "Who leads, who waits."),
            Entry(
                "pgleader status --lock nightly --watch",
                "Print a line each time the leader or the waiters change, until interrupted.",
            ),
        ],
    },
];

/// The manual page, in roff.
pub fn man_page() -> String {
    let mut out = Vec::new();
    let top = Cli::command();
    let man = clap_mangen::Man::new(top.clone()).date("");
    man.render_title(&mut out).expect("in memory");
    man.render_name_section(&mut out).expect("in memory");
    man.render_synopsis_section(&mut out).expect("in memory");
    man.render_description_section(&mut out).expect("in memory");
    let mut options = Vec::new();
    man.render_options_section(&mut options).expect("in memory");
    let mut text = String::from_utf8(out).expect("roff is UTF-8");
    // clap_mangen lists -h and -V under OPTIONS, then the options with a help heading under it;
    // at the top level every option is global, so one section holds them all.
    let options = String::from_utf8_lossy(&options);
    let (help_and_version, global) = options
        .split_once(".SH \"GLOBAL OPTIONS\"\n")
        .expect("the global options have their help heading");
    text.push_str(".SH \"GLOBAL OPTIONS\"\n");
    text.push_str(global);
    text.push_str(&help_and_version.replacen(".SH OPTIONS\n", "", 1));

    // Each subcommand, and theirs (`pgleader cron pause`), in order.
    let commands: Vec<(String, &clap::Command)> = top
        .get_subcommands()
        .flat_map(|sub| {
            let name = sub.get_name().to_owned();
            std::iter::once((name.clone(), sub)).chain(
                sub.get_subcommands()
                    .map(move |inner| (format!("{name} {}", inner.get_name()), inner)),
            )
        })
        .collect();
    for (name, sub) in commands {
        let sub = sub.clone().bin_name(format!("pgleader {name}"));
        let man = clap_mangen::Man::new(sub.clone());
        let mut synopsis = Vec::new();
        man.render_synopsis_section(&mut synopsis)
            .expect("in memory");
        let mut options = Vec::new();
        man.render_options_section(&mut options).expect("in memory");
        let about = sub
            .get_about()
            .map(|about| about.to_string())
            .unwrap_or_default();
        text.push_str(&format!(".SH \"pgleader {name}\"\n{}\n", escape(&about)));
        text.push_str(&String::from_utf8_lossy(&synopsis).replacen(
            ".SH SYNOPSIS",
            ".SS Synopsis",
            1,
        ));
        text.push_str(&String::from_utf8_lossy(&options).replacen(".SH OPTIONS", ".SS Options", 1));
    }

    text.push_str(".SH \"OPTIONS FROM THE ENVIRONMENT\"\n.PP\nEach option of run can also be set from an environment variable; a value on the command line wins.\n");
    if let Some(run) = top.find_subcommand("run") {
        for arg in run.get_arguments() {
            let (Some(env), Some(long)) = (arg.get_env(), arg.get_long()) else {
                continue;
            };
            text.push_str(&format!(
                ".TP\n\\fB{}\\fR\n\\-\\-{}\n",
                escape(&env.to_string_lossy()),
                escape(long)
            ));
        }
    }
    for (env, long) in [("PGLEADER_LOCK_ID", "lock-id"), ("PGLEADER_LOCK", "lock")] {
        text.push_str(&format!(
            ".TP\n\\fB{}\\fR\n\\-\\-{} (read only when neither \\-\\-lock\\-id nor \\-\\-lock is given)\n",
            escape(env),
            escape(long)
        ));
    }

    for section in SECTIONS {
        text.push_str(&format!(".SH \"{}\"\n", section.heading));
        for block in section.body {
            match block {
                Para(body) => text.push_str(&format!(".PP\n{}\n", escape(body))),
                Entry(term, body) => text.push_str(&format!(
                    ".TP\n\\fB{}\\fR\n{}\n",
                    escape(term),
                    escape(body)
                )),
            }
        }
    }
    let mut version = Vec::new();
    man.render_version_section(&mut version).expect("in memory");
    text.push_str(&String::from_utf8_lossy(&version));
    text
}

/// Escapes text for roff: backslashes, hyphens, and a leading dot or quote.
fn escape(text: &str) -> String {
    let escaped = text.replace('\\', "\\\\").replace('-', "\\-");
    if escaped.starts_with('.') || escaped.starts_with('\'') {
        format!("\\&{escaped}")
    } else {
        escaped
    }
}

/// Completion scripts: (file name, contents) for bash, zsh and fish.
pub fn completions() -> Vec<(String, String)> {
    [Shell::Bash, Shell::Zsh, Shell::Fish]
        .into_iter()
        .map(|shell| {
            let mut command = Cli::command();
            let mut out = Vec::new();
            clap_complete::generate(shell, &mut command, "pgleader", &mut out);
            let name = match shell {
                Shell::Bash => "pgleader.bash".to_owned(),
                Shell::Zsh => "_pgleader".to_owned(),
                _ => "pgleader.fish".to_owned(),
            };
            (name, String::from_utf8(out).expect("completions are UTF-8"))
        })
        .collect()
}
