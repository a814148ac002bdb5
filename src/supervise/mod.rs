//! Supervising the command: the state machine of `pgleader run`, the job and its keeper
//! process, the signals pgleader receives, and what `/proc` says about a process group.

pub mod job;
pub mod keeper;
pub mod procfs;
pub mod signals;
pub mod supervisor;
