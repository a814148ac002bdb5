//! The process table, read from /proc: enough to find a process's descendants (the keeper
//! kills its whole subtree, including processes that left its process group with setsid) and
//! the living members of a process group (pgleader does not release the lock while any is
//! left). A zombie counts as gone: it runs nothing, and whoever its parent is will reap it.

use std::fs;

/// One line of the process table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Process {
    pub pid: i32,
    pub ppid: i32,
    pub pgrp: i32,
    /// Zombie or dead: exited, waiting to be reaped.
    pub exited: bool,
}

/// Every process visible in /proc. Processes that vanish while being read are skipped.
pub fn processes() -> Vec<Process> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| parse_stat(pid, &fs::read_to_string(format!("/proc/{pid}/stat")).ok()?))
        .collect()
}

/// Parses `/proc/<pid>/stat`: `pid (comm) state ppid pgrp ...`, where comm may contain spaces
/// and parentheses, so the fields are read after the last ')'.
fn parse_stat(pid: i32, stat: &str) -> Option<Process> {
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?;
    let ppid = fields.next()?.parse().ok()?;
    let pgrp = fields.next()?.parse().ok()?;
    Some(Process {
        pid,
        ppid,
        pgrp,
        exited: matches!(state, "Z" | "X" | "x"),
    })
}

/// The living descendants of `root`, parents before their children.
pub fn descendants(root: i32) -> Vec<i32> {
    let table = processes();
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(
            table
                .iter()
                .filter(|process| process.ppid == parent && !process.exited)
                .map(|process| process.pid),
        );
        i += 1;
    }
    found.remove(0);
    found
}

/// The living members of a process group.
pub fn group_members(pgrp: i32) -> Vec<i32> {
    // No process at all in the group, zombie or not: the common case once the keeper is reaped,
    // answered without reading the whole process table (which takes milliseconds on a busy
    // host, on the way to releasing the lock).
    if nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pgrp), None)
        == Err(nix::errno::Errno::ESRCH)
    {
        return Vec::new();
    }
    processes()
        .into_iter()
        .filter(|process| process.pgrp == pgrp && !process.exited)
        .map(|process| process.pid)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_stat_line_whose_command_has_spaces_and_parentheses() {
        let stat = "4242 (my (odd) cmd) S 17 4242 4242 0 -1 4194560 0 0 0";
        assert_eq!(
            parse_stat(4242, stat),
            Some(Process {
                pid: 4242,
                ppid: 17,
                pgrp: 4242,
                exited: false
            })
        );
        let zombie = "7 (sh) Z 1 7 7 0";
        assert!(parse_stat(7, zombie).is_some_and(|process| process.exited));
    }

    #[test]
    fn finds_this_process_in_its_group_and_a_child_among_its_descendants() {
        let me = std::process::id() as i32;
        let group = nix::unistd::getpgrp().as_raw();
        assert!(group_members(group).contains(&me));
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .expect("spawn sleep");
        assert!(descendants(me).contains(&(child.id() as i32)));
        child.kill().expect("kill");
        child.wait().expect("wait");
    }
}
