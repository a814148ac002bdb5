"""The benchmark's Redis peer: "run this on one replica only" with redis-py's `Lock`, as a user
of that library writes it today. Only the library's public calls are used; the loop around
them is the benchmark's own (see benches/failover/redis_lock.rs).

    python3 redis_py_leader.py URL KEY TTL_SECONDS -- COMMAND...

- Waits in `Lock.acquire()`: redis-py tries `SET KEY TOKEN NX PX TTL` every `sleep` seconds
  (0.1, its default) until the key is free.
- Runs COMMAND, then every TTL/3 extends the key with `Lock.extend` (compares the token, then
  sets the TTL: a key that vanished is not re-created). When an extension fails, it stops
  COMMAND (SIGTERM) and exits 1: more than the library does on its own.
- On SIGTERM it stops COMMAND, releases the key and exits 0; when COMMAND exits, it releases
  the key and exits with COMMAND's status.
- After a `kill -9` nothing acts: COMMAND runs on and the key stays until its TTL.
"""

import os
import signal
import subprocess
import sys
import time

import redis


def main():
    separator = sys.argv.index("--")
    url, key, ttl = sys.argv[1:separator]
    ttl = float(ttl)
    command = sys.argv[separator + 1 :]
    client = redis.Redis.from_url(url, client_name=f"{key}:{os.getpid()}")
    lock = client.lock(key, timeout=ttl, sleep=0.1, thread_local=False)
    child = None

    def stop_child():
        if child is not None and child.poll() is None:
            child.terminate()
            child.wait()

    def release():
        try:
            lock.release()
        except redis.RedisError:
            pass

    def on_term(_signum, _frame):
        stop_child()
        if child is not None:
            release()
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    lock.acquire(blocking=True)
    child = subprocess.Popen(command)
    while True:
        # A sleep, not child.wait(timeout=...), which polls every few milliseconds.
        time.sleep(ttl / 3)
        status = child.poll()
        if status is not None:
            release()
            sys.exit(status)
        try:
            lock.extend(ttl, replace_ttl=True)
        except redis.RedisError as err:
            print(f"redis_py_leader: lost the lock ({err}): stopping the command", file=sys.stderr)
            stop_child()
            sys.exit(1)


if __name__ == "__main__":
    main()
