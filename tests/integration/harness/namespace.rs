//! The processes of a pid namespace (a container's, or one made with `unshare --pid`), seen
//! from outside: for the tests of pgleader as PID 1.

use std::fs;

/// One process in the namespace, seen from outside.
#[derive(Debug)]
pub struct NsProcess {
    pub host_pid: i32,
    /// The pid inside the namespace (the last NSpid field).
    pub ns_pid: i32,
    pub parent: i32,
    pub state: char,
}

/// Every process in the pid namespace of `member` (host pids).
pub fn namespace_processes(member: i32) -> Vec<NsProcess> {
    let Ok(ns) = fs::read_link(format!("/proc/{member}/ns/pid")) else {
        return Vec::new();
    };
    fs::read_dir("/proc")
        .expect("read /proc")
        .flatten()
        .filter_map(|entry| {
            let host_pid: i32 = entry.file_name().to_str()?.parse().ok()?;
            if fs::read_link(entry.path().join("ns/pid")).ok()? != ns {
                return None;
            }
            let stat = fs::read_to_string(entry.path().join("stat")).ok()?;
            let (_, rest) = stat.rsplit_once(") ")?;
            let mut fields = rest.split_whitespace();
            let state = fields.next()?.chars().next()?;
            let parent = fields.next()?.parse().ok()?;
            let status = fs::read_to_string(entry.path().join("status")).ok()?;
            let ns_pid = status
                .lines()
                .find_map(|line| line.strip_prefix("NSpid:"))?
                .split_whitespace()
                .last()?
                .parse()
                .ok()?;
            Some(NsProcess {
                host_pid,
                ns_pid,
                parent,
                state,
            })
        })
        .collect()
}
