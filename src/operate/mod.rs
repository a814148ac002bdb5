//! What operators see and use around the supervisor: logs, systemd notifications,
//! `pgleader status`, and the generated manual page and completions. These read the
//! supervisor's state; none of them drives it.

pub mod docs;
pub mod logging;
pub mod notify;
pub mod status;
