//! PostgreSQL: the first backend behind the election's boundary.

pub mod conninfo;
pub mod ledger;
pub mod session;
pub mod tls;
pub mod version;
