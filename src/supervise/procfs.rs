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

/// The descendants of `root`, parents before their children. Each process's own children are
/// read from `/proc/<pid>/task/<tid>/children`, so only the tree is read: the keeper calls this
/// on the way to releasing the lock after a kill -9, and reading the whole process table takes
/// milliseconds on a busy host. A kernel without those files (built without
/// CONFIG_PROC_CHILDREN) gets the whole table read instead. A zombie may be listed (signalling
/// it is harmless); a process forked while this runs may be missed, so the keeper repeats until
/// it has no children left.
pub fn descendants(root: i32) -> Vec<i32> {
    let Some(mut found) = children(root) else {
        return descendants_from_table(root);
    };
    let mut i = 0;
    while i < found.len() {
        let grandchildren = children(found[i]).unwrap_or_default();
        found.extend(grandchildren);
        i += 1;
    }
    found
}

/// The children of `pid`, from the children file of each of its threads (a child belongs to
/// the thread that forked it); `None` when the kernel has no such files.
fn children(pid: i32) -> Option<Vec<i32>> {
    let tasks = match fs::read_dir(format!("/proc/{pid}/task")) {
        Ok(tasks) => tasks,
        // Gone already: it has no children left to find.
        Err(_) => return Some(Vec::new()),
    };
    let mut found = Vec::new();
    for task in tasks.flatten() {
        match fs::read_to_string(task.path().join("children")) {
            Ok(list) => found.extend(
                list.split_whitespace()
                    .filter_map(|pid| pid.parse::<i32>().ok()),
            ),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound && task.path().exists() => {
                return None;
            }
            // The thread ended while being read.
            Err(_) => {}
        }
    }
    Some(found)
}

/// The children of this process's main thread: those it forked, and the orphans reparented to
/// it as a subreaper (the kernel hands them to the thread group's leader while it lives).
/// A kernel without those files (built without CONFIG_PROC_CHILDREN) gets the whole table read.
pub fn own_children() -> Vec<i32> {
    let pid = std::process::id();
    match fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")) {
        Ok(list) => list
            .split_whitespace()
            .filter_map(|pid| pid.parse().ok())
            .collect(),
        Err(_) => processes()
            .into_iter()
            .filter(|process| process.ppid == pid as i32)
            .map(|process| process.pid)
            .collect(),
    }
}

/// The session `pid` belongs to, if it still runs (and is no zombie).
pub fn session_of(pid: i32) -> Option<i32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?;
    if matches!(state, "Z" | "X" | "x") {
        return None;
    }
    fields.nth(2)?.parse().ok()
}

/// The value of `name` in the environment `pid` was executed with, if it can be read.
pub fn environment_value(pid: i32, name: &str) -> Option<Vec<u8>> {
    let environ = fs::read(format!("/proc/{pid}/environ")).ok()?;
    environ.split(|b| *b == 0).find_map(|entry| {
        let value = entry.strip_prefix(name.as_bytes())?.strip_prefix(b"=")?;
        Some(value.to_vec())
    })
}

/// The living descendants of `root`, parents before their children, from the whole table.
fn descendants_from_table(root: i32) -> Vec<i32> {
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
    fn finds_a_grandchild_among_the_descendants_by_the_children_files_and_by_the_table() {
        use std::io::BufRead;
        let me = std::process::id() as i32;
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & echo $!; wait"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("spawn sh");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("the grandchild's pid");
        let grandchild: i32 = line.trim().parse().expect("a pid");
        let child_pid = child.id() as i32;
        for (how, found) in [
            ("children files", descendants(me)),
            ("table", descendants_from_table(me)),
        ] {
            let at = |pid| found.iter().position(|p| *p == pid);
            assert!(
                matches!((at(child_pid), at(grandchild)), (Some(c), Some(g)) if c < g),
                "by the {how}: {found:?} lacks sh {child_pid} before its sleep {grandchild}"
            );
        }
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(grandchild),
            nix::sys::signal::Signal::SIGKILL,
        );
        child.wait().expect("wait");
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
        assert!(descendants_from_table(me).contains(&(child.id() as i32)));
        child.kill().expect("kill");
        child.wait().expect("wait");
    }
}
