//! Step-down on demand (`pgleader step-down`): how a request reaches the leader, through the
//! lock's own server and nothing else.
//!
//! A leader listens for requests once it has won: on PostgreSQL it LISTENs on its session,
//! on Redis it SUBSCRIBEs on its session's connection, in both cases sent beside the fencing
//! token's request so that winning costs no extra round trip. Followers do not listen: a
//! PostgreSQL follower waits inside a statement and could not hear anything promptly anyway.
//! The requester sends the request's id on the lock's channel (`pg_notify`, `PUBLISH`); whoever
//! may connect to the server as a role that can do that may ask. A leader that hears a request
//! stops its command as a planned handoff does, releases the lock, and queues again after a
//! pause, so that a waiting replica wins.

use tokio::sync::mpsc;

/// The request ids a leading session heard. A backend that cannot hear any hands out a
/// receiver whose sender is gone.
pub type Requests = mpsc::UnboundedReceiver<String>;

/// Where a session passes on what it heard (from its `ended` future, which the leader polls
/// all along).
pub type Heard = mpsc::UnboundedSender<String>;

/// A receiver that never yields: for a backend that has no way to hear a request.
pub fn deaf() -> Requests {
    mpsc::unbounded_channel().1
}

/// A request id no other request has: this process, and the clock.
pub fn request_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_nanos());
    format!("{}-{nanos:x}", std::process::id())
}

/// A payload worth passing on: a request id (`<pid>-<hex>`); anything else someone sent on the
/// channel is not a request.
pub fn is_request(payload: &str) -> bool {
    payload.len() <= 64
        && payload.split_once('-').is_some_and(|(pid, clock)| {
            !pid.is_empty()
                && !clock.is_empty()
                && pid.bytes().all(|byte| byte.is_ascii_digit())
                && clock.bytes().all(|byte| byte.is_ascii_hexdigit())
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_requests_and_differ() {
        let (a, b) = (request_id(), request_id());
        assert!(is_request(&a), "{a}");
        assert_ne!(a, b);
        assert!(!is_request(""));
        assert!(!is_request("took"));
        assert!(!is_request("'; DROP"));
    }
}
