//! Where to connect and as whom: a `postgres://` URL or a `key=value` conninfo string, the
//! `PG*` environment variables psql reads, psql's defaults, and the password file.
//!
//! tokio-postgres parses URLs too, but it rejects every libpq keyword it does not know
//! (`sslrootcert`, `passfile`, `sslmode=verify-full`) and reads neither the environment nor
//! `.pgpass`. Users copy connection strings from libpq programs, so this module follows libpq:
//! values in the string win over the environment, the environment wins over the defaults.
//!
//! The password never leaves this module in readable form except into the driver's
//! configuration: [`ConnSettings`] prints as `user@host:port/dbname`, and parse errors name the
//! part that is wrong, never its value.
//!
//! In four parts: the settings a session is opened with (`settings.rs`), reading a string into
//! its parameters (`parse.rs`), the password file (`pgpass.rs`), and [`resolve`], which fills
//! in what the string leaves out (`build.rs`).

mod build;
mod parse;
mod pgpass;
mod settings;

pub use build::resolve;
pub use parse::ConnInfoError;
pub use settings::{
    ChannelBinding, ConnSettings, DEFAULT_CONNECT_TIMEOUT, DEFAULT_PORT, DEFAULT_SOCKET_DIR,
    Endpoint, Host, Password, SYSTEM_ROOTS, SslMode, TargetSessionAttrs, TlsSettings,
};
