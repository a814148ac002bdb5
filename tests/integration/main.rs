//! Integration tests: the real `pgleader` binary against a real PostgreSQL that the harness
//! starts itself. Faults are real: kill -9, pg_terminate_backend, signals.

mod harness;

mod containers;
mod contract;
mod cron_fleet;
mod cron_history;
mod cron_inotify;
mod cron_jitter;
mod cron_nemesis;
mod cron_output;
mod cron_pause;
mod cron_pings;
mod cron_run;
mod cron_seen;
mod crontab;
mod docs;
mod election;
mod examples;
mod failover;
mod faults;
mod frozen;
mod health;
mod hooks;
mod house;
mod nemesis;
mod notify;
mod observability;
mod quorum;
mod quorum_nemesis;
mod redis;
mod redis_cron;
mod redis_nemesis;
mod redis_shards;
mod redis_tls;
mod schedule;
mod scheduled_shards;
mod shard_nemesis;
mod shards;
mod signals;
mod step_down;
mod tls;
mod try_script;
mod usage;
mod versions;
