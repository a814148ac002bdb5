//! What operators see and use around the supervisor: logs, systemd notifications, the HTTP
//! endpoint and its metrics, `pgleader status`, and the generated manual page and completions.
//! These read the supervisor's state; none of them drives it. They sit below `supervise/`,
//! which publishes into them, and above `election/` and `schedule/`: `status` and `status
//! --watch` read any backend through the election's `Observer`, never a backend's own types.

pub mod crontab_check;
pub mod docs;
pub mod http;
pub mod logging;
pub mod metrics;
pub mod notify;
pub mod pause;
pub mod pings;
pub mod run_now;
pub mod status;
pub mod step_down;
pub mod telemetry;
pub mod watch;
