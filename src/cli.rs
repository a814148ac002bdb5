//! The command line: the whole user contract, with its help texts. The manual page is generated
//! from these definitions (see `docs.rs`), so what is written here is what users read.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::builder::BoolishValueParser;
use clap::{ArgAction, ArgGroup, Args, Parser, Subcommand, ValueEnum};
use nix::sys::signal::Signal;

/// Each description is one line of its own, indented: clap wraps a long line of after-help text
/// at the terminal's width and indents the continuation as deep as the line starts, so only
/// this layout stays a clean table at any width.
/// `pgleader cron --help`'s end: which of run's options it does not take, and its exit status.
const CRON_AFTER_HELP: &str = "\
Not taken here, since a crontab's jobs are their own schedules: run's --once, --no-wait, --busy-exit-code, --restart-delay, --relinquish-after, --relinquish-schedule, --schedule and its companions, --shards and --max-shards. Redis: one server (a Redlock quorum is refused).

Exit status (cron):
  0
      --check read the crontab; or shut down: by TERM once the running jobs ended by themselves (or --drain-timeout stopped them), by INT or a second TERM with every running command stopped and recorded
  1
      fatal error (as for run: bad password, unknown database, a ledger table that cannot be used, ...)
  2
      usage error: a crontab that cannot be read or used (its file, line and what is wrong), a Redlock quorum, a replica of the same lock running --shards or without a crontab
";

const AFTER_HELP: &str = "\
Exit status (run):
  the command's status
      under --once, or after a shutdown that stopped it (128+N if it was killed by signal N); with --shards, which stops several, 0
  0
      shut down while no command was running; --no-wait found the lock busy; --once --schedule found its occurrence claimed (see --busy-exit-code)
  1
      fatal error: bad password, unknown database, TLS certificate that does not verify, a server older than PostgreSQL 13, unreachable database under --no-wait, a ledger table that cannot be used, an --http address that cannot be listened on
  2
      usage error: an unknown option, an invalid value (an --http address that does not parse, too), a missing command; --health-cmd with --no-wait or --schedule --once; --shards beside a replica of the same lock with another shard count, or without --shards, and the other way round
  75
      --once: leadership was lost, or the health probe turned unhealthy, while the command ran
  126, 127
      the command cannot be executed / was not found

Exit status (status):
  0 the lock (sharded: a shard) is held, 3 it is free, 1 error, 2 usage error
  with --watch: 0 when interrupted (TERM, INT), 1 error, 2 usage error

Exit status (step-down):
  0 another replica leads now, 3 there was no leader, 4 no replica waited to take over (nothing was sent; the leader keeps leading), 5 no other replica led within --timeout, or the leader did not hear the request, 1 error, 2 usage error (--to, a sharded lock, a Redlock quorum)";

/// The most shards `--shards` takes.
pub const MAX_SHARDS: i64 = 4096;

#[derive(Debug, Parser)]
#[command(
    name = "pgleader",
    version,
    about = "Run a command on exactly one replica: the one holding a PostgreSQL advisory lock",
    long_about = "Run a command on exactly one replica of a service: the one whose PostgreSQL session \
holds an advisory lock. Every replica runs `pgleader run`; one wins the lock and runs the command, \
the others wait in line. When the leader loses the lock (its session ends, the server restarts, a \
check fails or times out) its command's whole process group is stopped at once, and a waiting \
replica takes over within milliseconds of the lock being freed.",
    after_help = AFTER_HELP,
    propagate_version = true
)]
pub struct Cli {
    #[command(flatten)]
    pub logging: LogArgs,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a command while, and only while, this instance holds the lock
    #[command(after_help = AFTER_HELP)]
    Run(Box<RunArgs>),
    /// Show who holds the lock and who waits for it (sharded: who holds which shard)
    #[command(after_help = AFTER_HELP)]
    Status(StatusArgs),
    /// Ask the leader to stop its command gracefully, release the lock and stay on as a
    /// follower, so that the next waiting replica takes over; print who led and who leads now
    #[command(after_help = AFTER_HELP)]
    StepDown(StepDownArgs),
    /// Run a crontab (read as supercronic and cron read it) across the fleet: each occurrence of
    /// each job once, the jobs shared out over the replicas; or --check it without connecting
    #[command(after_help = CRON_AFTER_HELP)]
    Cron(Box<CronArgs>),
}

/// Global: accepted before or after the subcommand, and listed under their own heading so that
/// they do not interleave with a subcommand's own options in its --help.
#[derive(Debug, Args)]
#[command(next_help_heading = "Global options")]
pub struct LogArgs {
    /// Log format: one line of text per event, or one JSON object per line
    #[arg(
        long,
        value_enum,
        default_value_t = LogFormat::Text,
        env = "PGLEADER_LOG_FORMAT",
        global = true
    )]
    pub log_format: LogFormat,

    /// Log more: -v adds debug details (every check, every reaped process), -vv everything
    #[arg(short, long, action = ArgAction::Count, global = true, conflicts_with = "quiet")]
    pub verbose: u8,

    /// Log less: -q only warnings and errors, -qq only errors
    #[arg(short, long, action = ArgAction::Count, global = true)]
    pub quiet: u8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// The lock, by number or by name; exactly one. Read from the environment only when neither is
/// on the command line (a command run by pgleader inherits PGLEADER_LOCK_ID, and must still be
/// able to run another pgleader with --lock).
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("lock").args(["lock_id", "lock_name"]).multiple(false)))]
pub struct LockArgs {
    /// The lock's key: a signed 64-bit integer, as pg_advisory_lock(bigint) takes it (on
    /// Redis: the key pgleader:{ID}) [env: PGLEADER_LOCK_ID]
    #[arg(long = "lock-id", value_name = "ID", allow_negative_numbers = true)]
    pub lock_id: Option<i64>,

    /// The lock's name, hashed to a key with PostgreSQL's hashtextextended(NAME, 0) (on Redis:
    /// the key pgleader:{NAME}) [env: PGLEADER_LOCK]
    #[arg(long = "lock", value_name = "NAME", value_parser = non_empty_name)]
    pub lock_name: Option<String>,
}

#[derive(Debug, Args)]
pub struct ConnectionArgs {
    /// The server: a postgres:// URL or key=value pairs (default: $DATABASE_URL, else the PG*
    /// variables and psql's defaults; passwords are best kept in ~/.pgpass), or a Redis server:
    /// redis://[USER[:PASSWORD]@]HOST[:PORT][/DB], rediss:// for TLS (?cacert=FILE names a CA;
    /// the password may come from $REDISCLI_AUTH). Given three or more times with Redis URLs
    /// (in PGLEADER_DATABASE_URL: separated by spaces), a Redlock quorum of independent servers
    #[arg(
        short = 'd',
        long,
        value_name = "URL",
        env = "PGLEADER_DATABASE_URL",
        hide_env_values = true,
        action = clap::ArgAction::Append
    )]
    pub database_url: Vec<String>,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub replica: ReplicaArgs,

    /// Wait for leadership, run the command once, and exit with its status
    #[arg(long, env = "PGLEADER_ONCE", value_parser = BoolishValueParser::new())]
    pub once: bool,

    /// Try the lock once: if another instance holds it, exit at once with --busy-exit-code.
    /// Implies --once
    #[arg(long, env = "PGLEADER_NO_WAIT", value_parser = BoolishValueParser::new())]
    pub no_wait: bool,

    /// Exit code of --no-wait when the lock is busy (0 so that cron mails no failure from
    /// every non-leader)
    #[arg(
        long,
        value_name = "CODE",
        default_value_t = 0,
        env = "PGLEADER_BUSY_EXIT_CODE"
    )]
    pub busy_exit_code: u8,

    /// Without --once: after the command exits on its own, release the lock and wait this long
    /// before entering the election again, so another replica can take its turn. 0 re-enters
    /// at once
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = duration, env = "PGLEADER_RESTART_DELAY")]
    pub restart_delay: Duration,

    /// After leading this long, stop the command gracefully, release the lock and let the next
    /// waiting replica lead: a planned handoff. A lone replica leads again at once
    #[arg(long, value_name = "DURATION", value_parser = positive_duration, env = "PGLEADER_RELINQUISH_AFTER", conflicts_with_all = ["once", "no_wait"])]
    pub relinquish_after: Option<Duration>,

    /// Hand leadership over at the times of this cron expression, in local time ("0 0 * * *":
    /// daily at midnight; an optional sixth, leading field gives seconds). Otherwise like
    /// --relinquish-after
    #[arg(long, value_name = "CRON", value_parser = parse_schedule, env = "PGLEADER_RELINQUISH_SCHEDULE", conflicts_with_all = ["once", "no_wait"])]
    pub relinquish_schedule: Option<croner::Cron>,

    /// Run the command at the times of this cron expression instead of at once: five fields
    /// ("0 3 * * *": daily at 03:00), six with seconds first, or @hourly, @daily, @weekly,
    /// @monthly, @yearly. Each occurrence runs at most once across all replicas, on the database
    /// server's clock; the leader keeps the lock between runs. With --once: run the occurrence
    /// this timer fired for, unless a replica already claimed it
    #[arg(long, value_name = "CRON", env = "PGLEADER_SCHEDULE", help_heading = "Scheduled jobs", conflicts_with_all = ["relinquish_after", "relinquish_schedule", "restart_delay"])]
    pub schedule: Option<String>,

    /// The time zone --schedule is read in: an IANA name such as Europe/Paris. Every replica of
    /// a lock must use the same
    #[arg(
        long,
        value_name = "TZ",
        default_value = "UTC",
        env = "PGLEADER_SCHEDULE_TIMEZONE",
        help_heading = "Scheduled jobs",
        requires = "schedule"
    )]
    pub schedule_timezone: String,

    /// Run an occurrence that came while no leader could run it (the fleet or the database
    /// down, a failover) if it is at most this old; only the most recent one, never a backlog.
    /// Older ones are recorded as missed. 0 runs only occurrences a leader was waiting for
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = duration, env = "PGLEADER_CATCH_UP", help_heading = "Scheduled jobs", requires = "schedule")]
    pub catch_up: Duration,

    /// How many times an occurrence whose run was interrupted (its leader lost the lock or was
    /// shut down) is started again by the next leader. 0: never, so no occurrence starts twice
    #[arg(
        long,
        value_name = "COUNT",
        default_value_t = 0,
        env = "PGLEADER_RETRY_INTERRUPTED",
        help_heading = "Scheduled jobs",
        requires = "schedule"
    )]
    pub retry_interrupted: u32,

    /// PostgreSQL or one Redis server: run K numbered instances of the command across the
    /// replicas of this lock,
    /// each exactly once, shared out evenly among the replicas that run (a replica over its
    /// share stops the surplus and hands it over). Each instance gets PGLEADER_SHARD (0 to K-1)
    /// and PGLEADER_SHARDS=K; a command that ignores them runs at most K times across the
    /// fleet. Every replica of a lock must give the same K. With --schedule, each shard's
    /// occurrences run once, on whichever replica holds the shard, recorded in the ledger per
    /// shard. No environment variable: a shard's command is given PGLEADER_SHARDS, and a
    /// pgleader it starts must not take it for its own
    #[arg(
        long,
        value_name = "K",
        value_parser = clap::value_parser!(u32).range(1..=MAX_SHARDS),
        help_heading = "Shards"
    )]
    pub shards: Option<u32>,

    /// With --shards: take at most this many shards on this replica (a small machine); the
    /// others share the rest out. Shards that no replica has room for are left unrun
    #[arg(
        long,
        value_name = "N",
        value_parser = clap::value_parser!(u32).range(1..=MAX_SHARDS),
        env = "PGLEADER_MAX_SHARDS",
        help_heading = "Shards",
        requires = "shards"
    )]
    pub max_shards: Option<u32>,

    /// The command to run, with its arguments, which are passed on untouched (options included).
    /// A command whose name starts with "-" must follow --
    // No allow_hyphen_values: an unknown option before the command must be a usage error (with
    // a suggestion), not a command that is not found. trailing_var_arg still hands everything
    // after the first word to the command, options included.
    #[arg(
        value_name = "COMMAND",
        required = true,
        num_args = 1..,
        trailing_var_arg = true
    )]
    pub command: Vec<OsString>,
}

/// What every replica of a fleet is given, whatever it runs (`run`, `cron`): the lock, the
/// server, the timing of checks and stops, the ledger, health checks, hooks and HTTP.
#[derive(Debug, Args)]
pub struct ReplicaArgs {
    #[command(flatten)]
    pub lock: LockArgs,

    #[command(flatten)]
    pub connection: ConnectionArgs,

    /// How often the leader confirms on its session that it still holds the lock
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = positive_duration, env = "PGLEADER_CHECK_INTERVAL")]
    pub check_interval: Duration,

    /// How long a confirmation may take before leadership counts as lost. The command is
    /// stopping --check-interval + --check-timeout after the last successful confirmation, by
    /// its keeper if pgleader itself is not running then (stopped, hung, starved)
    #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = positive_duration, env = "PGLEADER_CHECK_TIMEOUT")]
    pub check_timeout: Duration,

    /// Signal sent to the command's process group to stop it when leadership is lost or the
    /// command is restarted (TERM, SIGTERM or 15). On shutdown, the signal pgleader received is
    /// passed on instead
    #[arg(long, value_name = "SIGNAL", default_value = "TERM", value_parser = parse_signal, env = "PGLEADER_KILL_SIGNAL")]
    pub kill_signal: Signal,

    /// How long the command may take to exit after the stop signal before its process group is
    /// sent SIGKILL. 0 sends SIGKILL at once
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = duration, env = "PGLEADER_KILL_TIMEOUT")]
    pub kill_timeout: Duration,

    /// How long the server keeps the lock of a leader it no longer hears from (silent network
    /// partition, frozen host). Must exceed --check-interval + --check-timeout + --kill-timeout
    /// by at least 1s, so that the old command is gone before anyone else can win. On Redis it
    /// is the key's TTL, and must also allow for the server's clock running 1% fast
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = positive_duration, env = "PGLEADER_LEASE")]
    pub lease: Duration,

    /// After winning the lock, wait this long before starting the command: a fence for the
    /// case where an administrator or a server restart ends the old leader's session while its
    /// command still runs. 0 starts at once
    #[arg(long, value_name = "DURATION", default_value = "0s", value_parser = duration, env = "PGLEADER_TAKEOVER_DELAY")]
    pub takeover_delay: Duration,

    #[command(flatten)]
    pub ledger: LedgerArgs,

    /// Run this shell command line (sh -c, stdin from /dev/null) to check that this replica is
    /// fit to lead: at start-up, then --health-interval after each probe ends, in every phase.
    /// Exit 0 passes. The replica queues for the lock only after a pass; after
    /// --health-retries failures in a row it is unhealthy: a leader stops its command and
    /// releases the lock, a follower leaves the queue, and neither queues again until a probe
    /// passes (with --shards: it gives up every shard and leaves until then). The probe runs in
    /// a process group of its own, never the command's; its output is logged when it fails. Not
    /// with --no-wait or --schedule --once
    #[arg(
        long,
        value_name = "CMD",
        value_parser = shell_line,
        env = "PGLEADER_HEALTH_CMD",
        help_heading = "Health checks"
    )]
    pub health_cmd: Option<String>,

    /// How long after a health probe ends the next one starts
    #[arg(
        long,
        value_name = "DURATION",
        default_value = "10s",
        value_parser = positive_duration,
        env = "PGLEADER_HEALTH_INTERVAL",
        help_heading = "Health checks",
        requires = "health_cmd"
    )]
    pub health_interval: Duration,

    /// How long a health probe may run: then it is killed with everything it started, and
    /// counts as failed
    #[arg(
        long,
        value_name = "DURATION",
        default_value = "5s",
        value_parser = positive_duration,
        env = "PGLEADER_HEALTH_TIMEOUT",
        help_heading = "Health checks",
        requires = "health_cmd"
    )]
    pub health_timeout: Duration,

    /// How many health probes in a row must fail for this replica to be unhealthy
    #[arg(
        long,
        value_name = "COUNT",
        default_value_t = 3,
        value_parser = clap::value_parser!(u32).range(1..),
        env = "PGLEADER_HEALTH_RETRIES",
        help_heading = "Health checks",
        requires = "health_cmd"
    )]
    pub health_retries: u32,

    /// After winning less than this long after a server restart, crash or failover (which free
    /// every lock at once, possibly while the previous leader is still stopping its command),
    /// wait until this long has passed before starting the command. auto = --check-interval +
    /// --check-timeout + --kill-timeout (+ --hook-timeout with --post-stop) + 1s, the longest a
    /// previous leader with the same settings can take. 0 disables
    #[arg(long, value_name = "DURATION", default_value = "auto", value_parser = auto_or_duration, env = "PGLEADER_RESTART_FENCE")]
    pub restart_fence: RestartFence,

    /// PostgreSQL: a waiting replica queues for the lock again this often, in a new
    /// transaction, so that its snapshot never holds back VACUUM or CREATE INDEX CONCURRENTLY in
    /// the database for longer. A released lock is still taken at once. 0 waits in one
    /// statement, first come first served, holding its snapshot until it wins (for a database of
    /// pgleader's own). No effect on Redis
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = wait_refresh, env = "PGLEADER_WAIT_REFRESH")]
    pub wait_refresh: Duration,

    /// Run this shell command line (sh -c) after winning the lock, before the command starts
    /// (attach a floating IP, update a DNS record). If it fails or times out, the command does
    /// not start: --post-stop runs, the lock is released, and this replica sits out (1s,
    /// doubling up to 1m while it keeps failing). It gets the command's environment and
    /// PGLEADER_HOOK=pre-start. With --schedule it runs before each run, with --shards before
    /// each shard's command
    #[arg(long, value_name = "CMD", value_parser = shell_line, env = "PGLEADER_PRE_START", help_heading = "Hooks")]
    pub pre_start: Option<String>,

    /// Run this shell command line (sh -c) once the command's whole process tree is gone,
    /// whatever ended it (its exit, a lost lock, a signal, a handoff, pgleader killed -9), and
    /// before the lock is released, so that the next leader's --pre-start starts only after it
    /// finished (detach the floating IP). It gets the command's environment,
    /// PGLEADER_HOOK=post-stop and PGLEADER_EXIT_CODE (when the command ran)
    #[arg(long, value_name = "CMD", value_parser = shell_line, env = "PGLEADER_POST_STOP", help_heading = "Hooks")]
    pub post_stop: Option<String>,

    /// How long each hook may run before it is killed with everything it started (a failed
    /// --pre-start). With --post-stop, --lease must cover it too: --check-interval +
    /// --check-timeout + --kill-timeout + --hook-timeout + 1s (14s with the defaults)
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = positive_duration, env = "PGLEADER_HOOK_TIMEOUT", help_heading = "Hooks")]
    pub hook_timeout: Duration,

    /// Serve /leader, /healthz, /status and /metrics (Prometheus) over HTTP on this address
    /// and port: 127.0.0.1:9187 for this host only, 0.0.0.0:9187 or [::]:9187 for every
    /// interface (port 0: any free port, which the log names). Off unless given
    #[arg(long, value_name = "ADDR", value_parser = http_address, env = "PGLEADER_HTTP")]
    pub http: Option<SocketAddr>,
}

/// Where scheduled runs are recorded.
#[derive(Debug, Args)]
pub struct LedgerArgs {
    /// PostgreSQL: the table that records each scheduled occurrence (created when missing),
    /// optionally with its schema: ops.pgleader_ledger [default: pgleader_ledger]. On Redis the
    /// ledger lives in the lock's own keys, and this option is refused
    #[arg(
        long,
        value_name = "TABLE",
        env = "PGLEADER_LEDGER_TABLE",
        help_heading = "Scheduled jobs"
    )]
    pub ledger_table: Option<String>,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub lock: LockArgs,

    #[command(flatten)]
    pub connection: ConnectionArgs,

    #[command(flatten)]
    pub ledger: LedgerArgs,

    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,

    /// Keep running: print the lock's state again (one line, or one JSON object per line) each
    /// time its holder or its waiters change, until interrupted
    #[arg(long)]
    pub watch: bool,

    /// For a crontab fleet (pgleader cron): the last runs of job JOB instead, newest first, from
    /// the ledger: each occurrence's outcome, exit code, how long it took, the replica that ran
    /// it and why it was missed, skipped or interrupted. Exit status 3 when none is recorded
    #[arg(long, value_name = "JOB", conflicts_with = "watch")]
    pub job: Option<String>,
}

/// `pgleader cron run`, `pgleader cron pause` and `pgleader cron resume`.
#[derive(Debug, Subcommand)]
pub enum CronAction {
    /// Run a job once, now, on the replica that owns it, as asked by hand: recorded beside the
    /// ledger with who asked (user@host), never as one of its occurrences; it follows the
    /// job's overlap= (skip: not beside a run going on). Waits for the run and exits with its
    /// exit status (75 when it was skipped or interrupted); 2 when no replica defines the job,
    /// 1 when none runs
    Run(CronRunArgs),
    /// Pause a job across the fleet (or --all): its occurrences are recorded as paused, not
    /// run and not missed, until it is resumed; kept by the server, through restarts and
    /// rereads of every replica. A run going on is not stopped
    Pause(CronJobArgs),
    /// Resume a paused job (or --all: every pause of the fleet): it runs from its next
    /// occurrence, the paused ones not caught up
    Resume(CronJobArgs),
}

/// Which fleet, and which of its jobs.
#[derive(Debug, Args)]
pub struct CronJobArgs {
    #[command(flatten)]
    pub lock: LockArgs,

    #[command(flatten)]
    pub connection: ConnectionArgs,

    #[command(flatten)]
    pub ledger: LedgerArgs,

    /// The job, by its name (name= in its directive, or the name made from its command, as
    /// `pgleader cron --check` shows it)
    #[arg(
        value_name = "JOB",
        required_unless_present = "all",
        conflicts_with = "all"
    )]
    pub job: Option<String>,

    /// Every job of the fleet, those its crontab gains later too
    #[arg(long)]
    pub all: bool,
}

/// Which fleet, which of its jobs, and whether to wait for the run.
#[derive(Debug, Args)]
pub struct CronRunArgs {
    #[command(flatten)]
    pub lock: LockArgs,

    #[command(flatten)]
    pub connection: ConnectionArgs,

    #[command(flatten)]
    pub ledger: LedgerArgs,

    /// The job, by its name (name= in its directive, or the name made from its command, as
    /// `pgleader cron --check` shows it)
    #[arg(value_name = "JOB")]
    pub job: String,

    /// Return once the fleet has the request, without waiting for the run (which goes on;
    /// `pgleader status --lock NAME --job JOB` shows it)
    #[arg(long)]
    pub no_wait: bool,
}

/// `pgleader cron`.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct CronArgs {
    /// Operates the fleet's jobs instead of running a replica
    #[command(subcommand)]
    pub action: Option<CronAction>,

    #[command(flatten)]
    pub replica: ReplicaArgs,

    /// The crontab: five-field lines (six or seven with a year, seconds first in seven, as
    /// supercronic reads them), @hourly and its kind, @every DURATION, NAME=value lines given
    /// to every job, the last value winning (CRON_TZ= sets the zone, else TZ, /etc/localtime or
    /// UTC; SHELL= the shell), and per-job options in a comment above a job: # pgleader:
    /// name=NAME overlap=skip|allow|replace catch-up=1h timeout=30m jitter=30s ping=URL|none zone=ZONE (PGLEADER_PING=URL: every job's monitor, {job} its name). SIGHUP or SIGUSR2 (supercronic's reload) rereads it
    #[arg(value_name = "CRONTAB", required = true)]
    pub crontab: Option<PathBuf>,

    /// On TERM, how long the runs going on may take to end by themselves before they are
    /// stopped as at any shutdown (the kill signal, SIGKILL after --kill-timeout); none: as
    /// long as they need, as supercronic. Meanwhile the replica starts no run and hands its
    /// other jobs over at once. A second TERM, or an INT, stops the runs at once
    #[arg(long, value_name = "DURATION", value_parser = duration, env = "PGLEADER_DRAIN_TIMEOUT")]
    pub drain_timeout: Option<Duration>,

    /// Reread the crontab when its content changes, as supercronic's -inotify: the directories
    /// on the way to the file are watched (its own, and those of the symlinks it goes
    /// through), so a Kubernetes ConfigMap's update, a symlink swap, is seen too. A bad file is
    /// refused as on HUP: the crontab read before keeps running
    #[arg(long, env = "PGLEADER_INOTIFY", value_parser = BoolishValueParser::new())]
    pub inotify: bool,

    /// Write the jobs' output as it is, on pgleader's stdout and stderr, as supercronic's
    /// -passthrough-logs does. Without it, each line a job writes is a log line of its own on
    /// stderr, in --log-format, with job=NAME, stream=stdout|stderr, occurrence=TIME and
    /// replica=PID@HOST (a line longer than 4 KiB is split into parts, marked part=N)
    #[arg(long, env = "PGLEADER_PASSTHROUGH_LOGS", value_parser = BoolishValueParser::new())]
    pub passthrough_logs: bool,

    /// How much of the end of each run's output is kept with the run's ledger row, for
    /// `pgleader status --lock NAME --job JOB`: the last whole lines that fit, both streams in
    /// the order their lines ended, bytes that are not text written \xNN. At most 64KiB; 0
    /// keeps nothing. The ledger keeps a job's last 100 rows. Nothing is kept with
    /// --passthrough-logs, whose output pgleader never reads
    #[arg(long, value_name = "SIZE", default_value = "1KiB", value_parser = output_size, env = "PGLEADER_KEEP_OUTPUT")]
    pub keep_output: u32,

    /// Read and check the crontab without connecting; print its warnings and each job (name,
    /// schedule, zone and where it comes from, command, options, definition) with its next
    /// occurrences; exit 0, or 2 naming the file, the line and what is wrong
    #[arg(long)]
    pub check: bool,

    /// With --check: list the occurrences after this instant (RFC 3339, such as
    /// 2027-03-27T12:00:00Z) rather than after now
    #[arg(long, value_name = "TIME", requires = "check")]
    pub from: Option<String>,

    /// With --check: how many occurrences to list for each job
    #[arg(long, value_name = "COUNT", default_value_t = 3, requires = "check")]
    pub next: usize,
}

/// `pgleader step-down`. The request travels through the lock's own server: whoever may
/// connect to it with these credentials may ask.
#[derive(Debug, Args)]
pub struct StepDownArgs {
    #[command(flatten)]
    pub lock: LockArgs,

    #[command(flatten)]
    pub connection: ConnectionArgs,

    /// How long to wait for another replica to lead. The leader stops its command first, which
    /// may take its --kill-timeout (5s by default): give more than that
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = positive_duration)]
    pub timeout: Duration,

    /// Hand leadership to this replica (a host, or a session name). Refused: the servers grant
    /// a released lock to whoever waits first, and pgleader cannot steer it to one replica
    /// without stopping the others from waiting, so it is never done at the risk of running the
    /// command twice
    #[arg(long, value_name = "REPLICA")]
    pub to: Option<String>,
}

fn non_empty_name(value: &str) -> Result<String, String> {
    if value.is_empty() {
        Err("the lock name must not be empty".into())
    } else {
        Ok(value.to_owned())
    }
}

/// A hook's or a probe's shell command line: anything but blank.
fn shell_line(value: &str) -> Result<String, String> {
    if value.trim().is_empty() {
        Err("a shell command line must not be empty".into())
    } else {
        Ok(value.to_owned())
    }
}

/// A humantime duration such as `500ms`, `10s`, `1m 30s`.
pub fn duration(value: &str) -> Result<Duration, String> {
    humantime::parse_duration(value.trim())
        .map_err(|err| format!("{err} (expected a duration such as 500ms, 10s or 1m)"))
}

/// The most `--keep-output` keeps of a run's output.
pub const MOST_OUTPUT_KEPT: u32 = 64 * 1024;

/// `--keep-output`: bytes, or KiB with that suffix (`K` too), up to [`MOST_OUTPUT_KEPT`].
fn output_size(value: &str) -> Result<u32, String> {
    let value = value.trim();
    let (number, unit) = match value.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => value.split_at(at),
        None => (value, ""),
    };
    let unit = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1024,
        _ => {
            return Err(format!(
                "{value:?} is not a size (expected bytes, or KiB such as 4KiB)"
            ));
        }
    };
    let size = number
        .parse::<u32>()
        .ok()
        .and_then(|n| n.checked_mul(unit))
        .filter(|size| *size <= MOST_OUTPUT_KEPT)
        .ok_or_else(|| format!("{value:?} is out of range: at most 64KiB"))?;
    Ok(size)
}

/// `--restart-fence`: computed from the other timings, or given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestartFence {
    Auto,
    Fixed(Duration),
}

fn auto_or_duration(value: &str) -> Result<RestartFence, String> {
    if value.trim().eq_ignore_ascii_case("auto") {
        Ok(RestartFence::Auto)
    } else {
        duration(value).map(RestartFence::Fixed)
    }
}

fn positive_duration(value: &str) -> Result<Duration, String> {
    match duration(value)? {
        Duration::ZERO => Err("must be greater than 0".into()),
        positive => Ok(positive),
    }
}

/// `--wait-refresh`: 0, or often enough to matter and not so often that the server does little
/// else for the followers.
fn wait_refresh(value: &str) -> Result<Duration, String> {
    match duration(value)? {
        refresh if !refresh.is_zero() && refresh < MIN_WAIT_REFRESH => Err(format!(
            "must be 0 or at least {}",
            humantime::format_duration(MIN_WAIT_REFRESH)
        )),
        refresh => Ok(refresh),
    }
}

/// The shortest `--wait-refresh`: ten turns a second for each waiting replica.
const MIN_WAIT_REFRESH: Duration = Duration::from_millis(100);

/// A cron expression with five fields, or six with seconds first; it must match some time in
/// the future.
fn parse_schedule(value: &str) -> Result<croner::Cron, String> {
    let schedule = croner::parser::CronParser::builder()
        .seconds(croner::parser::Seconds::Optional)
        .build()
        .parse(value.trim())
        .map_err(|err| format!("{err} (expected a cron expression such as \"0 0 * * *\")"))?;
    schedule
        .find_next_occurrence(&jiff::Zoned::now(), false)
        .map_err(|_| "this schedule never matches a future time".to_owned())?;
    Ok(schedule)
}

/// An address and port to listen on: `127.0.0.1:9187`, `0.0.0.0:9187`, `[::]:9187`.
fn http_address(value: &str) -> Result<SocketAddr, String> {
    value.trim().parse().map_err(|_| {
        "expected an IP address and a port, such as 127.0.0.1:9187, 0.0.0.0:9187 or [::]:9187"
            .to_owned()
    })
}

/// `TERM`, `SIGTERM`, `sigterm` or `15`.
pub fn parse_signal(value: &str) -> Result<Signal, String> {
    let value = value.trim();
    if let Ok(number) = value.parse::<i32>() {
        return Signal::try_from(number).map_err(|_| format!("{number} is not a signal number"));
    }
    let upper = value.to_ascii_uppercase();
    let name = if upper.starts_with("SIG") {
        upper
    } else {
        format!("SIG{upper}")
    };
    name.parse::<Signal>().map_err(|_| {
        format!("unknown signal {value:?} (expected a name such as TERM or INT, or a number)")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_definitions_are_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn signals_are_accepted_by_name_and_number() {
        for text in ["TERM", "SIGTERM", "sigterm", "15", " term "] {
            assert_eq!(parse_signal(text), Ok(Signal::SIGTERM), "{text}");
        }
        assert_eq!(parse_signal("int"), Ok(Signal::SIGINT));
        assert!(parse_signal("NOPE").is_err());
        assert!(parse_signal("99").is_err());
    }

    #[test]
    fn schedules_take_five_or_six_fields() {
        assert!(parse_schedule("0 0 * * *").is_ok());
        assert!(parse_schedule("*/5 * * * * *").is_ok());
        assert!(parse_schedule("every day").is_err());
        assert!(
            parse_schedule("0 0 30 2 *").is_err(),
            "February 30th never comes"
        );
    }

    #[test]
    fn http_addresses_need_an_ip_and_a_port() {
        assert_eq!(
            http_address("127.0.0.1:9187"),
            Ok("127.0.0.1:9187".parse().expect("address"))
        );
        assert!(http_address("[::]:9187").is_ok());
        assert!(http_address("0.0.0.0:0").is_ok());
        for bad in ["9187", "localhost:9187", "127.0.0.1", "127.0.0.1:99999", ""] {
            assert!(http_address(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn durations_use_humantime() {
        assert_eq!(duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(duration("0"), Ok(Duration::ZERO));
        assert!(positive_duration("0s").is_err());
        assert!(duration("ten seconds").is_err());
    }
}
