//! The static binary and the tarball: no interpreter, no shared library, runs in an empty root
//! and finds its database through /etc/hosts there; the tarball holds what it should and every
//! checksum matches.

use std::fs;
use std::process::Command;

use crate::artifacts::{VERSION, binary, dist, require_root, run_ok, temp_dir};
use crate::harness::{Cluster, Proc, require_tool, unique_lock};

#[test]
fn the_static_binary_needs_no_interpreter_and_no_shared_library() {
    require_tool(
        "readelf",
        "the binary's headers are read with it (apt-get install binutils)",
    );
    let mut headers = Command::new("readelf");
    headers.arg("-lW").arg(binary());
    let headers = run_ok("readelf -l", headers).join("\n");
    assert!(!headers.contains("INTERP"), "{headers}");
    let mut dynamic = Command::new("readelf");
    dynamic.arg("-dW").arg(binary());
    let dynamic = run_ok("readelf -d", dynamic).join("\n");
    // A static-pie relocates itself at start (address-space randomisation) from a dynamic
    // section of its own; it must name no library, and no path to look for one.
    for tag in ["NEEDED", "RPATH", "RUNPATH"] {
        assert!(!dynamic.contains(tag), "{tag} in:\n{dynamic}");
    }
}

#[test]
fn the_static_binary_leads_from_an_empty_root_and_resolves_names_from_etc_hosts() {
    require_root("running the binary in an empty root");
    require_tool(
        "unshare",
        "the binary is run in an empty root with it (apt-get install util-linux)",
    );
    let root = temp_dir("empty-root");
    fs::create_dir_all(root.join("etc")).expect("create etc");
    fs::create_dir_all(root.join("proc")).expect("create proc");
    fs::copy(binary(), root.join("pgleader")).expect("copy the binary");
    fs::write(root.join("etc/hosts"), "127.0.0.1 db.pgleader.test\n").expect("write hosts");
    // NSS modules that static glibc cannot load are listed, as on many hosts: they are passed
    // over, and files (then DNS, through resolv.conf) still answer.
    fs::write(
        root.join("etc/nsswitch.conf"),
        "hosts: files mymachines resolve [!UNAVAIL=return] dns myhostname\n",
    )
    .expect("write nsswitch.conf");

    let cluster = Cluster::shared();
    let url = format!(
        "postgres://postgres@db.pgleader.test:{}/postgres",
        cluster.port
    );
    let mut command = Command::new("unshare");
    command
        .args(["--mount", "--pid", "--fork", "--kill-child", "--mount-proc"])
        .arg(format!("--root={}", root.display()))
        .args([
            "/pgleader",
            "run",
            "--once",
            "--restart-fence=0",
            "-d",
            &url,
        ])
        .args(["--lock-id", &unique_lock().to_string()])
        .args(["--", "/pgleader", "--version"])
        .env_clear();
    let process = Proc::spawn("pgleader in an empty root", command);
    let (status, stdout, _) = process.finish();
    let _ = fs::remove_dir_all(&root);
    assert!(status.success(), "{}", process.dump());
    // The command ran as the leader: pgleader started the keeper and the command from nothing
    // but its own file.
    assert_eq!(
        stdout,
        [format!("pgleader {VERSION}")],
        "{}",
        process.dump()
    );
}

#[test]
fn the_tarball_holds_the_binary_manual_completions_readme_and_licences_and_checksums_match() {
    let name = format!("pgleader-{VERSION}-x86_64-linux");
    let tarball = dist(&format!("{name}.tar.gz"));
    let mut check = Command::new("sha256sum");
    check
        .args(["--check", "--strict"])
        .arg(dist("SHA256SUMS"))
        .current_dir(tarball.parent().expect("dist"));
    let checked = run_ok("sha256sum --check", check);
    let listed: Vec<String> = fs::read_to_string(dist("SHA256SUMS"))
        .expect("read SHA256SUMS")
        .lines()
        .map(|line| {
            line.split_whitespace()
                .last()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    let mut expected = vec![
        name.clone(),
        format!("{name}.tar.gz"),
        format!("pgleader-{VERSION}-image.tar"),
        format!("pgleader_{VERSION}-1_amd64.deb"),
    ];
    expected.sort();
    let mut sorted = listed.clone();
    sorted.sort();
    assert_eq!(sorted, expected, "{checked:?}");

    let out = temp_dir("tarball");
    let mut untar = Command::new("tar");
    untar.arg("-xzf").arg(&tarball).arg("-C").arg(&out);
    run_ok("tar -x", untar);
    let top = out.join(&name);
    let mut files: Vec<String> = Vec::new();
    for entry in walk(&top) {
        files.push(
            entry
                .strip_prefix(&top)
                .expect("inside")
                .display()
                .to_string(),
        );
    }
    files.sort();
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    // The reference in docs/ travels with the guide.
    let mut expected: Vec<String> = [
        "LICENSE-APACHE",
        "LICENSE-MIT",
        "README.md",
        "completions/_pgleader",
        "completions/pgleader.bash",
        "completions/pgleader.fish",
        "pgleader",
        "pgleader.1",
    ]
    .map(String::from)
    .into();
    for entry in fs::read_dir(repo.join("docs")).expect("docs/") {
        let name = entry.expect("an entry of docs/").file_name();
        expected.push(format!("docs/{}", name.to_string_lossy()));
    }
    expected.sort();
    assert_eq!(files, expected);
    let same = |inside: &str, original: &std::path::Path| {
        assert_eq!(
            fs::read(top.join(inside)).expect("read from the tarball"),
            fs::read(original).expect("read the original"),
            "{inside} differs from {}",
            original.display()
        );
    };
    same("pgleader", &binary());
    same("pgleader.1", &repo.join("man/pgleader.1"));
    same("completions/_pgleader", &repo.join("completions/_pgleader"));
    let _ = fs::remove_dir_all(&out);
}

/// Every file under `dir`.
fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).expect("read a directory").flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}
