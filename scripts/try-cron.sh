# shellcheck shell=bash
# scripts/try --cron: a small supercronic-style crontab on three replicas of `pgleader cron`.
# Sourced by scripts/try once its server is up; it uses the script's say, wait_for, dir,
# binary, connection and replicas (which its cleanup stops).

CRON_LOCK=try-cron

# The new lines of replica N's log worth showing (the jobs' tagged lines and the replica's
# hand-overs), indented; each line once.
declare -A cron_shown=([1]=0 [2]=0 [3]=0)
cron_show() {
    local n=$1
    tail -n +"$((cron_shown[$n] + 1))" "$dir/replica-$n.log" |
        grep -E 'stream=std|took job|shutting down|draining|released job' |
        sed "s/^/    replica $n | /" || true
    cron_shown[$n]=$(wc -l <"$dir/replica-$n.log")
}

# The replica (1 to 3) that owns job JOB, as pgleader status says.
cron_owner() {
    local job=$1 pid n
    pid=$(pgleader status --lock "$CRON_LOCK" |
        sed -n "s/^  job $job: .*owner pgleader \([0-9]*\)@.*/\1/p")
    for n in 1 2 3; do
        if [ "${replicas[n]:-}" = "$pid" ]; then
            echo "$n"
            return 0
        fi
    done
    return 1
}

# The latest occurrence of job JOB in the logs of the replicas N...
cron_latest() {
    local job=$1 n files=()
    shift
    for n in "$@"; do files+=("$dir/replica-$n.log"); done
    grep -h " job=$job stream=" "${files[@]}" | sed -n 's/.* occurrence=\([^ ]*\) .*/\1/p' |
        sort | tail -n 1
}

# Waits until every job of the crontab ran and each of the replicas in "$@" ran one.
cron_wait_spread() {
    local deadline=$((SECONDS + WAIT)) n job ok
    while :; do
        ok=yes
        for n in "$@"; do
            grep -q 'stream=std' "$dir/replica-$n.log" || ok=
        done
        for job in hello report tidy backup; do
            grep -qh " job=$job stream=" "$dir"/replica-*.log || ok=
        done
        [ -n "$ok" ] && return 0
        if [ $SECONDS -ge $deadline ]; then
            say "the jobs did not spread over replicas $* within $WAIT s"
            for n in 1 2 3; do cron_show "$n"; done
            exit 1
        fi
        sleep 0.1
    done
}

try_cron() {
    local crontab=$dir/crontab n job owner victim term survivor since line
    cat >"$crontab" <<'CRONTAB'
# every 2 seconds, as supercronic reads seven fields (seconds first, year last)
# pgleader: name=hello
*/2 * * * * * * echo "hello from $PGLEADER_JOB"
# pgleader: name=report
*/3 * * * * * * echo "a report"; echo "a warning on stderr" >&2
# pgleader: name=tidy
*/2 * * * * * * echo "tidied"
# pgleader: name=backup
*/6 * * * * * * echo "backup: started"; sleep 3; echo "backup: finished"
CRONTAB
    say "a crontab of four jobs, as supercronic reads it ($crontab):"
    sed 's/^/    /' "$crontab"
    say "three replicas, each run as"
    echo "    $shown \\"
    echo "    pgleader cron --lock $CRON_LOCK $crontab"
    for n in 1 2 3; do
        setsid env PGLEADER_TRY="$dir" "${connection[@]}" \
            "$binary" cron --lock "$CRON_LOCK" "$crontab" >"$dir/replica-$n.log" 2>&1 3>&- 4>&- &
        replicas[n]=$!
    done
    cron_wait_spread 1 2 3
    # A moment for the spread to show in a line or two of each job.
    sleep 2
    say "each job's lines, tagged with its job, the occurrence and the replica that ran it:"
    for n in 1 2 3; do cron_show "$n"; done

    say "pgleader status --lock $CRON_LOCK"
    pgleader status --lock "$CRON_LOCK" | sed 's/^/    /'

    # The victim: a replica that does not run the backup, so that the TERM below finds one.
    owner=$(cron_owner backup || true)
    for n in 1 2 3; do
        if [ "$n" != "$owner" ] && grep -q 'stream=std' "$dir/replica-$n.log"; then
            victim=$n
            break
        fi
    done
    say "kill -9 ${replicas[victim]} (replica $victim)"
    since=$(date -u +%Y-%m-%dT%H:%M:%SZ)
    kill -KILL "${replicas[victim]}"
    wait "${replicas[victim]}" 2>/dev/null || true
    unset "replicas[victim]"
    local left=()
    for n in 1 2 3; do [ "$n" = "$victim" ] || left+=("$n"); done
    # Every job runs again after the kill, on the replicas left.
    local deadline=$((SECONDS + WAIT))
    for job in hello report tidy; do
        until [[ "$(cron_latest "$job" "${left[@]}")" > "$since" ]]; do
            if [ $SECONDS -ge $deadline ]; then
                say "job $job did not run again within $WAIT s of the kill"
                for n in "${left[@]}"; do cron_show "$n"; done
                exit 1
            fi
            sleep 0.05
        done
    done
    say "the next occurrences ran on the replicas left, on time (each line's time against its occurrence):"
    for n in "${left[@]}"; do cron_show "$n"; done

    # A TERM while the backup runs: it finishes, with no signal, before the replica exits.
    term=$(cron_owner backup || true)
    for n in "${left[@]}"; do [ "$n" = "$term" ] || survivor=$n; done
    local runs
    runs=$(grep -c 'backup: started' "$dir/replica-$term.log" || true)
    wait_for_count "$dir/replica-$term.log" 'backup: started' "$((runs + 1))"
    say "kill -TERM ${replicas[term]} (replica $term) while its backup runs: it drains"
    kill -TERM "${replicas[term]}"
    local code=0
    wait "${replicas[term]}" || code=$?
    unset "replicas[term]"
    cron_show "$term"
    if [ "$code" != 0 ] || ! tail -n 20 "$dir/replica-$term.log" | grep -q 'backup: finished'; then
        say "replica $term exited $code, its backup not finished:"
        cat "$dir/replica-$term.log" >&2
        exit 1
    fi
    say "replica $term exited 0 once its backup had finished; the jobs run on replica $survivor:"
    runs=$(grep -c 'backup: started' "$dir/replica-$survivor.log" || true)
    wait_for_count "$dir/replica-$survivor.log" 'backup: started' "$((runs + 1))"
    cron_show "$survivor"

    say "pgleader status --lock $CRON_LOCK"
    pgleader status --lock "$CRON_LOCK" | sed 's/^/    /'
    say "took $((($(date +%s%N) - started) / 1000000000)) s after the build, before stopping"
}

# Waits until FILE has COUNT lines holding TEXT; fails after $WAIT seconds.
wait_for_count() {
    local file=$1 text=$2 count=$3 deadline=$((SECONDS + WAIT))
    until [ "$(grep -c "$text" "$file" || true)" -ge "$count" ]; do
        if [ $SECONDS -ge $deadline ]; then
            say "no $count lines of '$text' in $file within $WAIT s:"
            cat "$file" >&2
            exit 1
        fi
        sleep 0.05
    done
}
