# Print an optspec for argparse to handle cmd's options that are independent of any subcommand.
function __fish_pgleader_global_optspecs
    string join \n log-format= v/verbose q/quiet h/help V/version
end

function __fish_pgleader_needs_command
    # Figure out if the current invocation already has a command.
    set -l cmd (commandline -opc)
    set -e cmd[1]
    argparse -s (__fish_pgleader_global_optspecs) -- $cmd 2>/dev/null
    or return
    if set -q argv[1]
        # Also print the command, so this can be used to figure out what it is.
        echo $argv[1]
        return 1
    end
    return 0
end

function __fish_pgleader_using_subcommand
    set -l cmd (__fish_pgleader_needs_command)
    test -z "$cmd"
    and return 1
    contains -- $cmd[1] $argv
end

complete -c pgleader -n "__fish_pgleader_needs_command" -l log-format -d 'Log format: one line of text per event, or one JSON object per line' -r -f -a "text\t''
json\t''"
complete -c pgleader -n "__fish_pgleader_needs_command" -s v -l verbose -d 'Log more: -v adds debug details (every check, every reaped process), -vv everything'
complete -c pgleader -n "__fish_pgleader_needs_command" -s q -l quiet -d 'Log less: -q only warnings and errors, -qq only errors'
complete -c pgleader -n "__fish_pgleader_needs_command" -s h -l help -d 'Print help (see more with \'--help\')'
complete -c pgleader -n "__fish_pgleader_needs_command" -s V -l version -d 'Print version'
complete -c pgleader -n "__fish_pgleader_needs_command" -f -a "run" -d 'Run a command while, and only while, this instance holds the lock'
complete -c pgleader -n "__fish_pgleader_needs_command" -f -a "status" -d 'Show who holds the lock and who waits for it (sharded: who holds which shard)'
complete -c pgleader -n "__fish_pgleader_needs_command" -f -a "step-down" -d 'Ask the leader to stop its command gracefully, release the lock and stay on as a follower, so that the next waiting replica takes over; print who led and who leads now'
complete -c pgleader -n "__fish_pgleader_needs_command" -f -a "cron" -d 'Read a crontab (as supercronic and cron read it) for running across the fleet, each occurrence of each job once; so far, --check it: running it is not built yet'
complete -c pgleader -n "__fish_pgleader_needs_command" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l lock-id -d 'The lock\'s key: a signed 64-bit integer, as pg_advisory_lock(bigint) takes it (on Redis: the key pgleader:{ID}) [env: PGLEADER_LOCK_ID]' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l lock -d 'The lock\'s name, hashed to a key with PostgreSQL\'s hashtextextended(NAME, 0) (on Redis: the key pgleader:{NAME}) [env: PGLEADER_LOCK]' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -s d -l database-url -d 'The server: a postgres:// URL or key=value pairs (default: $DATABASE_URL, else the PG* variables and psql\'s defaults; passwords are best kept in ~/.pgpass), or a Redis server: redis://[USER[:PASSWORD]@]HOST[:PORT][/DB], rediss:// for TLS (?cacert=FILE names a CA; the password may come from $REDISCLI_AUTH). Given three or more times with Redis URLs (in PGLEADER_DATABASE_URL: separated by spaces), a Redlock quorum of independent servers' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l busy-exit-code -d 'Exit code of --no-wait when the lock is busy (0 so that cron mails no failure from every non-leader)' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l check-interval -d 'How often the leader confirms on its session that it still holds the lock' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l check-timeout -d 'How long a confirmation may take before leadership counts as lost' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l kill-signal -d 'Signal sent to the command\'s process group to stop it when leadership is lost or the command is restarted (TERM, SIGTERM or 15). On shutdown, the signal pgleader received is passed on instead' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l kill-timeout -d 'How long the command may take to exit after the stop signal before its process group is sent SIGKILL. 0 sends SIGKILL at once' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l restart-delay -d 'Without --once: after the command exits on its own, release the lock and wait this long before entering the election again, so another replica can take its turn. 0 re-enters at once' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l lease -d 'How long the server keeps the lock of a leader it no longer hears from (silent network partition, frozen host). Must exceed --check-interval + --check-timeout + --kill-timeout by at least 1s, so that the old command is gone before anyone else can win. On Redis it is the key\'s TTL, and must also allow for the server\'s clock running 1% fast' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l takeover-delay -d 'After winning the lock, wait this long before starting the command: a fence for the case where an administrator or a server restart ends the old leader\'s session while its command still runs. 0 starts at once' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l relinquish-after -d 'After leading this long, stop the command gracefully, release the lock and let the next waiting replica lead: a planned handoff. A lone replica leads again at once' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l relinquish-schedule -d 'Hand leadership over at the times of this cron expression, in local time ("0 0 * * *": daily at midnight; an optional sixth, leading field gives seconds). Otherwise like --relinquish-after' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l schedule -d 'Run the command at the times of this cron expression instead of at once: five fields ("0 3 * * *": daily at 03:00), six with seconds first, or @hourly, @daily, @weekly, @monthly, @yearly. Each occurrence runs at most once across all replicas, on the database server\'s clock; the leader keeps the lock between runs. With --once: run the occurrence this timer fired for, unless a replica already claimed it' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l schedule-timezone -d 'The time zone --schedule is read in: an IANA name such as Europe/Paris. Every replica of a lock must use the same' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l catch-up -d 'Run an occurrence that came while no leader could run it (the fleet or the database down, a failover) if it is at most this old; only the most recent one, never a backlog. Older ones are recorded as missed. 0 runs only occurrences a leader was waiting for' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l retry-interrupted -d 'How many times an occurrence whose run was interrupted (its leader lost the lock or was shut down) is started again by the next leader. 0: never, so no occurrence starts twice' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l ledger-table -d 'PostgreSQL: the table that records each scheduled occurrence (created when missing), optionally with its schema: ops.pgleader_ledger [default: pgleader_ledger]. On Redis the ledger lives in the lock\'s own keys, and this option is refused' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l shards -d 'PostgreSQL or one Redis server: run K numbered instances of the command across the replicas of this lock, each exactly once, shared out evenly among the replicas that run (a replica over its share stops the surplus and hands it over). Each instance gets PGLEADER_SHARD (0 to K-1) and PGLEADER_SHARDS=K; a command that ignores them runs at most K times across the fleet. Every replica of a lock must give the same K. No environment variable: a shard\'s command is given PGLEADER_SHARDS, and a pgleader it starts must not take it for its own' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l max-shards -d 'With --shards: take at most this many shards on this replica (a small machine); the others share the rest out. Shards that no replica has room for are left unrun' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l health-cmd -d 'Run this shell command line (sh -c, stdin from /dev/null) to check that this replica is fit to lead: at start-up, then --health-interval after each probe ends, in every phase. Exit 0 passes. The replica queues for the lock only after a pass; after --health-retries failures in a row it is unhealthy: a leader stops its command and releases the lock, a follower leaves the queue, and neither queues again until a probe passes (with --shards: it gives up every shard and leaves until then). The probe runs in a process group of its own, never the command\'s; its output is logged when it fails. Not with --no-wait or --schedule --once' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l health-interval -d 'How long after a health probe ends the next one starts' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l health-timeout -d 'How long a health probe may run: then it is killed with everything it started, and counts as failed' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l health-retries -d 'How many health probes in a row must fail for this replica to be unhealthy' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l restart-fence -d 'After winning less than this long after a server restart, crash or failover (which free every lock at once, possibly while the previous leader is still stopping its command), wait until this long has passed before starting the command. auto = --check-interval + --check-timeout + --kill-timeout (+ --hook-timeout with --post-stop) + 1s, the longest a previous leader with the same settings can take. 0 disables' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l wait-refresh -d 'PostgreSQL: a waiting replica queues for the lock again this often, in a new transaction, so that its snapshot never holds back VACUUM or CREATE INDEX CONCURRENTLY in the database for longer. A released lock is still taken at once. 0 waits in one statement, first come first served, holding its snapshot until it wins (for a database of pgleader\'s own). No effect on Redis' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l pre-start -d 'Run this shell command line (sh -c) after winning the lock, before the command starts (attach a floating IP, update a DNS record). If it fails or times out, the command does not start: --post-stop runs, the lock is released, and this replica sits out (1s, doubling up to 1m while it keeps failing). It gets the command\'s environment and PGLEADER_HOOK=pre-start. With --schedule it runs before each run, with --shards before each shard\'s command' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l post-stop -d 'Run this shell command line (sh -c) once the command\'s whole process tree is gone, whatever ended it (its exit, a lost lock, a signal, a handoff, pgleader killed -9), and before the lock is released, so that the next leader\'s --pre-start starts only after it finished (detach the floating IP). It gets the command\'s environment, PGLEADER_HOOK=post-stop and PGLEADER_EXIT_CODE (when the command ran)' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l hook-timeout -d 'How long each hook may run before it is killed with everything it started (a failed --pre-start). With --post-stop, --lease must cover it too: --check-interval + --check-timeout + --kill-timeout + --hook-timeout + 1s (14s with the defaults)' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l http -d 'Serve /leader, /healthz, /status and /metrics (Prometheus) over HTTP on this address and port: 127.0.0.1:9187 for this host only, 0.0.0.0:9187 or [::]:9187 for every interface (port 0: any free port, which the log names). Off unless given' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l log-format -d 'Log format: one line of text per event, or one JSON object per line' -r -f -a "text\t''
json\t''"
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l once -d 'Wait for leadership, run the command once, and exit with its status'
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -l no-wait -d 'Try the lock once: if another instance holds it, exit at once with --busy-exit-code. Implies --once'
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -s v -l verbose -d 'Log more: -v adds debug details (every check, every reaped process), -vv everything'
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -s q -l quiet -d 'Log less: -q only warnings and errors, -qq only errors'
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -s h -l help -d 'Print help'
complete -c pgleader -n "__fish_pgleader_using_subcommand run" -s V -l version -d 'Print version'
complete -c pgleader -n "__fish_pgleader_using_subcommand status" -l lock-id -d 'The lock\'s key: a signed 64-bit integer, as pg_advisory_lock(bigint) takes it (on Redis: the key pgleader:{ID}) [env: PGLEADER_LOCK_ID]' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand status" -l lock -d 'The lock\'s name, hashed to a key with PostgreSQL\'s hashtextextended(NAME, 0) (on Redis: the key pgleader:{NAME}) [env: PGLEADER_LOCK]' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand status" -s d -l database-url -d 'The server: a postgres:// URL or key=value pairs (default: $DATABASE_URL, else the PG* variables and psql\'s defaults; passwords are best kept in ~/.pgpass), or a Redis server: redis://[USER[:PASSWORD]@]HOST[:PORT][/DB], rediss:// for TLS (?cacert=FILE names a CA; the password may come from $REDISCLI_AUTH). Given three or more times with Redis URLs (in PGLEADER_DATABASE_URL: separated by spaces), a Redlock quorum of independent servers' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand status" -l ledger-table -d 'PostgreSQL: the table that records each scheduled occurrence (created when missing), optionally with its schema: ops.pgleader_ledger [default: pgleader_ledger]. On Redis the ledger lives in the lock\'s own keys, and this option is refused' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand status" -l log-format -d 'Log format: one line of text per event, or one JSON object per line' -r -f -a "text\t''
json\t''"
complete -c pgleader -n "__fish_pgleader_using_subcommand status" -l json -d 'Print JSON instead of text'
complete -c pgleader -n "__fish_pgleader_using_subcommand status" -l watch -d 'Keep running: print the lock\'s state again (one line, or one JSON object per line) each time its holder or its waiters change, until interrupted'
complete -c pgleader -n "__fish_pgleader_using_subcommand status" -s v -l verbose -d 'Log more: -v adds debug details (every check, every reaped process), -vv everything'
complete -c pgleader -n "__fish_pgleader_using_subcommand status" -s q -l quiet -d 'Log less: -q only warnings and errors, -qq only errors'
complete -c pgleader -n "__fish_pgleader_using_subcommand status" -s h -l help -d 'Print help'
complete -c pgleader -n "__fish_pgleader_using_subcommand status" -s V -l version -d 'Print version'
complete -c pgleader -n "__fish_pgleader_using_subcommand step-down" -l lock-id -d 'The lock\'s key: a signed 64-bit integer, as pg_advisory_lock(bigint) takes it (on Redis: the key pgleader:{ID}) [env: PGLEADER_LOCK_ID]' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand step-down" -l lock -d 'The lock\'s name, hashed to a key with PostgreSQL\'s hashtextextended(NAME, 0) (on Redis: the key pgleader:{NAME}) [env: PGLEADER_LOCK]' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand step-down" -s d -l database-url -d 'The server: a postgres:// URL or key=value pairs (default: $DATABASE_URL, else the PG* variables and psql\'s defaults; passwords are best kept in ~/.pgpass), or a Redis server: redis://[USER[:PASSWORD]@]HOST[:PORT][/DB], rediss:// for TLS (?cacert=FILE names a CA; the password may come from $REDISCLI_AUTH). Given three or more times with Redis URLs (in PGLEADER_DATABASE_URL: separated by spaces), a Redlock quorum of independent servers' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand step-down" -l timeout -d 'How long to wait for another replica to lead. The leader stops its command first, which may take its --kill-timeout (5s by default): give more than that' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand step-down" -l to -d 'Hand leadership to this replica (a host, or a session name). Refused: the servers grant a released lock to whoever waits first, and pgleader cannot steer it to one replica without stopping the others from waiting, so it is never done at the risk of running the command twice' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand step-down" -l log-format -d 'Log format: one line of text per event, or one JSON object per line' -r -f -a "text\t''
json\t''"
complete -c pgleader -n "__fish_pgleader_using_subcommand step-down" -s v -l verbose -d 'Log more: -v adds debug details (every check, every reaped process), -vv everything'
complete -c pgleader -n "__fish_pgleader_using_subcommand step-down" -s q -l quiet -d 'Log less: -q only warnings and errors, -qq only errors'
complete -c pgleader -n "__fish_pgleader_using_subcommand step-down" -s h -l help -d 'Print help'
complete -c pgleader -n "__fish_pgleader_using_subcommand step-down" -s V -l version -d 'Print version'
complete -c pgleader -n "__fish_pgleader_using_subcommand cron" -l from -d 'With --check: list the occurrences after this instant (RFC 3339, such as 2027-03-27T12:00:00Z) rather than after now' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand cron" -l next -d 'With --check: how many occurrences to list for each job' -r
complete -c pgleader -n "__fish_pgleader_using_subcommand cron" -l log-format -d 'Log format: one line of text per event, or one JSON object per line' -r -f -a "text\t''
json\t''"
complete -c pgleader -n "__fish_pgleader_using_subcommand cron" -l check -d 'Read and check the crontab without connecting; print each job (name, schedule, zone, command, options) with its next occurrences; exit 0, or 2 naming the file, the line and what is wrong'
complete -c pgleader -n "__fish_pgleader_using_subcommand cron" -s v -l verbose -d 'Log more: -v adds debug details (every check, every reaped process), -vv everything'
complete -c pgleader -n "__fish_pgleader_using_subcommand cron" -s q -l quiet -d 'Log less: -q only warnings and errors, -qq only errors'
complete -c pgleader -n "__fish_pgleader_using_subcommand cron" -s h -l help -d 'Print help'
complete -c pgleader -n "__fish_pgleader_using_subcommand cron" -s V -l version -d 'Print version'
complete -c pgleader -n "__fish_pgleader_using_subcommand help; and not __fish_seen_subcommand_from run status step-down cron help" -f -a "run" -d 'Run a command while, and only while, this instance holds the lock'
complete -c pgleader -n "__fish_pgleader_using_subcommand help; and not __fish_seen_subcommand_from run status step-down cron help" -f -a "status" -d 'Show who holds the lock and who waits for it (sharded: who holds which shard)'
complete -c pgleader -n "__fish_pgleader_using_subcommand help; and not __fish_seen_subcommand_from run status step-down cron help" -f -a "step-down" -d 'Ask the leader to stop its command gracefully, release the lock and stay on as a follower, so that the next waiting replica takes over; print who led and who leads now'
complete -c pgleader -n "__fish_pgleader_using_subcommand help; and not __fish_seen_subcommand_from run status step-down cron help" -f -a "cron" -d 'Read a crontab (as supercronic and cron read it) for running across the fleet, each occurrence of each job once; so far, --check it: running it is not built yet'
complete -c pgleader -n "__fish_pgleader_using_subcommand help; and not __fish_seen_subcommand_from run status step-down cron help" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
