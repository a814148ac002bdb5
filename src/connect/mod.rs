//! Reaching the server: connection settings read the way libpq reads them (URL or key=value,
//! PG* variables, `.pgpass`), and TLS through rustls. Nothing here knows about locks.

pub mod conninfo;
pub mod tls;
