//! Every process a test starts (PostgreSQL, pgleader) is spawned from one thread that lives as
//! long as the test binary, with a parent-death signal: if the test binary dies (a panic that
//! aborts, a timeout kill), nothing it started lives on. A parent-death signal follows the
//! spawning *thread*, which is why test threads (which end with their test) must not spawn.

use std::io;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Mutex, OnceLock};

use nix::sys::signal::Signal;

type Request = (Command, Signal, Sender<io::Result<Child>>);

fn spawner() -> &'static Mutex<Sender<Request>> {
    static SPAWNER: OnceLock<Mutex<Sender<Request>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = channel::<Request>();
        std::thread::Builder::new()
            .name("spawner".into())
            .spawn(move || {
                for (mut command, death_signal, reply) in rx {
                    // SAFETY: prctl is async-signal-safe and allocates nothing.
                    unsafe {
                        command.pre_exec(move || {
                            nix::sys::prctl::set_pdeathsig(death_signal)?;
                            Ok(())
                        });
                    }
                    let _ = reply.send(command.spawn());
                }
                // The sender lives in a static and is never dropped: keep the thread alive.
                loop {
                    std::thread::park();
                }
            })
            .expect("start the spawner thread");
        Mutex::new(tx)
    })
}

/// Spawns `command` so that it gets `death_signal` when the test binary exits.
pub fn spawn(command: Command, death_signal: Signal) -> io::Result<Child> {
    let (tx, rx) = channel();
    spawner()
        .lock()
        .expect("spawner lock")
        .send((command, death_signal, tx))
        .expect("spawner thread alive");
    rx.recv().expect("spawner reply")
}
