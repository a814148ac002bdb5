//! yacron, the peer of scenario 14 on one host (no fleet): a cron daemon in Python that reads a
//! YAML file, installed with pip (pinned) into a scratch directory under the target directory,
//! never into the repository or the system's Python. It wakes once a minute, on the minute, and
//! tests each job's schedule against that minute (`yacron/cron.py`, `WAKEUP_INTERVAL`), so its
//! finest schedule is every minute: its jobs run every minute here, where pgleader's run every
//! second, and its lateness is measured on the first whole minute after it started.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread::sleep;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;

use crate::figures::{CrontabCost, Figures};
use crate::harness::Stream;
use crate::procfs;
use crate::tools::{Candidate, pip_install};

/// The yacron release the peer runs, pinned so that runs compare.
pub const VERSION: &str = "0.19.0";

/// The label of yacron's rows.
pub const LABEL: &str = "yacron 0.19.0";

/// When yacron's RSS is read, from its start.
const RSS_AFTER: Duration = Duration::from_secs(10);

/// Where pip installs yacron and its dependencies.
fn site() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("bench-peers")
        .join(format!("yacron-{VERSION}"))
}

/// Installs yacron into [`site`] with pip, unless it is there already; fails saying what to
/// install when pip cannot.
pub fn ensure_installed() -> anyhow::Result<()> {
    let site = site();
    let importable = |site: &Path| {
        Command::new("python3")
            .env("PYTHONPATH", site)
            .args(["-m", "yacron", "--version"])
            .output()
            .is_ok_and(|out| {
                out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == VERSION
            })
    };
    pip_install(&format!("yacron=={VERSION}"), &site, importable)
}

/// A running yacron with `jobs` every-minute jobs.
pub struct Yacron {
    candidate: Candidate,
    started: Instant,
    started_wall: SystemTime,
    jobs: usize,
}

impl Yacron {
    /// Installs yacron if needed, writes its configuration and starts it.
    pub fn start(jobs: usize) -> anyhow::Result<Yacron> {
        ensure_installed()?;
        let mut yaml = String::from("defaults:\n  shell: /bin/bash\njobs:\n");
        for n in 1..=jobs {
            yaml.push_str(&format!(
                "  - name: j{n}\n    command: echo y j{n} $EPOCHREALTIME\n    schedule: \"* * * * *\"\n"
            ));
        }
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bench-cron");
        std::fs::create_dir_all(&dir)?;
        let config = dir.join(format!("yacron-{}.yaml", std::process::id()));
        std::fs::write(&config, yaml)?;
        let mut command = Command::new("python3");
        command
            .env_clear()
            .env(
                "PATH",
                std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into()),
            )
            .env("PYTHONPATH", site())
            .args(["-m", "yacron", "-c"])
            .arg(&config);
        Ok(Yacron {
            candidate: Candidate::spawn("yacron", command),
            started: Instant::now(),
            started_wall: SystemTime::now(),
            jobs,
        })
    }

    /// Its RSS [`RSS_AFTER`] after its start, and the lateness of each job's run on the first
    /// whole minute at least 2 s after its start, with a note for its row (the scenario,
    /// `cron.rs`, makes the row: it knows the jobs and the row's place).
    pub fn finish(self) -> anyhow::Result<(Figures, String, CrontabCost)> {
        let window = RSS_AFTER;
        if let Some(rest) = window.checked_sub(self.started.elapsed()) {
            sleep(rest);
        }
        let pid = self.candidate.pid();
        let rss = procfs::rss_kib(pid)
            .with_context(|| format!("yacron is gone\n{}", self.candidate.dump()))?;
        let start = self.started_wall.duration_since(UNIX_EPOCH)?.as_secs_f64();
        let minute = ((start + 2.0) / 60.0).ceil() * 60.0;
        let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs_f64();
        eprintln!(
            "bench: 14. crontab: yacron, {} every-minute jobs: waiting {:.0} s for its minute",
            self.jobs,
            (minute - now).max(0.0)
        );
        let deadline = Instant::now() + Duration::from_secs_f64((minute - now).max(0.0) + 30.0);
        let mut late: Vec<f64>;
        loop {
            late = self
                .candidate
                .lines(Stream::Stdout)
                .iter()
                .filter_map(|line| {
                    let epoch: f64 = line
                        .strip_prefix("y ")?
                        .split_whitespace()
                        .nth(1)?
                        .parse()
                        .ok()?;
                    (epoch >= minute && epoch < minute + 60.0).then_some((epoch - minute) * 1000.0)
                })
                .collect();
            if late.len() >= self.jobs || Instant::now() > deadline {
                break;
            }
            sleep(Duration::from_millis(200));
        }
        let mut figures = Figures::default();
        for l in &late {
            figures.sample_ms(*l);
        }
        if late.len() < self.jobs {
            figures.failure(format!(
                "{} of {} jobs ran on the minute\n{}",
                late.len(),
                self.jobs,
                self.candidate.dump()
            ));
        }
        let note = format!(
            "{} runs, one per job on one minute; {}",
            late.len(),
            figures
                .quantile(0.99)
                .map_or_else(String::new, |p| format!("p99 {}", crate::figures::ms(p)))
        );
        let cost = CrontabCost {
            how: format!(
                "yacron {VERSION} (Python {}), {} jobs",
                python_version(),
                self.jobs
            ),
            load: "idle",
            window,
            processes: 1,
            keepers: 0,
            connections: None,
            rss_kib: rss,
            requests_per_second: None,
        };
        Ok((figures, note, cost))
    }
}

/// `python3 --version`'s number.
fn python_version() -> String {
    crate::tools::first_line(Command::new("python3").arg("--version"))
        .trim_start_matches("Python ")
        .to_owned()
}
