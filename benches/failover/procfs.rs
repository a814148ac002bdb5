//! What the benchmark reads from `/proc`: a process's resident memory and CPU time, the
//! process tree (to find pgleader's keeper and PostgreSQL's backends), and the machine the
//! figures were measured on.

use std::fs;
use std::time::Duration;

/// Resident memory (VmRSS) in KiB; `None` if the process is gone.
pub fn rss_kib(pid: i32) -> Option<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
}

/// CPU time of a process: what its live threads have run, in nanoseconds, from
/// `/proc/PID/task/*/schedstat`. The clock ticks of `/proc/PID/stat` (10 ms) would read an idle
/// pgleader's minute as zero. Where schedstat is missing, the ticks are the fallback.
pub fn cpu_time(pid: i32) -> Option<Duration> {
    scheduled_time(pid).or_else(|| ticked_time(pid))
}

/// Whether [`cpu_time`] reads nanoseconds here, for the report.
pub fn cpu_time_source() -> &'static str {
    if scheduled_time(std::process::id() as i32).is_some() {
        "/proc/PID/task/*/schedstat (nanoseconds; threads that exited during the window are not counted)"
    } else {
        "user + system time from /proc/PID/stat (clock ticks of 10 ms: schedstat is missing)"
    }
}

fn scheduled_time(pid: i32) -> Option<Duration> {
    let tasks = fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut total = 0u64;
    for task in tasks.flatten() {
        let schedstat = fs::read_to_string(task.path().join("schedstat")).ok()?;
        total += schedstat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(Duration::from_nanos(total))
}

fn ticked_time(pid: i32) -> Option<Duration> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses; the fields after its last `)` do not.
    let (_, rest) = stat.rsplit_once(") ")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (state); utime and stime are fields 14 and 15.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf only reads a system constant.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    Some(Duration::from_secs_f64(
        ticks as f64
            / if per_second > 0 {
                per_second as f64
            } else {
                100.0
            },
    ))
}

/// The resident memory (VmRSS, KiB) of `pid` and of its children together, and how many
/// children it has: from `/proc/PID/task/*/children` and each one's `statm`, cheap enough to
/// read every 100 ms beside a burst of a thousand processes.
pub fn tree_rss_kib(pid: i32) -> (u64, usize) {
    let mut pids = vec![pid];
    if let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) {
        for task in tasks.flatten() {
            if let Ok(children) = fs::read_to_string(task.path().join("children")) {
                pids.extend(
                    children
                        .split_whitespace()
                        .filter_map(|c| c.parse::<i32>().ok()),
                );
            }
        }
    }
    // SAFETY: sysconf only reads a system constant.
    let page_kib = (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(4096) as u64 / 1024;
    let kib = pids
        .iter()
        .filter_map(|pid| {
            let statm = fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
            statm.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .sum::<u64>()
        * page_kib;
    (kib, pids.len() - 1)
}

/// The pids whose parent is `parent`.
pub fn children(parent: i32) -> Vec<i32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| parent_of(*pid) == Some(parent))
        .collect()
}

/// The local ports of the IPv4 TCP sockets `pid` has open: what a server's `MONITOR` shows as
/// the client's address, so that each command can be put down to the process that sent it.
pub fn tcp_ports(pid: i32) -> Vec<u16> {
    let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    let inodes: Vec<String> = fds
        .flatten()
        .filter_map(|fd| {
            let link = fs::read_link(fd.path()).ok()?;
            let inode = link.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?;
            Some(inode.to_owned())
        })
        .collect();
    // `sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...`, the
    // address as hex `0100007F:9C40`.
    let table = fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let inode = fields.get(9)?;
            if !inodes.iter().any(|ours| ours == inode) {
                return None;
            }
            let (_, port) = fields.get(1)?.split_once(':')?;
            u16::from_str_radix(port, 16).ok()
        })
        .collect()
}

fn parent_of(pid: i32) -> Option<i32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(") ")?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// CPU time used by a set of processes between two readings: what each process present at
/// the end used since the start (all of it, for a process that started in between).
#[derive(Debug)]
pub struct CpuMeter {
    start: Vec<(i32, Duration)>,
}

impl CpuMeter {
    pub fn start(pids: &[i32]) -> CpuMeter {
        CpuMeter {
            start: pids
                .iter()
                .filter_map(|pid| Some((*pid, cpu_time(*pid)?)))
                .collect(),
        }
    }

    pub fn used(&self, pids: &[i32]) -> Duration {
        pids.iter()
            .filter_map(|pid| {
                let now = cpu_time(*pid)?;
                let before = self
                    .start
                    .iter()
                    .find(|(started, _)| started == pid)
                    .map_or(Duration::ZERO, |(_, time)| *time);
                Some(now.saturating_sub(before))
            })
            .sum()
    }
}

/// The machine, as the report describes it.
#[derive(Debug)]
pub struct Machine {
    pub cpu: String,
    pub cores: usize,
    pub memory: String,
    pub kernel: String,
    pub os: String,
}

impl Machine {
    pub fn read() -> Machine {
        let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|line| line.strip_prefix("model name"))
            .and_then(|rest| rest.split_once(':'))
            .map_or_else(|| "unknown".to_owned(), |(_, name)| name.trim().to_owned());
        let memory = fs::read_to_string("/proc/meminfo")
            .unwrap_or_default()
            .lines()
            .find_map(|line| line.strip_prefix("MemTotal:"))
            .and_then(|kib| kib.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or_else(
                || "unknown".to_owned(),
                |kib| format!("{:.1} GiB", kib as f64 / 1024.0 / 1024.0),
            );
        let os = fs::read_to_string("/etc/os-release")
            .unwrap_or_default()
            .lines()
            .find_map(|line| line.strip_prefix("PRETTY_NAME="))
            .map_or_else(
                || "unknown".to_owned(),
                |name| name.trim_matches('"').to_owned(),
            );
        Machine {
            cpu,
            cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
            memory,
            kernel: fs::read_to_string("/proc/sys/kernel/osrelease").map_or_else(
                |_| "unknown".to_owned(),
                |release| release.trim().to_owned(),
            ),
            os,
        }
    }
}
