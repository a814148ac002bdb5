//! The release artifacts in dist/, as users get them: the static binary in an empty root, the
//! tarball and its checksums, the Debian package installed into a clean Debian root, and the
//! image run with podman against a real PostgreSQL.
//!
//! `scripts/release` makes the artifacts; `.ci/run` then runs these tests with
//! `cargo test --locked --test release`. A plain `cargo test` leaves them out (`test = false`
//! in Cargo.toml): they need the artifacts, root, debootstrap and podman, none of which a
//! developer's test run should demand. Run on their own, a missing artifact or tool fails the
//! test with what to do, as everywhere else.

#[path = "../integration/harness/mod.rs"]
#[expect(
    dead_code,
    unused_imports,
    reason = "the integration tests' harness, of which these tests use a part"
)]
mod harness;

mod artifacts;
mod binary;
mod image;
mod package;
