//! How the keeper starts the command: a child that borrows the keeper's memory until it
//! executes (`clone` with `CLONE_VM | CLONE_VFORK`, what `posix_spawn` does inside glibc),
//! given a parent-death signal on the way, which `posix_spawn` has no attribute for.
//!
//! Starting the command is on the way from winning the lock to the command running. A plain
//! `fork` copies the keeper's page tables, and the child's `execve` then tears that copy down
//! again; a child that shares the keeper's memory does neither, and the keeper, suspended until
//! the child has executed (or failed to), knows the outcome without a pipe. The price is that
//! the child, until `execve`, must not touch what the keeper owns: everything it needs (the
//! path, the argument and environment arrays) is built before the clone, and the child makes
//! only system calls.

use std::ffi::{CString, OsStr, OsString, c_char, c_int, c_void};
use std::io;
use std::mem::MaybeUninit;
use std::os::unix::ffi::OsStrExt;
use std::ptr;
use std::sync::atomic::{AtomicI32, Ordering};

use nix::errno::Errno;
use nix::sys::wait::waitpid;
use nix::unistd::Pid;

/// The child's own stack: it makes a handful of system calls through libc, nothing deeper.
/// Left uninitialised (the child writes before it reads), so that only the few pages it
/// touches become resident: zeroed, it was 64 kB of every keeper's memory, parked or not.
const CHILD_STACK: usize = 64 * 1024;

/// A command ready to be executed: what the child reads, built in the keeper beforehand (while
/// it is parked, all but the environment pgleader adds at the start).
#[derive(Debug)]
pub struct Prepared {
    program: CString,
    // `argv_ptrs` points into `_argv`, `envp_ptrs` into `base_env` and `added_env`: they must
    // live as long as the arrays do.
    _argv: Vec<CString>,
    argv_ptrs: Vec<*const c_char>,
    /// The keeper's own environment, `KEY=VALUE`.
    base_env: Vec<CString>,
    added_env: Vec<CString>,
    envp_ptrs: Vec<*const c_char>,
    stack: Box<[MaybeUninit<u8>]>,
    /// The keeper, which must still be the child's parent once its death signal is set.
    parent: libc::pid_t,
    /// The descriptors the command gets as its stdout and stderr, if not the keeper's own.
    output: Option<[c_int; 2]>,
    /// Set by the child when it could not execute the command.
    errno: AtomicI32,
    /// Whether the command leads a session of its own (see [`Prepared::leading_a_session`]).
    own_session: bool,
    /// The limit of open files the command gets, where the keeper raised its own.
    open_files: Option<libc::rlimit>,
}

impl Prepared {
    /// `program`, to be executed with `argv` (its `argv[0]` first) and the keeper's
    /// environment.
    pub fn new(program: &OsStr, argv: &[OsString]) -> io::Result<Self> {
        let argv = argv
            .iter()
            .map(|arg| c_string(arg.as_bytes().to_vec()))
            .collect::<io::Result<Vec<_>>>()?;
        let base_env = std::env::vars_os()
            .map(|(key, value)| entry(&key, &value))
            .collect::<io::Result<Vec<_>>>()?;
        Ok(Prepared {
            program: c_string(program.as_bytes().to_vec())?,
            argv_ptrs: pointers(argv.iter()),
            _argv: argv,
            base_env,
            added_env: Vec::new(),
            envp_ptrs: Vec::new(),
            stack: Box::new_uninit_slice(CHILD_STACK),
            parent: std::process::id() as libc::pid_t,
            output: None,
            errno: AtomicI32::new(0),
            own_session: false,
            open_files: None,
        })
    }

    /// The command will lead a session (and process group) of its own, `setsid` in the child:
    /// a session's keeper runs many commands, and tells their descendants apart by their
    /// session (`session.rs`).
    pub fn leading_a_session(mut self) -> Self {
        self.own_session = true;
        self
    }

    /// The command will have `limit` as its limit of open files (`RLIMIT_NOFILE`): the one
    /// pgleader had, where a session's keeper raised its own for its many runs' descriptors.
    pub fn with_open_files(mut self, limit: Option<libc::rlimit>) -> Self {
        self.open_files = limit;
        self
    }

    /// Starts the command with `env` added to the environment (replacing the keeper's entries
    /// of the same names), and `output` as its stdout and stderr if given; returns once it has
    /// been executed, with its pid, or with the errno of `execve` (the failed child reaped).
    /// The child, between the clone and `execve`:
    /// - leads a session of its own, if asked to, and gets its limit of open files back;
    /// - sets SIGPIPE back to its default (Rust ignores it, and an ignored signal stays
    ///   ignored across `execve`);
    /// - puts `output` on its descriptors 1 and 2;
    /// - asks for SIGKILL when the keeper dies, and gives up if the keeper is gone already;
    /// - unblocks every signal (the keeper blocks them all), last, so that no signal is acted
    ///   on before the command's own code runs.
    pub fn spawn(
        &mut self,
        env: &[(OsString, OsString)],
        output: Option<[c_int; 2]>,
    ) -> Result<Pid, Errno> {
        self.output = output;
        self.added_env = env
            .iter()
            .map(|(key, value)| entry(key, value))
            .collect::<io::Result<Vec<_>>>()
            .map_err(|_| Errno::EINVAL)?;
        let replaced = |line: &&CString| {
            env.iter().any(|(key, _)| {
                let line = line.as_bytes();
                line.len() > key.len()
                    && line.starts_with(key.as_bytes())
                    && line[key.len()] == b'='
            })
        };
        self.envp_ptrs = pointers(
            self.base_env
                .iter()
                .filter(|line| !replaced(line))
                .chain(&self.added_env),
        );
        // SAFETY: the stack's top, rounded down to the 16 bytes the ABI asks for, lies inside
        // the allocation, which outlives the child's use of it: with CLONE_VFORK this thread
        // resumes only once the child has executed or exited.
        let top = unsafe {
            let end = self.stack.as_mut_ptr().add(self.stack.len());
            end.sub(end as usize % 16)
        };
        // SAFETY: `run_child` only reads `self` (and stores into its atomic) and makes
        // async-signal-safe system calls on its own stack; this thread is suspended until the
        // child has executed or exited (CLONE_VFORK), so nothing changes `self` meanwhile.
        let pid = unsafe {
            libc::clone(
                run_child,
                top.cast::<c_void>(),
                libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
                ptr::from_ref(&*self).cast_mut().cast::<c_void>(),
            )
        };
        let pid = Pid::from_raw(Errno::result(pid)?);
        match self.errno.load(Ordering::Acquire) {
            0 => Ok(pid),
            errno => {
                let _ = waitpid(pid, None);
                Err(Errno::from_raw(errno))
            }
        }
    }
}

/// A null-terminated array of pointers to `strings`.
fn pointers<'a>(strings: impl Iterator<Item = &'a CString>) -> Vec<*const c_char> {
    strings
        .map(|s| s.as_ptr())
        .chain(std::iter::once(ptr::null()))
        .collect()
}

fn c_string(bytes: Vec<u8>) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| io::Error::from(Errno::EINVAL))
}

/// `KEY=VALUE`, for the environment array.
fn entry(key: &OsStr, value: &OsStr) -> io::Result<CString> {
    let mut bytes = Vec::with_capacity(key.len() + value.len() + 1);
    bytes.extend_from_slice(key.as_bytes());
    bytes.push(b'=');
    bytes.extend_from_slice(value.as_bytes());
    c_string(bytes)
}

/// The child's side, on its own stack in the keeper's memory. Returns only on failure, with
/// the child's exit status.
extern "C" fn run_child(data: *mut c_void) -> c_int {
    // SAFETY: `data` is the `Prepared` that `spawn` passed, alive and unchanged while the
    // keeper waits for this child.
    let prepared = unsafe { &*data.cast::<Prepared>() };
    let fail = |errno: c_int| -> c_int {
        prepared.errno.store(errno.max(1), Ordering::Release);
        127
    };
    // SAFETY: plain system calls on values built beforehand; nothing here allocates, takes a
    // lock or unwinds.
    unsafe {
        if prepared.own_session && libc::setsid() == -1 {
            return fail(*libc::__errno_location());
        }
        if let Some(limit) = &prepared.open_files
            && libc::setrlimit(libc::RLIMIT_NOFILE, limit) != 0
        {
            return fail(*libc::__errno_location());
        }
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        if let Some([stdout, stderr]) = prepared.output
            && (libc::dup2(stdout, 1) == -1 || libc::dup2(stderr, 2) == -1)
        {
            return fail(*libc::__errno_location());
        }
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
            return fail(*libc::__errno_location());
        }
        // The keeper died before the death signal was set: nobody would deliver it.
        if libc::getppid() != prepared.parent {
            return fail(libc::ESRCH);
        }
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, ptr::null_mut());
        libc::execve(
            prepared.program.as_ptr(),
            prepared.argv_ptrs.as_ptr(),
            prepared.envp_ptrs.as_ptr(),
        );
        fail(*libc::__errno_location())
    }
}

#[cfg(test)]
mod tests {
    use nix::sys::wait::WaitStatus;

    use super::*;

    #[test]
    fn a_missing_program_reports_enoent() {
        let mut prepared = Prepared::new(
            OsStr::new("/nonexistent/pgleader-test"),
            &[OsString::from("x")],
        )
        .expect("prepared");
        assert_eq!(prepared.spawn(&[], None), Err(Errno::ENOENT));
    }

    #[test]
    fn the_command_gets_its_argv0_arguments_and_added_environment() {
        let dir = std::env::temp_dir().join(format!("pgleader-spawn-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let out = dir.join("out");
        let script = format!(
            "echo \"$0 $1 $PGLEADER_SPAWN_TEST $HOME $(env | grep -c ^HOME=)\" > {}",
            out.display()
        );
        let mut prepared = Prepared::new(
            OsStr::new("/bin/sh"),
            &[
                OsString::from("sh"),
                OsString::from("-c"),
                OsString::from(script),
                OsString::from("named"),
                OsString::from("first"),
            ],
        )
        .expect("prepared");
        let added = [
            (
                OsString::from("PGLEADER_SPAWN_TEST"),
                OsString::from("added"),
            ),
            (OsString::from("HOME"), OsString::from("/replaced")),
        ];
        let pid = prepared.spawn(&added, None).expect("spawned");
        assert_eq!(waitpid(pid, None), Ok(WaitStatus::Exited(pid, 0)));
        let written = std::fs::read_to_string(&out).expect("output");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(written, "named first added /replaced 1\n");
    }
}
