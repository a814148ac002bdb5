#!/bin/sh
# Stands in for the real job: work that must never run on two replicas at once. pgleader
# starts it on the replica that holds the lock and stops it (TERM) when that replica stops
# leading. PGLEADER_EPOCH is the fencing token to hand to whatever the job writes to.
set -eu
trap 'echo "nightly-report: stopping (epoch $PGLEADER_EPOCH)"; exit 0' TERM INT
echo "nightly-report: leading (lock $PGLEADER_LOCK_NAME, epoch $PGLEADER_EPOCH)"
while :; do
    echo "nightly-report: working"
    # In the background and waited for, so that TERM is handled at once, not after the sleep.
    sleep 10 &
    wait $!
done
