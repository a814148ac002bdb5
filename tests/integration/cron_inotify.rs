//! `pgleader cron --inotify`: the crontab reread when its content changes, with no signal: a
//! file rewritten in place, and a Kubernetes ConfigMap's volume, whose update is a symlink
//! swap that leaves the file read before untouched; a rewrite to the same content rereads
//! nothing, and a bad file is refused with the old crontab kept, as on HUP.

use std::path::{Path, PathBuf};

use crate::cron_fleet::{RAN, replica_with};
use crate::crontab::File;
use crate::harness::{Stream, unique_lock};

/// Two every-second jobs' lines, named as given.
fn jobs(names: &[&str]) -> String {
    names
        .iter()
        .map(|name| format!("# pgleader: name={name}\n* * * * * * * {RAN}\n"))
        .collect()
}

/// A directory laid out as the kubelet lays out a ConfigMap's volume: `crontab` ->
/// `..data/crontab`, `..data` -> `..<version>/`.
struct ConfigMap {
    dir: PathBuf,
}

impl ConfigMap {
    fn new(text: &str) -> ConfigMap {
        let dir = std::env::temp_dir().join(format!(
            "pgleader-configmap-{}-{}",
            std::process::id(),
            unique_lock()
        ));
        std::fs::create_dir_all(&dir).expect("the volume");
        let map = ConfigMap { dir };
        map.version("1", text);
        std::os::unix::fs::symlink("..1", map.dir.join("..data")).expect("..data");
        std::os::unix::fs::symlink("..data/crontab", map.dir.join("crontab")).expect("the key");
        map
    }

    fn version(&self, version: &str, text: &str) {
        let dir = self.dir.join(format!("..{version}"));
        std::fs::create_dir_all(&dir).expect("a version");
        std::fs::write(dir.join("crontab"), text).expect("the crontab");
    }

    /// The kubelet's update: the new version written beside the old, `..data` swapped to it
    /// by a rename, the old version removed.
    fn update(&self, from: &str, to: &str, text: &str) {
        self.version(to, text);
        let temporary = self.dir.join("..data_tmp");
        std::os::unix::fs::symlink(format!("..{to}"), &temporary).expect("..data_tmp");
        std::fs::rename(&temporary, self.dir.join("..data")).expect("the swap");
        std::fs::remove_dir_all(self.dir.join(format!("..{from}"))).expect("the old version");
    }

    fn path(&self) -> PathBuf {
        self.dir.join("crontab")
    }
}

impl Drop for ConfigMap {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Whether `line` is the run of job `job`.
fn ran(job: &str) -> impl Fn(&str) -> bool + '_ {
    move |line: &str| line.starts_with(&format!("ran job={job} "))
}

#[test]
fn a_configmap_s_symlink_swap_is_reread_and_a_bad_version_leaves_the_old_running() {
    let map = ConfigMap::new(&jobs(&["a"]));
    let file = File(map.path());
    let a = replica_with("A", unique_lock(), &file, &["--inotify"]);
    a.wait_line_where(Stream::Stdout, "a run of a", ran("a"));

    map.update("1", "2", &jobs(&["a", "b"]));
    a.wait_log("reread the crontab: 1 added, 0 removed, 0 changed, 1 unchanged");
    a.wait_line_where(Stream::Stdout, "a run of b", ran("b"));

    // A version that does not parse: refused, naming the file and line; both jobs go on.
    map.update("2", "3", "61 * * * * true\n");
    let refused = a.wait_log("the crontab read before keeps running");
    assert!(refused.contains(":1"), "{refused}");
    let runs_of_b = a
        .lines(Stream::Stdout)
        .iter()
        .filter(|l| ran("b")(l))
        .count();
    a.wait_for_nth(Stream::Stdout, "ran job=b ", runs_of_b + 1);
    a.interrupt_cleanly();
}

#[test]
fn a_file_rewritten_in_place_is_reread_and_the_same_content_rereads_nothing() {
    let file = File::new("inotify-plain", &jobs(&["a"]));
    let a = replica_with("A", unique_lock(), &file, &["--inotify"]);
    a.wait_line_where(Stream::Stdout, "a run of a", ran("a"));

    // The same content written again, then a job added: one reread, for the job.
    rewrite(&file.0, &jobs(&["a"]));
    rewrite(&file.0, &jobs(&["a", "b"]));
    a.wait_line_where(Stream::Stdout, "a run of b", ran("b"));
    let changes: Vec<String> = a
        .lines(Stream::Stderr)
        .into_iter()
        .filter(|line| line.contains("the crontab changed (--inotify)"))
        .collect();
    assert_eq!(changes.len(), 1, "{}", a.dump());
    a.interrupt_cleanly();
}

/// Writes `text` over the file, in place, as an editor without a backup does.
fn rewrite(path: &Path, text: &str) {
    std::fs::write(path, text).expect("the crontab");
}
