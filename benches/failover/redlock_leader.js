// The benchmark's Redlock peer: "run this on one replica only" with npm `redlock` over several
// Redis servers, as a user of that library writes it today. Only the library's public calls
// are used (`using`, its automatic extension, and the AbortSignal it hands the routine); the
// loop around them is the benchmark's own (see benches/failover/redlock.rs).
//
//     node redlock_leader.js "URL1 URL2 URL3" KEY TTL_SECONDS -- COMMAND...
//
// - Waits by calling `redlock.using([KEY], TTL, routine)` again and again: each call tries the
//   acquire script on every server up to 11 times (retryCount 10, retryDelay 200 ms with
//   100 ms of jitter, its defaults), then gives up with an ExecutionError.
// - Runs COMMAND inside the routine. `using` extends the key 500 ms before its validity ends
//   (automaticExtensionThreshold, its default); when an extension has failed on a majority
//   until the validity is over, it aborts the routine's signal, and the routine stops COMMAND
//   (SIGTERM) and exits 1: more than the library does on its own.
// - On SIGTERM it stops COMMAND; `using` then releases the key, and it exits 0. When COMMAND
//   exits, `using` releases the key and it exits with COMMAND's status.
// - After a `kill -9` nothing acts: COMMAND runs on and the key stays until its TTL.
// - The clients are ioredis' with its defaults (no command timeout, an offline queue that holds
//   commands while it reconnects), as the redlock README creates them.

"use strict";

const { spawn } = require("child_process");
const Client = require("ioredis");
const Redlock = require("redlock").default;
const { ExecutionError, ResourceLockedError } = require("redlock");

const separator = process.argv.indexOf("--");
const [urls, key, ttlSeconds] = process.argv.slice(2, separator);
const command = process.argv.slice(separator + 1);
const ttl = Math.round(Number(ttlSeconds) * 1000);

// Each connection is named `KEY:PID`, so that the benchmark can count the candidates.
const clients = urls
  .split(" ")
  .map((url) => new Client(url, { connectionName: `${key}:${process.pid}` }));
// ioredis reports a lost server as an "error" event; unheard, it prints each one.
for (const client of clients) {
  client.on("error", () => {});
}
const redlock = new Redlock(clients);
// The redlock README's listener: a refused vote is an "error" event, and an EventEmitter
// without a listener for "error" throws.
redlock.on("error", (error) => {
  if (!(error instanceof ResourceLockedError)) {
    console.error(`redlock_leader: ${error.message}`);
  }
});

let child = null;
let stopping = false;

function stopChild() {
  if (child !== null && child.exitCode === null && child.signalCode === null) {
    child.kill("SIGTERM");
  }
}

process.on("SIGTERM", () => {
  stopping = true;
  if (child === null) {
    process.exit(0);
  }
  stopChild();
});

async function main() {
  let status = null;
  while (status === null && !stopping) {
    let led = false;
    try {
      status = await redlock.using([key], ttl, async (signal) => {
        led = true;
        child = spawn(command[0], command.slice(1), { stdio: "inherit" });
        const exited = new Promise((resolve) => {
          child.on("exit", (code) => resolve(code === null ? 1 : code));
        });
        let lost = false;
        signal.addEventListener("abort", () => {
          lost = true;
          console.error(`redlock_leader: lost the lock (${signal.error}): stopping the command`);
          stopChild();
        });
        const code = await exited;
        if (lost) {
          return 1;
        }
        return stopping ? 0 : code;
      });
    } catch (error) {
      // Not acquired within the retry window: try again, as a waiting replica must.
      if (!led && error instanceof ExecutionError) {
        continue;
      }
      // Led, but the release at the end failed (a lost majority): the command is stopped.
      console.error(`redlock_leader: ${error.message}`);
      status = led ? 1 : 2;
    }
  }
  process.exit(status === null ? 0 : status);
}

main();
