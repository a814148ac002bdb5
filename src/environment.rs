//! Where pgleader reads the world around it: environment variables, the home directory, the
//! operating-system user, whether a Unix socket exists. One trait, so that tests can supply
//! their own; a leaf that imports nothing of the crate, so that the command line's settings
//! (`config.rs`) and the backends' connection settings read the environment the same way.

use std::ffi::OsString;
use std::fs;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

/// A source of environment variables, so tests can supply their own.
pub trait Environment {
    fn var(&self, name: &str) -> Option<String>;
    /// A variable as the operating system holds it, set but empty or not UTF-8 as it may be:
    /// `PATH`, where an empty value means the current directory. A test's environment, whose
    /// values are all text, may leave it to `var`.
    fn var_os(&self, name: &str) -> Option<OsString> {
        self.var(name).map(OsString::from)
    }
    /// The home directory, for `~/.pgpass`.
    fn home(&self) -> Option<PathBuf> {
        self.var("HOME").map(PathBuf::from)
    }
    /// The operating-system user name, psql's default user.
    fn os_user(&self) -> Option<String>;
    /// Whether a Unix socket exists at this path.
    fn socket_exists(&self, path: &Path) -> bool;
}

/// The real process environment.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessEnvironment;

impl Environment for ProcessEnvironment {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok().filter(|value| !value.is_empty())
    }

    fn var_os(&self, name: &str) -> Option<OsString> {
        std::env::var_os(name)
    }

    fn os_user(&self) -> Option<String> {
        nix::unistd::User::from_uid(nix::unistd::geteuid())
            .ok()
            .flatten()
            .map(|user| user.name)
            .or_else(|| self.var("USER"))
    }

    fn socket_exists(&self, path: &Path) -> bool {
        fs::metadata(path).is_ok_and(|meta| meta.file_type().is_socket())
    }
}
