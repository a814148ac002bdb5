//! A real PgBouncer in front of a test cluster, in transaction or session mode.

use std::fs;
use std::os::unix::fs::chown;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use super::{Cluster, spawner};

const INSTALL_HINT: &str = "PgBouncer is needed by this test and was not found: install it (Debian/Ubuntu: `apt-get install pgbouncer`)";

pub struct PgBouncer {
    pub port: u16,
    dir: PathBuf,
    child: Child,
}

impl PgBouncer {
    /// Starts PgBouncer with `pool_mode` (`transaction` or `session`) in front of `cluster`.
    pub fn start(cluster: &Cluster, pool_mode: &str) -> PgBouncer {
        let binary = [
            "/usr/sbin/pgbouncer",
            "/usr/bin/pgbouncer",
            "/usr/local/bin/pgbouncer",
        ]
        .into_iter()
        .map(PathBuf::from)
        .find(|path| path.is_file())
        .unwrap_or_else(|| panic!("{INSTALL_HINT}"));
        let port = super::cluster::free_port();
        let dir = cluster.base.join(format!("pgbouncer-{pool_mode}-{port}"));
        fs::create_dir_all(&dir).expect("create the PgBouncer directory");
        fs::write(
            dir.join("pgbouncer.ini"),
            format!(
                "[databases]\n\
                 postgres = host=127.0.0.1 port={upstream} dbname=postgres\n\
                 [pgbouncer]\n\
                 listen_addr = 127.0.0.1\n\
                 listen_port = {port}\n\
                 unix_socket_dir =\n\
                 auth_type = trust\n\
                 auth_file = {dir}/users.txt\n\
                 pool_mode = {pool_mode}\n\
                 default_pool_size = 10\n\
                 ignore_startup_parameters = extra_float_digits\n",
                upstream = cluster.port,
                dir = dir.display(),
            ),
        )
        .expect("write pgbouncer.ini");
        fs::write(dir.join("users.txt"), "\"postgres\" \"\"\n").expect("write users.txt");
        let mut command = Command::new(binary);
        command.arg(dir.join("pgbouncer.ini"));
        // PgBouncer refuses to run as root.
        if let Some(owner) = cluster.owner() {
            for path in [
                dir.clone(),
                dir.join("pgbouncer.ini"),
                dir.join("users.txt"),
            ] {
                chown(&path, Some(owner.uid.as_raw()), Some(owner.gid.as_raw())).expect("chown");
            }
            command.uid(owner.uid.as_raw()).gid(owner.gid.as_raw());
        }
        let log = fs::File::create(dir.join("pgbouncer.log")).expect("log");
        command
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        let mut child = spawner::spawn(command, Signal::SIGKILL)
            .unwrap_or_else(|err| panic!("cannot start PgBouncer ({err}). {INSTALL_HINT}"));
        let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                panic!(
                    "PgBouncer exited at start-up ({status}):\n{}",
                    fs::read_to_string(dir.join("pgbouncer.log")).unwrap_or_default()
                );
            }
            if postgres::Client::connect(&url, postgres::NoTls).is_ok() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "PgBouncer did not start within 30 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        PgBouncer { port, dir, child }
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_dir_all(&self.dir);
    }
}
