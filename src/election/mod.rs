//! The election: one PostgreSQL session that waits for, confirms and releases an advisory
//! lock, the lock's key, the lease the server keeps for a silent leader, and the backoff
//! between attempts. This is the boundary a second backend (Redis) would implement.

pub mod backoff;
pub mod lease;
pub mod lock;
