//! What operators see and use around the supervisor: logs, systemd notifications, the HTTP
//! endpoint and its metrics, `pgleader status`, and the generated manual page and completions.
//! These read the supervisor's state; none of them drives it.

pub mod docs;
pub mod http;
pub mod logging;
pub mod metrics;
pub mod notify;
pub mod status;
pub mod telemetry;
pub mod watch;
