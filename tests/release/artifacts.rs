//! Where the artifacts are, the tools the tests need, and a clean Debian root to install into.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use std::time::{Duration, Instant};

use crate::harness::{Proc, WAIT, require_tool};

pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// A file in dist/, which must exist.
pub fn dist(name: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("dist")
        .join(name);
    assert!(
        path.is_file(),
        "{} is missing: run scripts/release first (it makes dist/), then \
         cargo test --test release",
        path.display()
    );
    path
}

/// The static binary, as published beside the tarball.
pub fn binary() -> PathBuf {
    dist(&format!("pgleader-{VERSION}-x86_64-linux"))
}

/// The tests install packages, chroot and run containers: root only.
pub fn require_root(what: &str) {
    assert!(
        nix::unistd::geteuid().is_root(),
        "{what} needs root (chroot, dpkg into a root directory, podman): run the release \
         tests as root"
    );
}

/// Runs a command to completion, failing the test with its output unless it succeeds.
/// Returns its standard output.
pub fn run_ok(name: &str, command: Command) -> Vec<String> {
    run_ok_within(name, command, WAIT)
}

/// [`run_ok`] for the slow steps (debootstrap, image builds), with their own hard timeout.
pub fn run_ok_within(name: &str, command: Command, timeout: Duration) -> Vec<String> {
    let process = Proc::spawn(name, command);
    let deadline = Instant::now() + timeout;
    while !process.has_exited() {
        assert!(
            Instant::now() < deadline,
            "{name} did not finish within {timeout:?}\n{}",
            process.dump()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (status, stdout, _) = process.finish();
    assert!(status.success(), "{name} failed\n{}", process.dump());
    stdout
}

pub fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pgleader-release-{}-{tag}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).expect("create a temporary directory");
    dir
}

/// A pristine Debian root (minbase, plus man-db and systemd, which a machine that installs the
/// package has), the same release as this machine, made once with debootstrap from this
/// machine's own apt mirror and kept under /var/tmp for later runs. Tests copy it before
/// changing it.
pub fn debian_root() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        require_root("a Debian root made with debootstrap");
        require_tool(
            "debootstrap",
            "the package is installed into a clean Debian root made with it (apt-get install \
             debootstrap)",
        );
        let codename = os_release("VERSION_CODENAME");
        let cache = PathBuf::from(format!("/var/tmp/pgleader-release-tests/{codename}"));
        if cache.join(".complete").is_file() {
            return cache;
        }
        let building = cache.with_extension("partial");
        remove_root(&building);
        let mut debootstrap = Command::new("debootstrap");
        debootstrap
            .args(["--variant=minbase", "--include=man-db,systemd", &codename])
            .arg(&building)
            .arg(apt_mirror());
        run_ok_within("debootstrap", debootstrap, Duration::from_secs(600));
        fs::write(building.join(".complete"), "").expect("mark the root complete");
        let _ = fs::remove_dir_all(&cache);
        fs::rename(&building, &cache).expect("keep the root");
        cache
    })
}

/// Removes a root directory that an interrupted debootstrap may have left with file systems
/// mounted inside (its /proc): those are unmounted first, so nothing outside is touched.
pub fn remove_root(root: &Path) {
    let mounts = fs::read_to_string("/proc/mounts").unwrap_or_default();
    let mut inside: Vec<&str> = mounts
        .lines()
        .filter_map(|line| line.split_whitespace().nth(1))
        .filter(|point| Path::new(point).starts_with(root))
        .collect();
    inside.sort_by_key(|point| std::cmp::Reverse(point.len()));
    for point in inside {
        let mut umount = Command::new("umount");
        umount.args(["--lazy", point]);
        run_ok("umount", umount);
    }
    let _ = fs::remove_dir_all(root);
}

fn os_release(key: &str) -> String {
    fs::read_to_string("/etc/os-release")
        .expect("read /etc/os-release")
        .lines()
        .find_map(|line| line.strip_prefix(&format!("{key}=")))
        .map(|value| value.trim_matches('"').to_owned())
        .unwrap_or_else(|| panic!("no {key} in /etc/os-release"))
}

/// The Debian mirror apt uses here (deb822 `URIs:` or a one-line `deb` source), so the test
/// reaches whatever this machine may reach.
fn apt_mirror() -> String {
    let mut sources = vec![PathBuf::from("/etc/apt/sources.list")];
    if let Ok(entries) = fs::read_dir("/etc/apt/sources.list.d") {
        sources.extend(entries.flatten().map(|entry| entry.path()));
    }
    sources
        .iter()
        .filter_map(|path| fs::read_to_string(path).ok())
        .flat_map(|text| text.lines().map(str::to_owned).collect::<Vec<_>>())
        .filter_map(|line| {
            let line = line.trim();
            let uri = line.strip_prefix("URIs:").map(str::trim).or_else(|| {
                let mut words = line.strip_prefix("deb ")?.split_whitespace();
                words.find(|word| !word.starts_with('['))
            })?;
            Some(uri.split_whitespace().next()?.to_owned())
        })
        .find(|uri| uri.contains("/debian") && !uri.contains("security"))
        .expect("no Debian mirror in /etc/apt/sources.list or sources.list.d")
}

/// The released binary with the harness's clean environment (no PG* variables from the
/// developer's shell, an empty HOME, no restart fence on seconds-old test servers).
pub fn static_pgleader() -> Command {
    crate::harness::clean(Command::new(binary()))
}
