//! Running a hook inside the keeper: `--pre-start` where the command will stand, `--post-stop`
//! once its tree is gone, each to its end while the channel and the deadline are watched. What
//! a hook is, its arguments and its output are `supervise/hook.rs`'s, which pgleader shares.

use std::io::Write;
use std::os::fd::AsFd;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::wait::WaitStatus;
use tracing::{info, warn};

use crate::exit::ChildStatus;
use crate::supervise::hook::{self, Ended, Hook};
use crate::supervise::keeper::channel::{Request, read_request, stopping_waits};
use crate::supervise::keeper::protocol::Report;
use crate::supervise::keeper::tree::Tree;
use crate::supervise::watchdog::Step;
use crate::time::for_people;

impl Tree {
    /// Runs `--post-stop`, if set, once the command's tree is gone.
    pub(super) fn run_post_stop(&mut self) {
        let Some(line) = self.hooks.post_stop.clone() else {
            return;
        };
        if let Some(code) = self.main_status {
            self.env
                .push(("PGLEADER_EXIT_CODE".into(), code.to_string().into()));
        }
        self.run_hook(Hook::PostStop, &line);
    }

    /// Runs a hook to its end: its exit, its timeout, or (for `--pre-start`) pgleader's
    /// request to end everything or pgleader's death. A `--post-stop` goes on when pgleader
    /// dies: undoing what the leader did is why it exists. Whatever the hook leaves running
    /// is killed when it ends, so nothing of it is left when this returns.
    pub(super) fn run_hook(&mut self, hook: Hook, line: &str) -> Ended {
        let own_group = hook == Hook::PostStop;
        let mut running = match hook::Running::spawn(hook, line, &self.env, own_group) {
            Ok(running) => running,
            Err(err) => {
                warn!(event = "hook_failed", hook = hook.name(), reason = %err, "cannot run --{hook}");
                return Ended::Failed(ChildStatus::Exited(127));
            }
        };
        self.hook = Some((running.pid, None));
        if hook == Hook::PostStop {
            // pgleader's stop sequence gives the hook its own timeout from here on, and knows
            // its process group (out of the job's) should the keeper itself have to be killed.
            let _ = self
                .channel
                .write_all(&Report::PostStop(running.pid.as_raw()).encode());
        }
        let deadline = running.started + self.hooks.timeout;
        let ended = loop {
            if let Some((_, Some(status))) = self.hook {
                break match status {
                    WaitStatus::Exited(_, 0) => Ended::Passed,
                    WaitStatus::Exited(_, code) => Ended::Failed(ChildStatus::Exited(code)),
                    WaitStatus::Signaled(_, signal, _) => {
                        Ended::Failed(ChildStatus::Signaled(signal))
                    }
                    _ => Ended::Failed(ChildStatus::Exited(1)),
                };
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break Ended::TimedOut;
            }
            // The channel is watched until pgleader is gone (end-of-file stays readable).
            let mut fds = vec![PollFd::new(self.signalfd.as_fd(), PollFlags::POLLIN)];
            let channel_at = (!self.pgleader_gone).then(|| {
                fds.push(PollFd::new(self.channel.as_fd(), PollFlags::POLLIN));
                fds.len() - 1
            });
            let output_at = running.output_fd().map(|fd| {
                fds.push(PollFd::new(fd, PollFlags::POLLIN));
                fds.len() - 1
            });
            // `--pre-start` stands where the command will, deadline included; `--post-stop`
            // follows a tree that is gone.
            let watch_at = self
                .watch
                .as_ref()
                .filter(|_| hook == Hook::PreStart)
                .map(|watch| {
                    fds.push(PollFd::new(watch.fd(), PollFlags::POLLIN));
                    fds.len() - 1
                });
            let wait = PollTimeout::try_from(left.as_millis().clamp(1, 60_000) as i32)
                .unwrap_or(PollTimeout::MAX);
            match poll(&mut fds, wait) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(_) => break Ended::Interrupted,
            }
            let ready: Vec<bool> = fds.iter().map(|fd| fd.any().unwrap_or(true)).collect();
            drop(fds);
            if output_at.is_some_and(|at| ready[at]) {
                running.read_output();
            }
            if channel_at.is_some_and(|at| ready[at]) {
                match read_request(&mut self.channel) {
                    Request::None => {}
                    Request::Stopping => {
                        if let Some(watch) = self.watch.as_mut().filter(|_| hook == Hook::PreStart)
                        {
                            watch.pgleader_stops();
                        }
                    }
                    // Pre-start stands where the command will: its kill timeout covers it.
                    Request::KillEverything if hook == Hook::PreStart => break Ended::Interrupted,
                    // A kill timeout that ran out as the tree ended: that tree is gone.
                    Request::KillEverything => {}
                    Request::Abort => break Ended::Interrupted,
                    Request::PgleaderGone => {
                        self.pgleader_gone = true;
                        if hook == Hook::PreStart {
                            break Ended::Interrupted;
                        }
                    }
                }
            }
            if watch_at.is_some_and(|at| ready[at])
                && let Some(watch) = &mut self.watch
            {
                match watch.check(|| stopping_waits(&self.channel)) {
                    Step::Wait => {}
                    Step::Stop => {
                        if self.begin_own_stop() {
                            break Ended::Interrupted;
                        }
                    }
                    Step::Escalate => {
                        self.log_escalation();
                        break Ended::Interrupted;
                    }
                }
            }
            if ready[0] {
                self.reap();
            }
        };
        // Whatever is left of the hook (its leftovers, or all of it) goes now, and its output
        // is read to the end.
        self.kill_everything();
        self.hook = None;
        // Every writer is dead now, so the pipe ends soon; a copy handed to some process out
        // of the keeper's reach is not waited for.
        for _ in 0..10 {
            let Some(fd) = running.output_fd() else {
                break;
            };
            let _ = poll(
                &mut [PollFd::new(fd, PollFlags::POLLIN)],
                PollTimeout::from(10u8),
            );
            running.read_output();
        }
        let took = running.started.elapsed();
        match ended {
            Ended::Passed => info!(
                event = "hook_finished",
                hook = hook.name(),
                elapsed_ms = took.as_millis() as u64,
                "--{hook} finished in {}",
                for_people(took)
            ),
            ended => warn!(
                event = "hook_failed",
                hook = hook.name(),
                elapsed_ms = took.as_millis() as u64,
                "--{hook} failed: {}",
                hook::describe(ended.code())
            ),
        }
        ended
    }
}
